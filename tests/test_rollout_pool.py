"""Rollout pools against a real `sidecar launch` on the tiny model (CPU): every submitted group comes back
exactly once across partial takes, min_groups is honoured, oldest first, the unfinished tail of a step is
held through a sleep and a real sync, a trainer killed between two partial calls loses nothing the
sidecar finished (its unacknowledged take comes back to its successor), a lease runs out, an iterator
yields groups in completion order, cancelling aborts the running groups, a take whose caller went away
takes nothing, concurrent takes share nothing, and the pool bound refuses with a named field. Each test
leaves its pools empty (the bound counts every pool)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from inference.core import CompletionOutput, RequestOutput, SamplingParams
from inference.models.tiny import make_tiny_model
from tests.helpers_sidecar import REPO, Sidecar, launch
from trainer_hooks import WeightSyncHook
from trainer_hooks.client import SidecarClient
from trainer_hooks.client_errors import SidecarBusyError, SidecarRequestError
from trainer_hooks.rollout_pool import staleness
from trainer_hooks.toy_policy import ToyPolicy

POOL_BOUND = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("pool") / "model")


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[Sidecar]:
    proc = launch("--model", str(model_dir), "--max-pool-sequences", str(POOL_BOUND), "--transfer", "gloo")
    try:
        yield proc
    finally:
        assert proc.stop() == 0, proc.log


@pytest.fixture
def client(server: Sidecar) -> Iterator[SidecarClient]:
    with SidecarClient(server.url) as c:
        yield c


def _tokens(length: int, n: int = 2, seed: int = 0) -> SamplingParams:
    return SamplingParams(n=n, temperature=1.0, seed=seed, max_tokens=length, ignore_eos=True)


def _prompt(i: int) -> list[int]:
    return [10 + i, 20 + i, 30 + i]


EMPTY = {"pending": 0, "finished": 0, "leased": 0, "failed": 0, "sequences": 0}


def _drain(client: SidecarClient, pool: str) -> list[str]:
    """Take every group left, then acknowledge them: the pool is empty."""
    take = client.take_rollouts(10_000, None, pool=pool, timeout_s=120.0)
    assert take.counts["pending"] == take.counts["finished"] == 0, take.counts
    client.ack_rollouts(pool)
    counts = client.rollout_counts(pool)
    assert {k: counts[k] for k in EMPTY} == EMPTY, counts
    return [o.request_id for o in take.groups]


def _wait_finished(client: SidecarClient, pool: str, groups: int) -> None:
    deadline = time.monotonic() + 60.0
    while client.rollout_counts(pool)["finished"] < groups:
        assert time.monotonic() < deadline, client.rollout_counts(pool)
        time.sleep(0.05)


@pytest.mark.slow
def test_every_group_is_returned_exactly_once_across_partial_steps(client: SidecarClient) -> None:
    pool, submitted, returned = "exactly-once", {}, []
    for step in range(4):  # each step submits 3 groups of mixed lengths and takes 2: the pool grows by 1
        prompts = [_prompt(3 * step + j) for j in range(3)]
        params = [_tokens(length) for length in (3, 40, 7)]
        ids = client.submit_rollouts(prompts, params, pool=pool)
        submitted.update({gid: (p, sp.max_tokens) for gid, p, sp in zip(ids, prompts, params)})
        take = client.take_rollouts(2, 2, pool=pool)
        assert len(take.groups) == 2  # min_groups honoured
        returned += [o.request_id for o in take.groups]
        for o in take.groups:
            prompt, length = submitted[o.request_id]
            assert o.prompt_token_ids == prompt and len(o.outputs) == 2
            assert all(len(c.token_ids) == length == len(c.logprobs) for c in o.outputs)
    returned += _drain(client, pool)
    assert sorted(returned) == sorted(submitted) and len(set(returned)) == len(returned)


@pytest.mark.slow
def test_each_sample_generates_its_own_max_tokens(client: SidecarClient) -> None:
    pool = "lengths"
    params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=40, sample_max_tokens=(7, 40, 1),
                            ignore_eos=True)
    (gid,) = client.submit_rollouts([_prompt(0)], params, pool=pool)
    (group,) = client.take_rollouts(1, pool=pool, timeout_s=60.0).groups
    assert group.request_id == gid and [len(c.token_ids) for c in group.outputs] == [7, 40, 1]
    with pytest.raises(SidecarRequestError) as e:  # one length per sample, or the field is named
        client.submit_rollouts([_prompt(0)], {"n": 2, "max_tokens": 4, "sample_max_tokens": [3]}, pool=pool)
    assert e.value.field == "sampling_params.sample_max_tokens" and "n=2" in e.value.message
    assert _drain(client, pool) == []


@pytest.mark.slow
def test_min_groups_and_oldest_first(client: SidecarClient) -> None:
    pool = "oldest"
    ids = client.submit_rollouts([_prompt(i) for i in range(4)], _tokens(2), pool=pool)
    _wait_finished(client, pool, 4)
    first = client.take_rollouts(1, 1, pool=pool)
    second = client.take_rollouts(2, 2, pool=pool)
    assert [o.request_id for o in first.groups] == ids[:1]
    assert [o.request_id for o in second.groups] == ids[1:3]
    # the second take acknowledged the first; its own two groups stay leased until the next take
    assert second.counts == {"pending": 0, "finished": 1, "leased": 2, "failed": 0, "sequences": 6}
    # an unfinished group holds a take back until min_groups are ready; the oldest comes first
    late = client.submit_rollouts([_prompt(9)], _tokens(600), pool=pool)
    t0 = time.monotonic()
    both = client.take_rollouts(2, pool=pool, timeout_s=120.0)
    assert [o.request_id for o in both.groups] == [ids[3], late[0]]
    assert time.monotonic() - t0 < 100.0
    # nothing unfinished: a take answers at once with what there is (here nothing)
    empty = client.take_rollouts(5, pool=pool, timeout_s=120.0)
    assert empty.groups == [] and client.rollout_counts(pool)["sequences"] == 0


@pytest.mark.slow
def test_hook_carries_the_tail_over_a_sleep_and_a_real_sync(client: SidecarClient, model_dir: Path) -> None:
    """Step 1 returns the 2 short groups and leaves the long one generating; the trainer sleeps the
    sidecar (the long one is held), trains, syncs v1; step 2 returns the long group first (carried over,
    its first tokens from v0, its last from v1), then the new one."""
    import torch

    policy = ToyPolicy.from_dir(model_dir)  # the sidecar's checkpoint: nothing to sync before step 1
    with WeightSyncHook(client, policy, rollout_pool="hook", sync_on_attach=False) as hook:
        long_short = [_tokens(1500), _tokens(3), _tokens(3)]
        step1 = hook.rollouts([_prompt(0), _prompt(1), _prompt(2)], long_short, min_groups=2)
        assert [o.prompt_token_ids for o in step1] == [_prompt(1), _prompt(2)]
        assert hook.stats["rollout_carried"] == 0 and hook.stats["rollout_left"] == 1
        assert hook.stats["staleness_samples"] == {0: 4}
        with hook.training(), torch.no_grad():
            next(policy.parameters()).add_(0.01)
        assert hook.version == 1
        step2 = hook.rollouts([_prompt(3)], _tokens(3), min_groups=2)
    assert [o.prompt_token_ids for o in step2] == [_prompt(0), _prompt(3)]
    assert hook.stats["rollout_carried"] == 1 and hook.stats["rollout_left"] == 0
    carried = step2[0].outputs
    assert all(len(c.token_ids) == 1500 for c in carried)
    spans = [c.weight_version_spans for c in carried]
    assert all(s[0][1] == 0 and s[-1][1] == 1 for s in spans), spans
    assert hook.stats["staleness_samples"] == {0: 2, 1: 2}  # the new group's samples are all v1
    tokens = hook.stats["staleness_tokens"]
    assert sum(tokens.values()) == 2 * 1500 + 2 * 3 and set(tokens) == {0, 1}


_TRAINER = textwrap.dedent("""
    import json, sys, time
    import torch
    from inference.core import SamplingParams
    from trainer_hooks import WeightSyncHook
    from trainer_hooks.client import SidecarClient
    from trainer_hooks.toy_policy import ToyPolicy

    client = SidecarClient(sys.argv[1])
    hook = WeightSyncHook(client, ToyPolicy.from_dir(sys.argv[2]), rollout_pool="killed")  # syncs it first
    prompts = [[40 + i, 41, 42] for i in range(8)]
    params = [SamplingParams(n=2, seed=i, max_tokens=3 if i < 2 else 300, ignore_eos=True) for i in range(8)]
    for step in range(2):  # the second call acknowledges the first one's groups (the trainer used them)
        out = hook.rollouts(prompts if step == 0 else [], params, min_groups=2)
        print(json.dumps([[o.request_id, o.prompt_token_ids[0]] for o in out]), flush=True)
    time.sleep(600)  # killed here, after the pool answered the second call, before anything acknowledged it
""")


@pytest.mark.slow
def test_a_killed_trainer_loses_nothing_the_sidecar_finished(client: SidecarClient, tmp_path: Path,
                                                             model_dir: Path) -> None:
    script = tmp_path / "trainer.py"
    script.write_text(_TRAINER)
    proc = subprocess.Popen([sys.executable, str(script), client.url, str(model_dir)], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        used = json.loads(proc.stdout.readline())  # acknowledged by the second call
        lost = json.loads(proc.stdout.readline())  # answered, never acknowledged
    finally:
        proc.kill()
        proc.wait(30)
    assert len(used) == len(lost) == 2
    assert client.rollout_counts("killed")["leased"] == 2  # the dead trainer's last answer is still there
    # a new trainer with the same pool id is a new consumer: the unacknowledged groups come back to it,
    # then the rest; across the steps every group is returned exactly once, every sample complete
    with WeightSyncHook(client, ToyPolicy.from_dir(model_dir), rollout_pool="killed") as hook:
        rest = hook.rollouts([], min_groups=6, max_groups=6, timeout_s=120.0)
    ids = [gid for gid, _ in used] + [o.request_id for o in rest]
    firsts = [first for _, first in used] + [o.prompt_token_ids[0] for o in rest]
    assert len(set(ids)) == len(ids) == 8 and sorted(firsts) == list(range(40, 48))
    assert {gid for gid, _ in lost} <= {o.request_id for o in rest}
    assert all(len(o.outputs) == 2 and all(len(c.token_ids) in (3, 300) for c in o.outputs) for o in rest)
    assert client.rollout_counts("killed")["sequences"] == 0  # the hook's close acknowledged its last take


@pytest.mark.slow
def test_an_unacknowledged_lease_returns_to_the_pool_and_an_ack_removes_it(client: SidecarClient) -> None:
    pool = "lease"
    ids = client.submit_rollouts([_prompt(i) for i in range(3)], _tokens(2), pool=pool)
    _wait_finished(client, pool, 3)
    first = client.take_rollouts(2, 2, pool=pool, lease_s=0.5)
    assert [o.request_id for o in first.groups] == ids[:2] and first.ticket is not None
    counts = client.rollout_counts(pool)
    assert (counts["finished"], counts["leased"], counts["finished_ids"]) == (1, 2, ids[2:])
    time.sleep(1.0)  # the lease runs out: its groups are takeable again, oldest first
    assert client.rollout_counts(pool)["finished_ids"] == ids
    again = client.take_rollouts(3, 3, pool=pool, ack=False)  # acknowledges nothing: still a known consumer
    assert [o.request_id for o in again.groups] == ids
    assert client.ack_rollouts(pool) == 3
    assert client.rollout_counts(pool)["sequences"] == 0


@pytest.mark.slow
def test_iter_rollouts_yields_groups_in_completion_order(client: SidecarClient, model_dir: Path) -> None:
    pool = "stream"
    lengths = [300, 3, 60, 8]
    with WeightSyncHook(client, ToyPolicy.from_dir(model_dir), rollout_pool=pool) as hook:
        seen = []
        t0 = time.monotonic()
        for group in hook.iter_rollouts([_prompt(i) for i in range(4)], [_tokens(n) for n in lengths], count=3):
            seen.append((len(group.outputs[0].token_ids), time.monotonic() - t0))
        assert [n for n, _ in seen] == [3, 8, 60]  # shortest first: each came as it finished
        assert hook.stats["rollout_groups"] == 3 and hook.stats["rollout_left"] == 1
        assert hook.stats["staleness_samples"] == {0: 6}
        # the unfinished one stays generating and comes in a later call (which acknowledges the stream)
        rest = list(hook.iter_rollouts([_prompt(9)], _tokens(2), count=2))
        assert [len(o.outputs[0].token_ids) for o in rest] == [2, 300]
        hook.rollouts([_prompt(5)], _tokens(2, n=3))  # a synchronous step has its histogram too
        assert hook.stats["staleness_samples"] == {0: 3} and hook.stats["staleness_tokens"] == {0: 6}
    assert client.rollout_counts(pool)["sequences"] == 0


@pytest.mark.slow
def test_cancel_aborts_running_groups_by_id_or_the_whole_pool(client: SidecarClient) -> None:
    pool = "cancel"
    ids = client.submit_rollouts([_prompt(i) for i in range(4)], [_tokens(2)] + [_tokens(1500)] * 3, pool=pool)
    _wait_finished(client, pool, 1)
    one = client.cancel_rollouts([ids[1], "r-nope"], pool=pool)
    assert one["cancelled"] == [ids[1]] and one["unknown"] == ["r-nope"]
    assert {k: one["counts"][k] for k in ("pending", "finished", "sequences")} == {"pending": 2, "finished": 1,
                                                                                  "sequences": 6}
    whole = client.cancel_rollouts(pool=pool)
    assert whole["cancelled"] == [ids[0], ids[2], ids[3]]
    assert {k: whole["counts"][k] for k in EMPTY} == EMPTY
    deadline = time.monotonic() + 30.0  # the ranks aborted them: nothing left running or queued
    while (state := client.state())["engine_unfinished"] or state["queued_sequences"]:
        assert time.monotonic() < deadline, state
        time.sleep(0.1)
    assert client.take_rollouts(1, pool=pool, timeout_s=0.0).groups == []


@pytest.mark.slow
def test_the_pool_bound_refuses_naming_the_field(client: SidecarClient) -> None:
    pool = "bound"
    client.submit_rollouts([_prompt(i) for i in range(POOL_BOUND // 4)], _tokens(1, n=4), pool=pool)
    with pytest.raises(SidecarBusyError) as e:
        client.submit_rollouts([_prompt(0)], _tokens(1, n=1), pool="another")
    assert e.value.status == 429 and e.value.field == "prompts" and "--max-pool-sequences" in e.value.message
    assert client.rollout_counts("another")["sequences"] == 0  # nothing of a refused call was submitted
    assert f"sidecar_rollout_pool_sequences {float(POOL_BOUND)}" in client.metrics()
    assert len(_drain(client, pool)) == POOL_BOUND // 4
    client.submit_rollouts([_prompt(0)], _tokens(1, n=1), pool="another")  # room again once taken
    assert len(_drain(client, "another")) == 1


@pytest.mark.slow
def test_bad_pool_ids_and_bounds_are_refused(client: SidecarClient) -> None:
    with pytest.raises(SidecarRequestError) as e:
        client.submit_rollouts([_prompt(0)], _tokens(1), pool="no spaces")
    assert e.value.field == "pool"
    with pytest.raises(SidecarRequestError) as e:
        client.take_rollouts(1, pool="ok", timeout_s=1e6)
    assert e.value.field == "timeout_s"
    with pytest.raises(SidecarRequestError) as e:
        client.rollout_counts("ok", wait_s=1e6)
    assert e.value.field == "wait_s"


@pytest.mark.slow
def test_a_take_times_out_with_what_is_ready_and_concurrent_takes_share_nothing(client: SidecarClient) -> None:
    pool = "concurrent"
    slow = client.submit_rollouts([_prompt(0)], _tokens(800), pool=pool)
    t0 = time.monotonic()
    assert client.take_rollouts(1, pool=pool, timeout_s=0.3).groups == []  # the timeout answers with nothing
    assert time.monotonic() - t0 < 5.0
    ids = client.submit_rollouts([_prompt(i) for i in range(1, 9)], _tokens(2), pool=pool)
    with ThreadPoolExecutor(2) as ex:
        takes = list(ex.map(lambda _: client.take_rollouts(4, 4, pool=pool, timeout_s=60.0), range(2)))
    got = [o.request_id for t in takes for o in t.groups]
    assert sorted(got) == sorted(ids) and len(set(got)) == 8
    assert _drain(client, pool) == slow


@pytest.mark.slow
def test_a_take_whose_caller_went_away_takes_nothing(client: SidecarClient) -> None:
    pool = "gone"
    ids = client.submit_rollouts([_prompt(0)], _tokens(800), pool=pool)
    with httpx.Client(base_url=client.url, timeout=0.3) as http, pytest.raises(httpx.ReadTimeout):
        http.post("/rollouts/take", json={"pool": pool, "min_groups": 1, "timeout_s": 60.0})
    assert _drain(client, pool) == ids  # finished after its first taker left: still there for the next


def test_staleness_counts_samples_by_their_oldest_token_and_tokens_by_their_own() -> None:
    fresh = CompletionOutput(index=0, token_ids=[1, 2, 3], logprobs=[0.0] * 3, weight_version_spans=[(0, 5)])
    mixed = CompletionOutput(index=1, token_ids=[1, 2, 3, 4], logprobs=[0.0] * 4,
                             weight_version_spans=[(0, 3), (1, 4), (3, 5)])
    bare = CompletionOutput(index=0, token_ids=[7, 8], logprobs=[0.0] * 2)  # no spans: the output's version
    outs = [RequestOutput("a", [1], [fresh, mixed], weight_version=3),
            RequestOutput("b", [1], [bare], weight_version=4)]
    samples, tokens = staleness(outs, live=5)
    assert samples == {0: 1, 1: 1, 2: 1}
    assert tokens == {0: 3 + 1, 1: 2 + 2, 2: 1}
