"""The user-facing sync's control path against a real `sidecar launch` (CPU, gloo): one sync through
SidecarClient.sync_weights is ONE HTTP request (the update carrying the start and "finish": the sender
delivers its digests over the group and the answer is the audit), counted on the wire by a transport, so
a regression to more round trips fails; a flipped byte still fails that audit naming tensor and rank.
A start the ranks refuse inside that update is the sidecar's 400/409 within seconds, not the sender's
wire timeout (the ranks refuse its plan agreement), and the group stays usable. The protocol version is
checked at /weights/init both ways: the sidecar refuses a client of another one (409 naming both), the
client refuses a sidecar that answers another one (SidecarProtocolError naming both)."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from inference.models.tiny import TinyModelSpec, random_weights
from inference.transfer.sender import WeightSender
from tests.helpers_fault import flip_env
from tests.helpers_sidecar import Sidecar, launch
from tests.helpers_weight_update import RANK
from trainer_hooks.client import (
    SidecarChecksumError,
    SidecarClient,
    SidecarProtocolError,
    SidecarRequestError,
    SidecarStateError,
)
from trainer_hooks.sync import SYNC_PROTOCOL

WIRE_TIMEOUT_S = 60.0  # the sender's: every refusal below must come long before it
FAST_S = 20.0  # a refused start's answer, on a loaded CPU box, with margin
WEIGHTS = random_weights(TinyModelSpec(seed=5))


class CountingTransport(httpx.HTTPTransport):
    """Counts the requests that reach the wire, by path."""

    def __init__(self) -> None:
        super().__init__()
        self.paths: list[str] = []
        self.timings: dict[str, str] = {}  # path -> its last answer's Server-Timing header

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.paths.append(request.url.path)
        resp = super().handle_request(request)
        self.timings[request.url.path] = resp.headers.get("server-timing", "")
        return resp


@pytest.fixture(scope="module")
def server() -> Iterator[Sidecar]:
    proc = launch()
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def sender() -> Iterator[WeightSender]:
    s = WeightSender("gloo", num_receivers=1, timeout_s=WIRE_TIMEOUT_S)
    try:
        yield s
    finally:
        s.close()


def _client(server: Sidecar) -> tuple[SidecarClient, CountingTransport]:
    wire = CountingTransport()
    return SidecarClient(server.url, timeout=60, transport=wire), wire


def _live(c: SidecarClient) -> int:
    return int(c.state()["weight_versions"]["target"])


@pytest.mark.slow
def test_a_sync_is_one_request_carrying_start_and_finish(server: Sidecar, sender: WeightSender) -> None:
    c, wire = _client(server)
    with c:
        init = c.connect_sender(sender)
        assert init["protocol"] == SYNC_PROTOCOL
        version = _live(c)
        for _ in range(3):  # the first sends the tensors, the later ones the layout key
            version += 1
            wire.paths.clear()
            result = c.sync_weights(sender, WEIGHTS, version=version)
            assert result["ok"] and result["tensors_checked"] == len(WEIGHTS), result["table"]
            assert result["algorithm"] == sender.algorithm and result["source"] == "received"
            assert wire.paths == ["/weights/update"]
            assert _live(c) == version  # committed when the one answer came
            # what scripts/bench/client_sync.py splits a control message's time by
            found = dict(re.findall(r"(app|handler|ranks);dur=([0-9.]+)", wire.timings["/weights/update"]))
            assert 0 < float(found["handler"]) <= float(found["app"]), wire.timings
            # the rank's own time on the update, inside the handler's (the rest: the sidecar's hops)
            assert 0 < float(found["ranks"]) <= float(found["handler"]), wire.timings
        metrics = c.metrics()
        for phase in ("start", "update", "finish", "audit", "total"):  # the server still reports each phase
            assert f'sidecar_weight_sync_seconds_count{{model="target",phase="{phase}"}}' in metrics


@pytest.mark.slow
def test_a_flipped_byte_fails_the_one_request_audit_naming_tensor_and_rank(sender: WeightSender) -> None:
    flipped = next(iter(WEIGHTS))
    proc = launch(env=flip_env(flipped))  # the rank flips a byte of it on arrival
    try:
        c, wire = _client(proc)
        with c:
            c.connect_sender(sender)
            for version in (1, 2):  # a failed audit leaves the group usable: the next sync is audited too
                wire.paths.clear()
                with pytest.raises(SidecarChecksumError) as err:
                    c.sync_weights(sender, WEIGHTS, version=version)
                assert wire.paths == ["/weights/update"] and err.value.status == 409
                assert flipped in err.value.message and err.value.rank == RANK, err.value.message
                state = c.state()
                assert state["torn"] == {"target": True} and state["weight_versions"] == {"target": 0}
            assert 'sidecar_audit_failures_total 2.0' in c.metrics()
    finally:
        assert proc.stop() == 0, proc.log


@pytest.mark.slow
def test_a_refused_start_is_the_sidecars_error_at_once_and_the_group_stays(server: Sidecar,
                                                                          sender: WeightSender) -> None:
    c, wire = _client(server)
    with c:
        c.connect_sender(sender)
        live = _live(c)
        t0 = time.monotonic()
        with pytest.raises(SidecarRequestError) as stale:
            c.sync_weights(sender, WEIGHTS, version=live)  # not newer than the live version
        assert stale.value.field == "version" and stale.value.status == 400
        assert time.monotonic() - t0 < FAST_S, "send() waited for its wire timeout"
        assert sender.connected and not c.state()["torn"]["target"]
        wire.paths.clear()
        assert c.sync_weights(sender, WEIGHTS, version=live + 1)["ok"]  # no re-init needed
        assert wire.paths == ["/weights/update"]


@pytest.mark.slow
def test_an_update_carries_its_start(server: Sidecar) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as http:
        r = http.post("/weights/update", json={"update_info": None})
        assert r.status_code == 422 and r.json()["error"]["field"] == "start", r.text
        bad: Any = http.post("/weights/update", json={"start": {"version": "1", "manifest": {}}})
        assert bad.status_code == 422 and bad.json()["error"]["field"] == "start.version"
        assert http.post("/weights/start", json={}).status_code == 404  # one protocol: no older routes
        assert http.post("/weights/finish", json={}).status_code == 404


@pytest.mark.slow
def test_the_sidecar_refuses_a_client_of_another_protocol(server: Sidecar, sender: WeightSender) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for spoken, named in ((SYNC_PROTOCOL + 1, f"protocol {SYNC_PROTOCOL + 1}"), (None, "no protocol version")):
            body = {"init_info": sender.init_info(), **({"protocol": spoken} if spoken is not None else {})}
            r = http.post("/weights/init", json=body)
            error = r.json()["error"]
            assert r.status_code == 409 and error["field"] == "protocol" and error["type"] == "ProtocolMismatch"
            assert named in error["message"] and f"this sidecar speaks protocol {SYNC_PROTOCOL}" in error["message"]


@pytest.mark.parametrize(("status", "answer", "said"), [
    (200, {"ranks": [None], "protocol": SYNC_PROTOCOL + 1}, f"speaks weight-sync protocol {SYNC_PROTOCOL + 1}"),
    (422, {"error": {"type": "ValidationError", "message": "protocol: Extra inputs are not permitted",
                     "field": "protocol"}}, "predates"),  # a sidecar older than versions
])
def test_the_client_refuses_a_sidecar_of_another_protocol(status: int, answer: dict, said: str) -> None:
    transport = httpx.MockTransport(lambda request: httpx.Response(status, json=answer))
    with SidecarClient("http://sidecar.test", transport=transport) as c, pytest.raises(SidecarProtocolError) as refused:
        c.init_weights({"backend": "gloo"})
    assert isinstance(refused.value, SidecarStateError) and refused.value.field == "protocol"
    assert said in str(refused.value) and f"protocol {SYNC_PROTOCOL}" in str(refused.value)
