"""A weight session belongs to the init that opened it, a pause has a lease, shapes are bounded before
any arithmetic, and "what weights does this rank hold" has one answer everywhere. Against a real
`sidecar launch` (TP=1, CPU, gloo): a second trainer's init makes the first trainer's update a 409
naming `session` (the live bytes are the second's, checked by digest, not by the sidecar's verdict);
a client that pauses and vanishes releases generation when its lease runs out, and `wait: false`
while paused is a 409 at once; a manifest shape of huge integers is a 400 in milliseconds; after a
level-2 sleep and a wake with no sync /checksums, /audit, /state, /v1/models, /metrics and `sidecar
status` all say the bytes need a sync. Every wait is on an answer, none is a sleep."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pytest

from inference.core import SamplingParams
from inference.models.tiny import TinyModelSpec, random_weights
from inference.transfer.groups import TransferError
from inference.transfer.sender import WeightSender
from sidecar.cli.main import main as cli_main
from sidecar.client import SidecarClient, SidecarRequestError, SidecarStateError, SidecarTransferError
from tests.helpers_sidecar import Sidecar, launch

MAX_PAUSE_S = 3.0
GREEDY = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)


@pytest.fixture(scope="module")
def server() -> Iterator[Sidecar]:
    proc = launch("--transfer", "gloo", "--max-pause-s", str(MAX_PAUSE_S))
    try:
        yield proc
    finally:
        assert proc.stop() == 0, proc.log


def _held_digests(c: SidecarClient) -> dict[str, str]:
    """The digests of the bytes the rank holds now, by tensor (the version left out)."""
    (manifest,) = c.checksums()
    return {t["name"]: t["digest"] for t in manifest["tensors"]}


def _next_version(c: SidecarClient) -> int:
    return int(c.state()["weight_versions"]["target"]) + 1


def test_a_replaced_session_cannot_fill_an_update_with_another_trainers_bytes(server: Sidecar) -> None:
    """Trainer A inits, trainer B inits (replacing A's group), A posts its update: A is refused with a 409
    naming `session` (it used to be answered ok while B's bytes went live). B's sync goes live, and the
    live bytes are B's: equal, digest for digest, to a clean sync of B's weights."""
    mine, theirs = random_weights(TinyModelSpec(seed=31)), random_weights(TinyModelSpec(seed=32))
    a = WeightSender("gloo", bucket_bytes=256 << 10, timeout_s=10)
    b = WeightSender("gloo", bucket_bytes=256 << 10, timeout_s=10)
    try:
        with SidecarClient(server.url, timeout=60) as ca, SidecarClient(server.url, timeout=60) as cb:
            ca.connect_sender(a)
            cb.connect_sender(b)
            version = _next_version(ca)
            start = ca.weights.start_body(version, a.manifest(list(mine.items()), version), "target", False,
                                          short=False)
            t0 = time.monotonic()
            with pytest.raises(SidecarStateError) as refused:
                ca.weights.update(start).result()
            assert refused.value.field == "session" and "replaced by another init" in refused.value.message
            assert time.monotonic() - t0 < 5, "refused before the ranks, not at a wire timeout"
            assert cb.sync_weights(b, theirs, version)["ok"]
            raced = _held_digests(cb)
            assert cb.sync_weights(b, theirs, version + 1)["ok"]  # B's bytes again, cleanly
            assert raced == _held_digests(cb)
            assert cb.sync_weights(b, mine, version + 2)["ok"]
            assert raced != _held_digests(cb)  # the digests do tell the two apart
    finally:
        a.close()
        b.close()


def test_a_sender_that_is_not_the_owners_is_refused_in_the_plan_agreement(server: Sidecar) -> None:
    """The update binds its sender (as trainer_hooks/sync.py does): a send that does not present the
    session's nonce (another trainer's sender on this group) is refused by the ranks before any byte
    moves; the update fails naming why, the model is not torn and its version stays."""
    sender = WeightSender("gloo", bucket_bytes=256 << 10, timeout_s=20)
    named = list(random_weights(TinyModelSpec(seed=34)).items())
    try:
        with SidecarClient(server.url, timeout=60) as c:
            c.connect_sender(sender)
            before = c.state()["weight_versions"]["target"]
            version = before + 1
            start = c.weights.start_body(version, sender.manifest(named, version), "target", False, short=False)
            pending = c.weights.update(start, bind_sender=True)
            with pytest.raises(TransferError, match="another owner"):
                sender.send(named, deliver_digests=True, owner="a nonce that is not this session's")
            with pytest.raises(SidecarTransferError) as refused:
                pending.result()
            message = refused.value.message
            assert "not this update's owner's" in message and "nothing was written" in message
            assert c.state()["weight_versions"]["target"] == before and c.state()["torn"] == {"target": False}
            assert c.sync_weights(sender, named, version)["ok"]  # the owner's own send goes through
    finally:
        sender.close()


def test_a_pause_whose_client_vanished_ends_with_its_lease(server: Sidecar) -> None:
    """POST /pause with a lease and no /resume: a held call is served once the lease runs out; while
    paused, wait: false is a 409 at once (it used to hang); a lease past --max-pause-s is a 400, and
    renews nothing."""
    with SidecarClient(server.url, timeout=60) as c:
        with pytest.raises(SidecarRequestError) as too_long:
            c.pause(lease_s=MAX_PAUSE_S + 1)
        assert too_long.value.field == "lease_s" and "--max-pause-s" in too_long.value.message
        assert c.pause(lease_s=1.0)["lease_s"] == 1.0
        t0 = time.monotonic()
        with pytest.raises(SidecarStateError) as at_once:
            c.generate(["no waiting"], GREEDY, wait=False)
        assert time.monotonic() - t0 < 1.0 and "paused" in at_once.value.message
        with pytest.raises(SidecarRequestError):  # a refused pause renews nothing
            c.pause(lease_s=MAX_PAUSE_S + 1)
        held = c.generate(["held until the lease ends"], GREEDY)  # nobody resumes
        took = time.monotonic() - t0
        assert len(held[0].outputs[0].token_ids) == 2 and 0.9 <= took < MAX_PAUSE_S
        assert c.state()["paused"] is False


def test_a_shape_of_huge_integers_is_refused_before_any_product(server: Sidecar) -> None:
    """Dimensions of 4,000-digit integers: their product used to freeze the event loop (for minutes at the
    body limit); now a 400 naming the shape, at once: dimensions and values are checked before any product."""
    big = int("9" * 4000)
    manifest = {"tensors": [{"name": "w", "dtype": "float32", "shape": [big] * 60, "digest": "0" * 32}]}
    body = json.dumps({"start": {"version": 1, "manifest": manifest}})
    t0 = time.monotonic()
    resp = httpx.post(server.url + "/weights/update", content=body, headers={"content-type": "application/json"},
                      timeout=120)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["field"] == "start.manifest.tensors[0].shape" and "13288 bits" in error["message"]
    assert time.monotonic() - t0 < 5
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    for shape, why in [([big] * 1200, "1200 dimensions"), ([2] * 65, "65 dimensions"),
                       ([1 << 62, 4], "2**63 - 1 elements"), ([-1], "got -1")]:
        manifest["tensors"][0]["shape"] = shape
        resp = httpx.post(server.url + "/weights/update", json={"start": {"version": 1, "manifest": manifest}})
        assert resp.status_code == 400 and why in resp.json()["error"]["message"], resp.text


def _metric(text: str, name: str) -> float:
    line = next(line for line in text.splitlines() if line.startswith(name))
    return float(line.rsplit(" ", 1)[1])


def test_weights_dropped_by_a_level_2_sleep_need_a_sync_everywhere(server: Sidecar,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Sleep level 2, wake, no sync: every reader says the bytes are not the live version's (the
    manifest used to show the version with no flag, /audit answered ok, status said healthy); one
    sync clears them all."""
    sender = WeightSender("gloo", bucket_bytes=256 << 10, timeout_s=20)
    try:
        with SidecarClient(server.url, timeout=60) as c:
            c.sleep(level=2)
            c.wake_up()
            (manifest,) = c.checksums()
            assert manifest["torn"] is True and "level-2 sleep" in manifest["torn_reason"]
            audit = c.audit()
            assert audit["ok"] is False and "level-2 sleep" in json.dumps(audit["torn"])
            state = c.state()
            assert "level-2 sleep" in state["needs_sync"]["target"] and state["ready"] is False
            assert "level-2 sleep" in state["ranks"][0]["needs_sync"]["target"]
            card = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]
            assert "level-2 sleep" in card["needs_sync"]
            assert _metric(c.metrics(), 'sidecar_weights_need_sync{model="target"}') == 1.0
            capsys.readouterr()
            assert cli_main(["status", server.url]) == 0  # the processes are healthy ...
            assert "NOT SERVING: target needs a sync" in capsys.readouterr().out  # ... the weights are not
            version = _next_version(c)
            c.connect_sender(sender)
            assert c.sync_weights(sender, random_weights(TinyModelSpec(seed=33)), version)["ok"]
            (manifest,) = c.checksums()
            assert "torn" not in manifest and c.audit()["ok"] is True
            assert c.state()["needs_sync"] == {"target": None}
            assert _metric(c.metrics(), 'sidecar_weight_version{model="target"}') == version
            assert _metric(c.metrics(), 'sidecar_weights_need_sync{model="target"}') == 0.0
            assert len(c.generate(["served again"], GREEDY)[0].outputs[0].token_ids) == 2
    finally:
        sender.close()
