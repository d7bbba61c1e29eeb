"""Where the sidecars dial the trainer's transfer store (trainer_hooks/trainer_host.py): loopback on
one machine; across machines the interface that routes to the sidecar, never loopback."""

from __future__ import annotations

import socket

import pytest

from trainer_hooks.trainer_host import LOOPBACK, is_local, route_to, trainer_host


def _an_address_of_this_machine() -> str | None:
    """A non-loopback IPv4 address of this machine's interfaces, if it has one."""
    psutil = pytest.importorskip("psutil")  # the dev extra installs it
    addresses = [a.address for links in psutil.net_if_addrs().values() for a in links if a.family == socket.AF_INET]
    return next((a for a in addresses if not a.startswith("127.")), None)


def test_sidecars_on_this_machine_dial_loopback() -> None:
    urls = ["http://127.0.0.1:8000", "http://localhost:8001", f"http://{socket.gethostname()}:8002", "http://[::1]:9"]
    assert trainer_host(urls) == LOOPBACK
    assert all(is_local(h) for h in ("127.0.0.1", "127.3.2.1", "::1", "localhost"))
    assert not is_local("10.1.2.3") and not is_local("sidecar-node-7.example")


def test_a_remote_sidecar_gets_the_interface_that_routes_to_it() -> None:
    mine = _an_address_of_this_machine()
    if mine is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    # the kernel routes a packet for our own interface address over that interface: the same address
    assert route_to(mine, 8000) in (mine, LOOPBACK)
    got = trainer_host(["http://127.0.0.1:8000", f"http://{mine}:8001"])
    assert got == route_to(mine, 8001) and got != "0.0.0.0"


def test_an_unroutable_sidecar_is_a_clear_error_naming_the_option(monkeypatch: pytest.MonkeyPatch) -> None:
    class NoRoute(socket.socket):
        def connect(self, address: object) -> None:
            raise OSError(101, "Network is unreachable")

    monkeypatch.setattr(socket, "socket", NoRoute)
    with pytest.raises(OSError) as e:
        trainer_host(["http://127.0.0.1:8000", "http://203.0.113.9:8000"])
    assert "trainer_host=" in str(e.value) and "203.0.113.9:8000" in str(e.value)


def test_the_hook_gives_its_sender_the_trainer_host(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from trainer_hooks.hook import WeightSyncHook

    class Remote:  # only what _new_sender reads
        url = "http://203.0.113.9:8000"

    monkeypatch.setattr("trainer_hooks.hook.trainer_host", lambda urls: f"routed-to-{next(iter(urls))}")
    hook = WeightSyncHook(Remote(), torch.nn.Linear(2, 2), rank=0)
    sender = hook._new_sender({"backend": "gloo"}, 1)
    try:
        assert sender._host == "routed-to-http://203.0.113.9:8000"
    finally:
        sender.close()
    explicit = WeightSyncHook(Remote(), torch.nn.Linear(2, 2), rank=0, trainer_host="10.0.0.5")
    sender = explicit._new_sender({"backend": "gloo"}, 1)
    try:
        assert sender._host == "10.0.0.5"
    finally:
        sender.close()
