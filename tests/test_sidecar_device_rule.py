"""The device rule through a real sidecar on the CPU: a sync whose sender picks "xxh3_64_seg64k" is audited
under it (the CPU rank computes it on the host), finish answers with the audit (no second round trip), a
repeated layout travels as its key, and GET /checksums, POST /audit and `sidecar audit --url` digest held
weights by the rule asked for, or the one the expected manifest names; received digests keep the sync's."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from checksum import ALGORITHM, DEVICE_ALGORITHM, digest_bytes, flat_bytes, manifest_from_tensors
from inference.engine.llm import LLM
from inference.models.tiny import TinyModelSpec, random_weights, write_model_dir
from inference.transfer.sender import WeightSender
from sidecar.cli.main import main
from tests.helpers_sidecar import KV_BYTES, Sidecar, launch
from trainer_hooks.client import SidecarClient, SidecarRequestError, SidecarStateError

pytestmark = pytest.mark.slow  # every test here starts real processes or runs for seconds

RANK = "dp0:pp0:tp0"


@pytest.fixture(scope="module")
def server() -> Iterator[Sidecar]:
    proc = launch()
    try:
        yield proc
    finally:
        proc.stop()


class RecordingClient(SidecarClient):
    """Keeps every request's path and JSON body."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sent: list[tuple[str, Any]] = []
        request, begin = self.wire.request, self.wire.begin

        def recorded_request(method: str, path: str, **kw: Any) -> httpx.Response:
            self.sent.append((path, kw.get("json")))
            return request(method, path, **kw)

        def recorded_begin(method: str, path: str, json: Any, timeout: float | None = None) -> Any:
            self.sent.append((path, json))
            return begin(method, path, json, timeout)

        self.wire.request, self.wire.begin = recorded_request, recorded_begin  # type: ignore[method-assign]


def started_manifests(c: RecordingClient) -> list[Any]:
    """The start manifests sync_weights sent: each rides on its /weights/update."""
    assert "/weights/start" not in [p for p, _ in c.sent], "the start rides on the update"
    return [body["start"]["manifest"] for p, body in c.sent if p == "/weights/update"]


def device_digests(named: dict[str, torch.Tensor]) -> dict[str, str]:
    return {n: digest_bytes(flat_bytes(t).numpy().tobytes(), DEVICE_ALGORITHM) for n, t in named.items()}


def test_a_device_rule_sync_then_checksums_and_audits_by_rule(server: Sidecar, tmp_path: Path) -> None:
    spec = TinyModelSpec(seed=3)
    new = random_weights(spec)
    sender = WeightSender("gloo", num_receivers=1, timeout_s=60, digest_algorithm=DEVICE_ALGORITHM)
    try:
        with RecordingClient(server.url, timeout=60) as c:
            c.connect_sender(sender)
            for version in (1, 2):
                result = c.sync_weights(sender, new, version=version)
                assert result["ok"] and result["algorithm"] == DEVICE_ALGORITHM, result["table"]
                assert result["ranks"] == [RANK] and result["tensors_checked"] == len(new)
            paths = [p for p, _ in c.sent]
            assert "/audit" not in paths, "finish answers with the audit"
            starts = started_manifests(c)
            assert "tensors" in starts[0] and "tensors" not in starts[1], "a repeated layout travels as its key"
            assert starts[1]["layout"] == starts[0]["layout"] and starts[1]["algorithm"] == DEVICE_ALGORITHM
            _check_received(c, new)
            _check_held(c, spec, tmp_path)
    finally:
        sender.close()
    _check_audit_cli(server.url, new, tmp_path)


def _check_received(c: SidecarClient, new: dict[str, torch.Tensor]) -> None:
    (received,) = c.checksums(source="received")
    assert received["algorithm"] == DEVICE_ALGORITHM
    assert {t["name"]: t["digest"] for t in received["tensors"]} == device_digests(new)
    assert c.checksums(source="received", algorithm=DEVICE_ALGORITHM) == [received]
    with pytest.raises(SidecarRequestError) as other:  # received digests are the sync's rule, not any asked for
        c.checksums(source="received", algorithm=ALGORITHM)
    assert other.value.status == 400 and other.value.field == "algorithm" and other.value.rank == RANK
    with pytest.raises(SidecarRequestError) as bogus:
        c.checksums(algorithm="xxh3_64k")
    assert bogus.value.status == 400 and bogus.value.field == "algorithm"


def _check_held(c: SidecarClient, spec: TinyModelSpec, tmp_path: Path) -> None:
    reference = LLM(write_model_dir(spec, tmp_path / "v1"), device="cpu", kv_cache_bytes=KV_BYTES)
    params = list(reference.worker.models["target"].named_parameters())
    (default,) = c.checksums()
    assert default["algorithm"] == ALGORITHM  # a CPU rank's own rule
    (device,) = c.checksums(algorithm=DEVICE_ALGORITHM)
    assert device["algorithm"] == DEVICE_ALGORITHM
    assert {t["name"]: t["digest"] for t in device["tensors"]} == device_digests(dict(params))
    for algorithm in (ALGORITHM, DEVICE_ALGORITHM):  # with no algorithm asked, the audit follows the manifest
        held = manifest_from_tensors(params, model="target", weight_version=2, rank=RANK, algorithm=algorithm)
        report = c.audit(source="held", expected=held.to_dict())
        assert report["ok"] and report["algorithm"] == algorithm, report["table"]
    old = manifest_from_tensors(params, model="target", weight_version=2, rank=RANK)
    mixed = c.audit(source="held", expected=old.to_dict(), algorithm=DEVICE_ALGORITHM)
    assert not mixed["ok"] and mixed["mismatches"][0]["kind"] == "algorithm"
    assert ALGORITHM in mixed["summary"] + mixed["table"] and DEVICE_ALGORITHM in mixed["table"]
    c.sleep(level=1)  # released weights are never read: a 409 naming the rank, not a read of freed memory
    with pytest.raises(SidecarStateError) as asleep:
        c.checksums(algorithm=DEVICE_ALGORITHM)
    assert asleep.value.rank == RANK and "asleep" in asleep.value.message
    c.wake_up()


def _check_audit_cli(url: str, new: dict[str, torch.Tensor], tmp_path: Path) -> None:
    sent = manifest_from_tensors(new, model="target", weight_version=2, rank=RANK, algorithm=DEVICE_ALGORITHM)
    path = tmp_path / "sent.json"
    sent.save(path)
    assert main(["audit", "--url", url, "--source", "received", str(path)]) == 0
    assert main(["audit", "--url", url, "--algorithm", DEVICE_ALGORITHM]) == 2  # one rank: nothing to compare
    # held, device rule: the synced weights are the checkpoint _check_held wrote
    assert main(["audit", "--url", url, "--algorithm", DEVICE_ALGORITHM, "--checkpoint", str(tmp_path / "v1")]) == 0


def test_an_unknown_layout_key_is_answered_by_sending_the_tensors(server: Sidecar) -> None:
    """The client believes the sidecar knows a layout it never parsed (e.g. it restarted)."""
    half = {n: t.half() for n, t in random_weights(TinyModelSpec(seed=4)).items()}  # a layout new to the sidecar
    sender = WeightSender("gloo", num_receivers=1, timeout_s=60)
    try:
        with RecordingClient(server.url, timeout=60) as c:
            c.connect_sender(sender)
            version = c.state()["weight_versions"]["target"] + 1
            c.weights.layouts.add(sender.manifest(half, version)["layout"])
            t0 = time.monotonic()
            assert c.sync_weights(sender, half, version=version, allow_cast=True)["ok"]
            assert ["tensors" in m for m in started_manifests(c)] == [False, True]
            # the first update's start was refused on the rank, which refused the sender's plan agreement too:
            # send() failed at once (not at its 60 s timeout) and the group stayed usable for the second
            assert time.monotonic() - t0 < 30 and sender.connected
    finally:
        sender.close()
