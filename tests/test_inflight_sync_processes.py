"""Requests in flight at a weight sync through a real `sidecar launch` (CPU, gloo): the per-call on_sync and
max_staleness of POST /generate (SidecarClient.generate) and the sidecar's --on-sync default reach the
engine; the sync lands between two steps of generations already running; each token's recorded version
is the one that produced it (replayed, greedy, on in-process engines holding each version); keep,
recompute and abort give what they promise, and every call gets each of its prompts back once. With TP 2,
a sync whose audit fails on one rank only leaves both ranks torn, and no call hangs."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from inference.core import RequestOutput, SamplingParams
from inference.engine.llm import LLM
from inference.models.tiny import TinyModelSpec, random_weights
from inference.transfer.sender import WeightSender
from tests.helpers_fault import flip_env
from tests.helpers_sidecar import Sidecar, launch, server_ranks
from tests.helpers_weight_update import Link
from trainer_hooks.client import SidecarClient
from trainer_hooks.client_errors import SidecarChecksumError

pytestmark = pytest.mark.slow  # every test here starts real processes or runs for seconds

WEIGHTS = random_weights(TinyModelSpec(seed=5))
MAX_TOKENS = 120  # long enough that every call is still running when the engine is paused for the sync
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPTS = [[3, 17, 42, 7], [5, 9, 11, 13, 2, 8]]
CALLS = {"keep": {"on_sync": "keep"}, "recompute": {"on_sync": "recompute"},
         "default": {},  # the sidecar's --on-sync abort
         "stale": {"on_sync": "keep", "max_staleness": 0}}
STATE_TIMEOUT_S = 120.0


@pytest.fixture(scope="module", params=[("--async-scheduling",), ("--tp", "2")], ids=["tp1-async", "tp2"])
def server(request: pytest.FixtureRequest) -> Iterator[Sidecar]:
    """Async steps (the sync settles the step in flight first), and TP 2: every rank applies the sync,
    and each request's mode, at the same step boundary."""
    proc = launch("--on-sync", "abort", *request.param)
    try:
        yield proc
    finally:
        assert proc.stop() == 0, proc.log


def _when(client: SidecarClient, holds: object, what: str) -> dict:
    """Poll /state until `holds(state)`; fail naming `what` after STATE_TIMEOUT_S."""
    deadline = time.monotonic() + STATE_TIMEOUT_S
    while True:
        state = client.state()
        if holds(state):  # type: ignore[operator]
            return state
        assert time.monotonic() < deadline, f"no {what} within {STATE_TIMEOUT_S} s: {state}"
        time.sleep(0.01)  # a poll interval on the condition above, not a guess at timing: spare the 2 cores


def _greedy(ref: LLM, prompt: list[int], max_tokens: int) -> list[int]:
    return ref.generate(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))[0] \
        .outputs[0].token_ids


def _replay(outs: list[RequestOutput], refs: dict[int, LLM]) -> None:
    """Each token equals what an engine holding its recorded version produces for its prefix."""
    cases: dict[int, list[tuple[list[int], int]]] = {}
    for o in outs:
        c = o.outputs[0]
        for i, token in enumerate(c.token_ids):
            version = [v for start, v in c.weight_version_spans if start <= i][-1]
            cases.setdefault(version, []).append((o.prompt_token_ids + c.token_ids[:i], token))
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for version, found in cases.items():
        got = [r.outputs[0].token_ids[0] for r in refs[version].generate([p for p, _ in found], one)]
        assert got == [t for _, t in found], f"tokens recorded as version {version} are not its"


def test_a_sync_mid_generation_keeps_recomputes_or_restarts_each_call_as_it_asked(server: Sidecar) -> None:
    sender = WeightSender("gloo", num_receivers=server_ranks(server), timeout_s=60)
    with SidecarClient(server.url, timeout=120) as c, ThreadPoolExecutor(len(CALLS)) as pool:
        c.connect_sender(sender)
        old = int(c.state()["weight_versions"]["target"])
        new = old + 1
        calls: dict[str, Future] = {name: pool.submit(c.generate, PROMPTS, GREEDY, **policy)
                                    for name, policy in CALLS.items()}
        # every prompt is in the engine and has stepped (a rank reports after the step that follows new
        # requests); pausing then holds them mid-generation while the sync goes through
        _when(c, lambda s: s["engine_unfinished"] == len(CALLS) * len(PROMPTS), "calls in the engine")
        c.pause()
        assert c.sync_weights(sender, WEIGHTS, version=new)["ok"]
        c.resume()
        outs = {name: fut.result(timeout=STATE_TIMEOUT_S) for name, fut in calls.items()}
        idle = _when(c, lambda s: s["engine_unfinished"] == 0 and s["queued_sequences"] == 0, "an idle engine")
        assert idle["weight_versions"]["target"] == new
    sender.close()

    ref_old = LLM(None, device="cpu")
    ref_new = LLM(None, device="cpu")
    Link(ref_new.worker).sync(WEIGHTS, new)
    refs = {old: ref_old, new: ref_new}
    for name, got in outs.items():
        assert [o.prompt_token_ids for o in got] == PROMPTS, name  # each prompt back once, in order
        assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in got), name
    for name in ("keep", "recompute"):
        for o in outs[name]:
            c0 = o.outputs[0]
            (_, first), (k, second) = c0.weight_version_spans
            assert (first, second) == (old, new) and 0 < k < MAX_TOKENS and c0.restarts == 0, (name, c0)
            assert c0.token_ids[:k] == _greedy(ref_old, o.prompt_token_ids, k), name
            if name == "recompute":  # the continuation of a fresh request of the same prefix, new weights
                assert c0.token_ids[k:] == _greedy(ref_new, o.prompt_token_ids + c0.token_ids[:k], MAX_TOKENS - k)
    _replay(outs["recompute"], refs)
    for name in ("default", "stale"):  # --on-sync abort; max_staleness=0 under keep: restarted from the prompt
        for o in outs[name]:
            c0 = o.outputs[0]
            assert c0.weight_version_spans == [(0, new)] and c0.restarts == 1 and o.weight_version == new, name
            assert c0.token_ids == _greedy(ref_new, o.prompt_token_ids, MAX_TOKENS), name
            assert c0.draft_version_spans == []  # no draft model
    _replay(outs["default"], refs)


def test_a_bad_policy_is_a_400_or_422_naming_its_field(server: Sidecar) -> None:
    import httpx

    with httpx.Client(base_url=server.url, timeout=60) as h:
        r = h.post("/generate", json={"prompts": [[1, 2]], "on_sync": "later"})
        assert r.status_code == 422 and r.json()["error"]["field"] == "on_sync", r.text
        r = h.post("/generate", json={"prompts": [[1, 2]], "max_staleness": -1})
        assert r.status_code == 422 and r.json()["error"]["field"] == "max_staleness", r.text


def test_rollout_pool_groups_take_their_sync_policy(server: Sidecar) -> None:
    """POST /rollouts carries on_sync and max_staleness to the engine as /generate does: a group kept
    across a mid-generation sync has tokens of both versions, one left to the sidecar's --on-sync abort
    restarts under the new weights, and each group is taken once."""
    sender = WeightSender("gloo", num_receivers=server_ranks(server), timeout_s=60)
    with SidecarClient(server.url, timeout=120) as c:
        c.connect_sender(sender)
        new = int(c.state()["weight_versions"]["target"]) + 1
        kept = c.submit_rollouts([PROMPTS[0]], GREEDY, pool="policy", on_sync="keep")
        restarted = c.submit_rollouts([PROMPTS[1]], GREEDY, pool="policy")
        _when(c, lambda s: s["engine_unfinished"] == 2, "both groups in the engine")
        c.pause()
        assert c.sync_weights(sender, WEIGHTS, version=new)["ok"]
        c.resume()
        take = c.take_rollouts(2, pool="policy", timeout_s=STATE_TIMEOUT_S)
    sender.close()
    by_id = {o.request_id: o for o in take.groups}
    assert sorted(by_id) == sorted(kept + restarted)
    keep = by_id[kept[0]].outputs[0]
    assert [v for _, v in keep.weight_version_spans] == [new - 1, new] and keep.restarts == 0, keep
    abort = by_id[restarted[0]].outputs[0]
    assert abort.weight_version_spans == [(0, new)] and abort.restarts == 1, abort
    assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in take.groups)


def test_tp2_a_sync_failing_on_one_rank_goes_live_on_none_and_no_call_hangs() -> None:
    """Rank 1 alone receives a flipped byte in the first sync, so its audit fails and rank 0's passes, with
    calls mid-generation (paused, so they are, then resumed on the torn engine). The sync fails naming
    rank 1 and the tensor; neither rank goes live (rank 0 alone would step into the model's TP
    collectives and wait there for rank 1); /health answers; the calls wait on the torn engine and
    finish after the next good sync, their tokens after it from the new weights."""
    flipped, bad = "model.layers.0.self_attn.q_proj.weight", "dp0:pp0:tp1"
    proc = launch("--tp", "2", env=flip_env(flipped, rank=bad, times=1))
    try:
        sender = WeightSender("gloo", num_receivers=2, timeout_s=60)
        modes = ("keep", "recompute")
        with SidecarClient(proc.url, timeout=120) as c, ThreadPoolExecutor(len(modes)) as pool:
            c.connect_sender(sender)
            old = int(c.state()["weight_versions"]["target"])
            calls = [pool.submit(c.generate, PROMPTS, GREEDY, on_sync=mode) for mode in modes]
            _when(c, lambda s: s["engine_unfinished"] == len(modes) * len(PROMPTS), "calls in the engine")
            c.pause()
            with pytest.raises(SidecarChecksumError) as failed:
                c.sync_weights(sender, WEIGHTS, version=old + 1)
            assert bad in failed.value.message and flipped in failed.value.message, failed.value
            assert bad in (failed.value.rank or ""), failed.value
            c.resume()
            assert c.health()["status"] == "ok"
            state = c.state()
            for rank in state["ranks"]:  # both torn, the old version still the number of each
                assert rank["torn"]["target"] and rank["weight_versions"]["target"] == old, rank
            assert state["engine_unfinished"] == len(modes) * len(PROMPTS) and not any(f.done() for f in calls)
            assert c.sync_weights(sender, WEIGHTS, version=old + 2)["ok"]
            outs = [fut.result(timeout=STATE_TIMEOUT_S) for fut in calls]
            assert not c.state()["torn"]["target"] and c.health()["status"] == "ok"
        sender.close()
    finally:
        assert proc.stop() == 0, proc.log
    ref_old, ref_new = LLM(None, device="cpu"), LLM(None, device="cpu")
    Link(ref_new.worker).sync(WEIGHTS, old + 2)
    for got in outs:
        assert [o.prompt_token_ids for o in got] == PROMPTS
        for o in got:
            c0 = o.outputs[0]
            (_, first), (k, second) = c0.weight_version_spans
            assert (first, second) == (old, old + 2) and 0 < k < MAX_TOKENS and len(c0.token_ids) == MAX_TOKENS, c0
            assert c0.token_ids[:k] == _greedy(ref_old, o.prompt_token_ids, k)
    _replay([o for o in outs[1]], {old: ref_old, old + 2: ref_new})  # recompute: each token its version's


def test_a_finished_group_waiting_past_its_max_staleness_is_generated_again(server: Sidecar) -> None:
    """max_staleness also holds for a group that finished and waits to be taken: once a sync leaves it
    more than k versions behind, the pool generates it again from its prompt (never lost, never returned
    stale); a group without a bound comes back as it finished."""
    sender = WeightSender("gloo", num_receivers=server_ranks(server), timeout_s=60)
    short = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with SidecarClient(server.url, timeout=120) as c:
        c.connect_sender(sender)
        old = int(c.state()["weight_versions"]["target"])
        bounded = c.submit_rollouts([PROMPTS[0]], short, pool="waiting", max_staleness=0)
        free = c.submit_rollouts([PROMPTS[1]], short, pool="waiting")
        _when(c, lambda s: c.rollout_counts("waiting")["finished"] == 2, "both groups finished")
        assert c.sync_weights(sender, WEIGHTS, version=old + 1)["ok"]
        take = c.take_rollouts(2, pool="waiting", timeout_s=STATE_TIMEOUT_S)
    sender.close()
    by_id = {o.request_id: o for o in take.groups}
    assert sorted(by_id) == sorted(bounded + free)
    again, kept = by_id[bounded[0]], by_id[free[0]]
    assert again.weight_version == old + 1 and again.metrics["resubmitted"] == 1, again
    assert kept.weight_version == old and kept.metrics["resubmitted"] == 0, kept
