"""The batch-invariant mode across a weight sync (partial rollouts; docs/async-rl.md), on CPU.

A request in flight when a sync goes live follows its on_sync: "recompute" (the default) rebuilds its KV
by prefill under the new weights and goes on. In the mode its every bit depends only on its own prompt,
params and the token index at which the new weights went live: a batch, calls of other sizes, a shuffled
order, prefix-cache hits, preemption with chunked prefill, a draft model, async scheduling and a
sleep that holds the requests (the rollout pool's way) each give a request the bits it gets alone with
the sync at the same index. Under recompute a greedy continuation is also exactly a fresh request's of
the prompt plus the tokens before the sync ("keep", "abort" and max_staleness are held to the batch case).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

from inference.core import RequestOutput, SamplingParams
from inference.engine.llm import LLM
from inference.models.loader import iter_hf_tensors
from inference.models.tiny import first_layers, make_tiny_model
from tests.helpers_invariance import (
    CPU,
    MODES,
    NEW,
    PREFIX,
    SELF_DRAFT,
    Result,
    base_params,
    logprobs_of,
    make_prompts,
    result,
    tight_options,
)
from tests.helpers_weight_update import Link

pytestmark = pytest.mark.slow
DIMS = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)
SPLIT = 5  # tokens a request has (at least) when the sync lands
Synced = tuple[Result, int | None]  # the result, and the token index where the new weights went live


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread: None) -> None:
    """the conftest fixture, for every test of this module (the mode's promise is per thread count)"""


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """old: the served checkpoint; new: one of the same shapes with other weights (the trainer's step)."""
    root = tmp_path_factory.mktemp("invariant-sync")
    old = make_tiny_model(root / "old", "qwen2", seed=3, **DIMS)
    return {"old": old, "new": make_tiny_model(root / "new", "qwen2", seed=4, **DIMS),
            "draft": first_layers(old, root / "draft", 1)}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts()


def params(mode: str, i: int) -> SamplingParams:
    return base_params(mode, i)


class Engine:
    """An engine in the mode and a sender linked to it; `hold(which)` syncs the old or new weights
    (each sync a new version) unless the engine holds them already."""

    def __init__(self, dirs: dict[str, Path], **options: object) -> None:
        self.llm = LLM(dirs["old"], batch_invariant=True, **{**CPU, **options})  # type: ignore[arg-type]
        self.link = Link(self.llm.worker)
        self.states = {w: dict(iter_hf_tensors(dirs[w])) for w in ("old", "new")}
        self.holding = "old"

    def hold(self, which: str) -> None:
        if self.holding != which:
            self.link.sync(self.states[which], self.llm.weight_version + 1)
            self.holding = which

    def live_tokens(self, ids: Sequence[str]) -> list[int]:
        """Committed tokens of every sample of these requests not returned yet."""
        return [s.num_generated - s.num_pending for rid in ids for s in self.llm.live_sequences(rid)]


def switch_index(out: RequestOutput, new_version: int) -> int | None:
    starts = [start for start, v in out.outputs[0].weight_version_spans if v == new_version]
    return starts[0] if starts else None


def policy(on_sync: str) -> dict[str, object]:
    """add_request's sync options for a policy name; "stale" is keep with max_staleness 0 (restarted)."""
    return {"on_sync": "keep", "max_staleness": 0} if on_sync == "stale" else {"on_sync": on_sync}


def rollout(engine: Engine, prompts: Sequence[list[int]], mode: str, group: Sequence[int], split: int,
            on_sync: str = "recompute", warm: Callable[[LLM], None] | None = None,
            across_sleep: bool = False) -> dict[int, Synced]:
    """The group in one call on the old weights; the new ones go live once every request has `split`
    tokens (across a sleep that holds them when `across_sleep`), then the group runs to the end."""
    llm = engine.llm
    engine.hold("old")
    llm.block_manager.reset_prefix_cache()
    if warm is not None:
        warm(llm)
    ids = {llm.add_request(prompts[i], params(mode, i), **policy(on_sync)): i for i in group}  # type: ignore[arg-type]
    outs = {}
    while any(n < split for n in engine.live_tokens(list(ids))):
        outs.update((o.request_id, o) for o in llm.step())
    if across_sleep:
        llm.sleep(1, in_flight="hold")
        llm.wake_up()
    engine.hold("new")
    outs.update((o.request_id, o) for o in llm.take_finished())
    while llm.has_unfinished():
        outs.update((o.request_id, o) for o in llm.step())
    return {ids[rid]: (result(o), switch_index(o, llm.weight_version)) for rid, o in outs.items()}


class Alone:
    """Each prompt alone with the sync at a given token index (None: never), on a synchronous engine."""

    def __init__(self, engine: Engine, prompts: Sequence[list[int]]) -> None:
        self.engine, self.prompts = engine, prompts
        self.memo: dict[tuple[str, int, int | None, str], Synced] = {}

    def __call__(self, mode: str, i: int, split: int | None, on_sync: str = "recompute") -> Synced:
        key = (mode, i, split, on_sync)
        if key not in self.memo:
            if split is None:  # finished before the sync: the old weights alone
                self.engine.hold("old")
                self.engine.llm.block_manager.reset_prefix_cache()
                self.memo[key] = (result(self.engine.llm.generate(self.prompts[i], params(mode, i))[0]), None)
            else:
                self.memo[key] = rollout(self.engine, self.prompts, mode, [i], split, on_sync)[i]
        return self.memo[key]

    def check(self, got: dict[int, Synced], mode: str, on_sync: str = "recompute") -> None:
        for i, (res, split) in got.items():
            assert (res, split) == self(mode, i, split, on_sync), f"prompt {i}, new weights from token {split}"


@pytest.fixture(scope="module")
def main(dirs: dict[str, Path]) -> Engine:
    return Engine(dirs)


@pytest.fixture(scope="module")
def ref(main: Engine, prompts: list[list[int]]) -> Alone:
    return Alone(main, prompts)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("on_sync", ["recompute", "keep", "abort", "stale"])
def test_a_batch_across_a_sync_changes_no_bit(main: Engine, ref: Alone, prompts: list[list[int]], mode: str,
                                              on_sync: str) -> None:
    """Each policy; "stale": keep with max_staleness 0, which the sync restarts from the prompt."""
    got = rollout(main, prompts, mode, range(len(prompts)), SPLIT, on_sync)
    expect_split = 0 if on_sync in ("abort", "stale") else SPLIT
    assert {split for _, split in got.values()} == {expect_split}
    ref.check(got, mode, on_sync)
    old = {i: ref(mode, i, None)[0] for i in got}
    assert any(got[i][0] != old[i] for i in got), "the new weights changed nothing: the test shows nothing"


def test_recompute_continues_as_a_fresh_request_of_the_prefix(main: Engine, prompts: list[list[int]]) -> None:
    """Greedy: the tokens after the sync and their logprobs are, bit for bit, what a fresh request of the
    prompt plus the tokens before it gives under the new weights."""
    got = rollout(main, prompts, "greedy", range(len(prompts)), SPLIT)
    main.hold("new")
    main.llm.block_manager.reset_prefix_cache()
    fresh = main.llm.generate([prompts[i] + got[i][0][0][0][:SPLIT] for i in got],
                              SamplingParams(temperature=0.0, max_tokens=NEW - SPLIT, ignore_eos=True))
    for i, out in zip(got, fresh):
        sample = got[i][0][0]
        assert out.outputs[0].token_ids == sample[0][SPLIT:]
        assert out.outputs[0].logprobs == logprobs_of(sample)[SPLIT:]


@pytest.mark.parametrize("mode", MODES)
def test_calls_of_other_sizes_and_a_shuffled_order_across_a_sync_change_no_bit(
        main: Engine, ref: Alone, prompts: list[list[int]], mode: str) -> None:
    order = list(range(len(prompts)))
    torch.manual_seed(0)
    shuffled = [order[j] for j in torch.randperm(len(order)).tolist()]
    for group in (order[:3], order[3:], shuffled[:5], shuffled[5:]):
        ref.check(rollout(main, prompts, mode, group, SPLIT), mode)


@pytest.mark.parametrize("mode", MODES)
def test_prefix_cache_hits_before_a_sync_change_no_bit(main: Engine, ref: Alone, prompts: list[list[int]],
                                                       mode: str) -> None:
    sharing = range(0, len(prompts), 2)
    warm = lambda llm: llm.generate([prompts[0][:PREFIX]], SamplingParams(temperature=0.0, max_tokens=1))
    ref.check(rollout(main, prompts, mode, sharing, SPLIT, warm=warm), mode)


@pytest.mark.parametrize("mode", MODES)
def test_preemption_and_chunked_prefill_across_a_sync_change_no_bit(
        dirs: dict[str, Path], main: Engine, ref: Alone, prompts: list[list[int]], mode: str) -> None:
    tight = Engine(dirs, **tight_options(main.llm, prompts))
    got = rollout(tight, prompts, mode, range(len(prompts)), SPLIT)
    assert tight.llm.scheduler.preempted > 0
    assert len({split for _, split in got.values()}) > 1  # requests stood at different tokens at the sync
    ref.check(got, mode)


@pytest.mark.parametrize("mode", MODES)
def test_a_draft_model_across_a_sync_changes_no_bit(dirs: dict[str, Path], ref: Alone, prompts: list[list[int]],
                                                    mode: str) -> None:
    spec = Engine(dirs, draft_model=str(dirs["draft"]), num_speculative_tokens=3)
    got = rollout(spec, prompts, mode, range(len(prompts)), SPLIT)
    assert 0 < spec.llm.spec_stats.accepted < spec.llm.spec_stats.proposed
    ref.check(got, mode)


@pytest.mark.parametrize("mode", MODES)
def test_the_modes_own_draft_across_a_sync_and_a_held_sleep_changes_no_bit(
        dirs: dict[str, Path], ref: Alone, prompts: list[list[int]], mode: str) -> None:
    """The draft is the target's modules on other kernels: it proposes with the weights just synced."""
    own = Engine(dirs, **SELF_DRAFT)
    ref.check(rollout(own, prompts, mode, range(len(prompts)), SPLIT, across_sleep=True), mode)
    assert 0 < own.llm.spec_stats.accepted <= own.llm.spec_stats.proposed


@pytest.mark.parametrize("mode", MODES)
def test_async_steps_and_a_sleep_that_holds_the_requests_change_no_bit(
        dirs: dict[str, Path], ref: Alone, prompts: list[list[int]], mode: str) -> None:
    """The rollout pool's way: the requests are held through a sleep, the sync lands, and they go on."""
    overlapped = Engine(dirs, async_scheduling=True)
    ref.check(rollout(overlapped, prompts, mode, range(len(prompts)), SPLIT, across_sleep=True), mode)
