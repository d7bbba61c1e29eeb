"""Issue 20, the cases that need the rank processes themselves (real `sidecar launch`, CPU, gloo): a long
tokenization stalls no one and never makes a rank look hung; a TP=2 checksum mismatch names both ranks;
a stopped rank is named as the culprit in a 503 that carries its rank key; SIGTERM during a stalled
weight sync answers the stuck call with a JSON 503 and exits in seconds. Tests run in file order: the
stopped-rank test breaks its sidecar for good, so it comes last of those sharing it."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from inference.core import SamplingParams
from inference.models.tiny import TinyModelSpec, random_weights
from inference.transfer.sender import WeightSender
from sidecar.client import (
    SidecarChecksumError,
    SidecarClient,
    SidecarRequestError,
    SidecarUnavailableError,
)
from tests.helpers_sidecar import Sidecar, first_digest_wrong, launch

pytestmark = pytest.mark.slow  # every test here starts real processes or runs for seconds

STEP_TIMEOUT_S = 3.0
RANKS = ["dp0:pp0:tp0", "dp0:pp0:tp1"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def tp2() -> Iterator[Sidecar]:
    server = launch("--tp", "2", "--step-timeout-s", str(STEP_TIMEOUT_S), "--max-prompt-chars", "9000000",
                    "--max-body-mb", "16")
    try:
        yield server
    finally:
        for pid in _rank_pids(server):  # a rank the last test stopped must be able to exit
            if pid is not None:
                _signal(pid, signal.SIGCONT)
        server.stop()


def _rank_pids(server: Sidecar) -> list[int | None]:
    try:
        with SidecarClient(server.url, timeout=10) as c:
            return [r["pid"] for r in c.state()["ranks"]]
    except Exception:
        return []


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


@pytest.mark.slow
def test_a_long_tokenization_stalls_nobody(tp2: Sidecar) -> None:
    """A 6 MB prompt takes the tokenizer seconds, longer than --step-timeout-s: it is tokenized in the
    sidecar process, off the ranks' step loop, so requests sent meanwhile are served and no rank is
    declared hung (each rank tokenized it inside its step: every other request waited, then 503 for good)."""
    big = {"prompts": ["The miller counted the sacks twice. " * 170_000], "sampling_params": {"max_tokens": 2}}
    with ThreadPoolExecutor(1) as pool, httpx.Client(base_url=tp2.url, timeout=120) as web:
        slow = pool.submit(web.post, "/generate", json=big)
        served = 0
        with SidecarClient(tp2.url, timeout=60) as c:
            while not slow.done():
                assert len(c.generate(["a short one"], GREEDY)[0].outputs[0].token_ids) == 3
                served += 1
            resp = slow.result()
            assert resp.status_code == 400 and resp.json()["error"]["field"] == "prompts[0]", resp.text
            assert "max_model_len" in resp.json()["error"]["message"]  # tokenized, then too long for the model
            assert served >= 3, "requests waited on the tokenizer"
            assert c.health()["status"] == "ok"


def test_a_tp2_mismatch_names_every_rank_and_versions_only_grow(tp2: Sidecar,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    weights = random_weights(TinyModelSpec(seed=11))
    sender = WeightSender("gloo", num_receivers=2, timeout_s=60)
    try:
        with SidecarClient(tp2.url, timeout=60) as c:
            c.connect_sender(sender)
            records: list[Any] = []
            first_digest_wrong(monkeypatch, records)
            with pytest.raises(SidecarChecksumError) as e:
                c.sync_weights(sender, weights, version=1)
            monkeypatch.undo()
            name = records[0].name
            assert e.value.rank == ", ".join(RANKS)
            assert all(f"rank {r}" in e.value.message for r in RANKS) and name in e.value.message
            assert c.sync_weights(sender, weights, version=2)["ok"]  # heals the torn model
            for stale in (2, 1):
                with pytest.raises(SidecarRequestError, match="not newer than the live") as stale_error:
                    c.sync_weights(sender, weights, version=stale)
                assert stale_error.value.field == "version"
            assert c.state()["weight_versions"] == {"target": 2} and c.state()["torn"] == {"target": False}
    finally:
        sender.close()


@pytest.mark.slow
def test_a_stopped_rank_is_named_and_the_503_carries_its_rank(tp2: Sidecar) -> None:
    """SIGSTOP rank 1 while it can serve: the next step times out; the error names rank 1 as stopped
    (rank 0 only waited for it in the collective) and carries its rank key, in the call's 503 and in
    /health's."""
    pids = _rank_pids(tp2)
    _signal(int(pids[1] or 0), signal.SIGSTOP)
    with SidecarClient(tp2.url, timeout=60) as c:
        t0 = time.monotonic()
        with pytest.raises(SidecarUnavailableError) as e:
            c.generate(["is anyone there?"], GREEDY)
        assert time.monotonic() - t0 < STEP_TIMEOUT_S + 20
        assert e.value.rank == RANKS[1], e.value.body
        assert f"rank 1 (pid {pids[1]}) is stopped" in e.value.message and "rank(s) 0 waited" in e.value.message
        health = httpx.get(tp2.url + "/health", timeout=30)
        assert health.status_code == 503 and health.json()["error"]["rank"] == RANKS[1]
        with pytest.raises(SidecarUnavailableError) as again:  # and every later call, at once
            c.generate(["still?"], GREEDY)
        assert again.value.rank == RANKS[1]


@pytest.mark.slow
def test_a_generation_longer_than_the_step_timeout_is_no_hang() -> None:
    """The rank steps on its own and says so while it does (at least every HEARTBEAT_S): a call whose
    steps together take several times --step-timeout-s is served, and so is one sent meanwhile; only a
    rank silent for a whole timeout while it owes word is hung."""
    timeout_s = 1.0
    server = launch("--step-timeout-s", str(timeout_s))
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    try:
        with SidecarClient(server.url, timeout=120) as c, ThreadPoolExecutor(1) as pool:
            t0 = time.monotonic()
            running = pool.submit(c.generate, [[i + 3, 7, 11] for i in range(48)], long)
            time.sleep(timeout_s)
            assert len(c.generate(["meanwhile"], GREEDY)[0].outputs[0].token_ids) == 3
            outs = running.result()
            took = time.monotonic() - t0
            assert [len(o.outputs[0].token_ids) for o in outs] == [400] * 48
            assert took > 2 * timeout_s, f"the call took {took:.2f} s: too short to tell a hang"
            assert c.health()["status"] == "ok"
    finally:
        server.stop()


@pytest.mark.slow
def test_sigterm_during_a_stalled_sync_answers_json_and_exits_in_seconds() -> None:
    """The trainer opened a sync and never sends: /weights/update waits on the rank. SIGTERM answers it
    with a JSON 503 at once (not a bare 500 after uvicorn's grace period) and the launcher exits within
    seconds (it waited out the driver's and the ranks' join timeouts: 25.8 s)."""
    server = launch()
    sender = WeightSender("gloo", num_receivers=1, timeout_s=120)
    try:
        with SidecarClient(server.url, timeout=60) as c:
            c.connect_sender(sender)
            manifest = sender.manifest(random_weights(TinyModelSpec(seed=3)), 1)
            pending = c.weights.update({"model": "target", "version": 1, "manifest": manifest})  # never sent
            errors: list[BaseException] = []

            def update() -> None:
                try:
                    pending.result()
                except BaseException as e:
                    errors.append(e)

            stuck = threading.Thread(target=update)
            stuck.start()
            deadline = time.monotonic() + 60
            while c.state()["busy"] != "UpdateWeights":
                assert time.monotonic() < deadline, "the update never reached the ranks"
                time.sleep(0.05)
            t0 = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            stuck.join(30)
            code = server.proc.wait(60)
            took = time.monotonic() - t0
        assert code == 0, server.log
        assert len(errors) == 1 and isinstance(errors[0], SidecarUnavailableError), errors
        assert errors[0].type == "RankFailure" and "shutting down" in errors[0].message
        assert took < 10, f"the launcher took {took:.1f} s to exit"
    finally:
        sender.close()
        server.stop()
