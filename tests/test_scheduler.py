"""Scheduler on CPU with a fake runner that keeps a fake paged KV cache.

The fake runner writes (token, position) into the slot of every computed token and, before each
step, reads back every sequence's already-computed context through its block table. So a prefix hit
on KV that is not computed yet, a block reused while still in use, or a wrong block table fails the
test; the next token is a function of the context read back, so wrong KV also changes the output.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from inference.config import SchedulerConfig
from inference.core import FinishReason, InvalidRequestError, SamplingParams
from inference.sched.block_manager import BlockManager
from inference.sched.scheduler import ScheduledBatch, Scheduler
from inference.sched.sequence import Sequence, SequenceStatus, derive_seed

BS = 4
VOCAB = 50
EOS = 0
SEED_5_1 = 6770329953205221076  # derive_seed(5, 1), fixed forever: seeded rollouts reproduce


class FakeRunner:
    def __init__(self, num_blocks: int, block_size: int = BS) -> None:
        self.kv: list[tuple[int, int] | None] = [None] * (num_blocks * block_size)
        self.bs = block_size

    def _slot(self, seq: Sequence, pos: int) -> int:
        return seq.block_table[pos // self.bs] * self.bs + pos % self.bs

    def _context(self, seq: Sequence, end: int) -> list[int]:
        ctx = []
        for pos in range(end):
            entry = self.kv[self._slot(seq, pos)]
            assert entry == (seq.token_ids[pos], pos), f"{seq}: wrong KV at position {pos}: {entry}"
            ctx.append(entry[0])
        return ctx

    def __call__(self, batch: ScheduledBatch) -> list[tuple[int, float, dict[int, float] | None] | None]:
        for seq in batch.seqs:  # KV claimed as computed must be there before this step writes anything
            self._context(seq, seq.num_computed_tokens)
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
                self.kv[self._slot(seq, pos)] = (seq.token_ids[pos], pos)
        out: list[tuple[int, float, dict[int, float] | None] | None] = []
        for seq, n, sample in zip(batch.seqs, batch.num_new_tokens, batch.sample):
            if not sample:
                out.append(None)
                continue
            ctx = self._context(seq, seq.num_computed_tokens + n)
            token = next_token(ctx, seq.index)
            top = {token: -0.5} if seq.params.logprobs else None
            out.append((token, -token / VOCAB, top))
        return out


def next_token(ctx: list[int], index: int) -> int:
    """Deterministic in the context; never EOS unless the context says so (see stop-rule tests)."""
    return 1 + (sum(ctx) * 7 + len(ctx) + index) % (VOCAB - 1)


def make(num_blocks: int = 64, max_num_seqs: int = 8, budget: int = 64, max_model_len: int = 256,
         prefix: bool = True) -> tuple[Scheduler, FakeRunner]:
    bm = BlockManager(num_blocks, BS, enable_prefix_caching=prefix)
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
    return Scheduler(config, bm, max_model_len, (EOS,)), FakeRunner(num_blocks)


def check_invariants(sched: Scheduler, batch: ScheduledBatch) -> None:
    bm = sched.block_manager
    assert batch.num_tokens <= sched.config.max_num_batched_tokens
    assert batch.num_seqs <= sched.config.max_num_seqs
    assert len({s.seq_id for s in batch.seqs}) == batch.num_seqs
    assert all(s.status is SequenceStatus.RUNNING for s in batch.seqs)
    for s, n in zip(batch.seqs, batch.num_new_tokens):
        assert len(s.block_table) * BS >= s.num_computed_tokens + n
    assert all(not s.block_table for s in sched.waiting)
    refs = Counter(b for s in sched.running for b in s.block_table)
    assert all(bm.ref_count(b) == c for b, c in refs.items())
    assert bm.num_free_blocks == bm.num_blocks - len(refs)


def run_all(sched: Scheduler, runner: FakeRunner, max_steps: int = 5000) -> list[ScheduledBatch]:
    batches = []
    while sched.has_unfinished():
        assert len(batches) < max_steps, "no progress"
        batch = sched.schedule()
        assert not batch.is_empty, "an empty step with work pending would spin forever"
        check_invariants(sched, batch)
        sched.commit(batch, runner(batch))
        batches.append(batch)
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert all(bm.ref_count(b) == 0 for b in range(bm.num_blocks))
    return batches


def add_request(sched: Scheduler, rid: str, prompt: list[int], **params: object) -> list[Sequence]:
    seqs = Sequence.group(rid, prompt, SamplingParams(**params))  # type: ignore[arg-type]
    for s in seqs:
        sched.add(s)
    return seqs


def workload(sched: Scheduler, num: int = 12) -> list[Sequence]:
    seqs = []
    for i in range(num):
        prompt = [(i * 13 + j) % (VOCAB - 1) + 1 for j in range(3 + (i * 5) % 17)]
        seqs += add_request(sched, f"r{i}", prompt, max_tokens=5 + i % 9, n=1 + i % 3)
    return seqs


def outputs(seqs: list[Sequence]) -> dict[tuple[str, int], tuple[list[int], list[float], object]]:
    return {(s.request_id, s.index): (s.completion_token_ids, s.logprobs, s.finish_reason) for s in seqs}


def test_mixed_steps_honour_token_budget_and_max_num_seqs() -> None:
    sched, runner = make(max_num_seqs=3, budget=10)
    a, b, c, d = (add_request(sched, x, [k] * 6, max_tokens=3)[0] for k, x in enumerate("abcd", 1))
    step1 = sched.schedule()
    assert (step1.seqs, step1.num_new_tokens, step1.sample) == ([a, b], [6, 4], [True, False])
    sched.commit(step1, runner(step1))
    step2 = sched.schedule()
    # a's decode first, then b's prefill continues, then c is admitted; d waits for a seat.
    assert (step2.seqs, step2.num_new_tokens, step2.sample) == ([a, b, c], [1, 2, 6], [True, True, True])
    assert d.status is SequenceStatus.WAITING
    sched.commit(step2, runner(step2))
    run_all(sched, runner)
    assert all(s.num_generated == 3 and s.finish_reason is FinishReason.LENGTH for s in (a, b, c, d))


def test_chunked_prefill_of_a_prompt_longer_than_the_budget() -> None:
    prompt = [(7 * j) % 40 + 1 for j in range(30)]
    sched, runner = make(budget=8)
    (seq,) = add_request(sched, "long", prompt, max_tokens=4, logprobs=1)
    batches = run_all(sched, runner)
    assert [b.num_new_tokens for b in batches[:4]] == [[8], [8], [8], [6]]
    assert [b.sample for b in batches[:4]] == [[False], [False], [False], [True]]
    ref_sched, ref_runner = make(budget=64)
    (ref,) = add_request(ref_sched, "long", prompt, max_tokens=4)
    run_all(ref_sched, ref_runner)
    assert seq.completion_token_ids == ref.completion_token_ids and len(ref.completion_token_ids) == 4
    assert seq.top_logprobs == [{t: -0.5} for t in seq.completion_token_ids] and ref.top_logprobs is None


@pytest.mark.parametrize("prefix", [True, False])
def test_preemption_under_a_tiny_cache_completes_everything_with_the_same_output(prefix: bool) -> None:
    ref_sched, ref_runner = make(num_blocks=256, max_num_seqs=64, budget=512, prefix=prefix)
    ref = workload(ref_sched)
    run_all(ref_sched, ref_runner)
    assert ref_sched.preempted == 0

    sched, runner = make(num_blocks=12, max_num_seqs=16, budget=16, prefix=prefix)
    seqs = workload(sched)
    run_all(sched, runner)
    assert sched.preempted > 0
    assert sum(s.preemptions for s in seqs) == sched.preempted  # each preemption charged to its victim
    assert all(s.is_finished and s.finish_reason is FinishReason.LENGTH for s in seqs)
    assert outputs(seqs) == outputs(ref)


def test_n_samples_hit_the_leaders_full_prompt_blocks() -> None:
    sched, runner = make(budget=6)
    prompt = list(range(1, 11))  # 2 full blocks + 2 tokens
    seqs = add_request(sched, "grpo", prompt, n=4, max_tokens=3, temperature=1.0, seed=5)
    first = sched.schedule()
    assert first.seqs == [seqs[0]]  # chunk 1 of the leader's prompt; the others wait for it
    sched.commit(first, runner(first))
    run_all(sched, runner)
    bm = sched.block_manager
    assert [s.num_cached_tokens for s in seqs] == [0, 8, 8, 8]
    assert (bm.stats.hit_blocks, bm.stats.hit_tokens) == (6, 24)
    # Each sample has its own seed, the same in every process and run (Python's hash() is salted).
    assert [s.seed for s in seqs] == [derive_seed(5, i) for i in range(4)]
    assert len({s.seed for s in seqs}) == 4 and derive_seed(5, 1) == SEED_5_1
    assert Sequence("u", 0, [1], SamplingParams()).seed is None
    assert [s.completion_token_ids for s in seqs] == [  # each sample continued its own prompt copy
        _expected(prompt, 3, i) for i in range(4)]


def _expected(prompt: list[int], max_tokens: int, index: int) -> list[int]:
    ctx = list(prompt)
    for _ in range(max_tokens):
        ctx.append(next_token(ctx, index))
    return ctx[len(prompt):]


def test_same_prompt_admitted_in_the_same_step_does_not_hit_uncomputed_blocks() -> None:
    sched, runner = make(budget=64)
    prompt = list(range(1, 14))
    a = add_request(sched, "a", prompt, max_tokens=2)[0]
    b = add_request(sched, "b", prompt, max_tokens=2)[0]
    step = sched.schedule()
    assert step.seqs == [a, b] and step.num_new_tokens == [13, 13]
    assert b.num_cached_tokens == 0
    sched.commit(step, runner(step))
    c = add_request(sched, "c", prompt, max_tokens=2)[0]
    run_all(sched, runner)
    assert c.num_cached_tokens == 12
    assert a.completion_token_ids == b.completion_token_ids == c.completion_token_ids


def test_a_prompt_mid_chunked_prefill_shares_only_its_computed_blocks() -> None:
    sched, runner = make(budget=10)
    prompt = list(range(1, 14))
    a = add_request(sched, "a", prompt, max_tokens=2)[0]
    b = add_request(sched, "b", prompt, max_tokens=2)[0]
    step1 = sched.schedule()
    assert (step1.seqs, step1.num_new_tokens) == ([a], [10])  # blocks 0-2 held, tokens 10, 11 not computed
    sched.commit(step1, runner(step1))
    step2 = sched.schedule()
    assert step2.seqs == [a, b]
    assert b.num_cached_tokens == 8  # blocks 0 and 1; block 2 is still being written by a
    sched.commit(step2, runner(step2))
    run_all(sched, runner)
    assert a.completion_token_ids == b.completion_token_ids == _expected(prompt, 2, 0)


def scripted(sched: Scheduler, prompt: list[int], tokens: list[int], **params: object) -> Sequence:
    """Feed the sequence the given tokens, one per step."""
    (seq,) = add_request(sched, "s", prompt, **params)
    feed = iter(tokens)
    while sched.has_unfinished():
        batch = sched.schedule()
        sched.commit(batch, [(next(feed), -1.0, None) if smp else None for smp in batch.sample])
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    return seq


@pytest.mark.parametrize(
    ("params", "tokens", "expect", "reason", "stop_reason"),
    [
        ({}, [5, 6, EOS, 7], [5, 6, EOS], FinishReason.STOP, None),
        ({"ignore_eos": True, "max_tokens": 4}, [5, EOS, 6, 7, 8], [5, EOS, 6, 7], FinishReason.LENGTH, None),
        ({"stop_token_ids": (9,)}, [5, 9, 6], [5, 9], FinishReason.STOP, 9),
        ({"max_tokens": 3}, [5, 6, 7, 8], [5, 6, 7], FinishReason.LENGTH, None),
        ({"max_tokens": 100}, [5] * 20, [5] * 6, FinishReason.LENGTH, None),  # max_model_len = 10
    ],
)
def test_stop_rules(params: dict, tokens: list[int], expect: list[int], reason: FinishReason,
                    stop_reason: int | None) -> None:
    sched, _ = make(max_model_len=10)
    seq = scripted(sched, [1, 2, 3, 4], tokens, **params)
    assert seq.completion_token_ids == expect
    assert (seq.finish_reason, seq.stop_reason) == (reason, stop_reason)
    assert len(seq.logprobs) == len(expect)


def test_abort_waiting_and_running_requests() -> None:
    sched, runner = make(max_num_seqs=2)
    running = add_request(sched, "run", [1, 2, 3], n=2, max_tokens=50)
    batch = sched.schedule()  # "run" takes both slots before the others arrive (admission is fair between calls)
    sched.commit(batch, runner(batch))
    waiting = add_request(sched, "wait", [6, 7, 8], max_tokens=50)
    other = add_request(sched, "other", [9, 10], max_tokens=3)
    for _ in range(2):
        batch = sched.schedule()
        sched.commit(batch, runner(batch))
    assert all(s.status is SequenceStatus.RUNNING for s in running)
    assert waiting[0].status is SequenceStatus.WAITING
    assert sched.abort("run") == running
    assert sched.abort("wait") == waiting
    assert sched.abort("unknown") == []
    for s in running + waiting:
        assert s.finish_reason is FinishReason.ABORT and s.block_table == []
    run_all(sched, runner)
    assert other[0].num_generated == 3
    assert all(s.num_generated < 50 for s in running) and waiting[0].num_generated == 0


def test_external_finish_frees_blocks_and_a_stale_commit_is_ignored() -> None:
    sched, runner = make()
    (seq,) = add_request(sched, "s", [1, 2, 3, 4, 5, 6], max_tokens=50)
    batch = sched.schedule()
    out = runner(batch)
    sched.finish(seq, FinishReason.STOP, "</end>")  # e.g. an abort that arrived while the step ran
    assert sched.commit(batch, out) == []
    assert (seq.finish_reason, seq.stop_reason, seq.num_generated) == (FinishReason.STOP, "</end>", 0)
    assert not sched.has_unfinished()
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_preempt_all_then_resume_gives_the_same_output() -> None:
    ref_sched, ref_runner = make()
    ref = workload(ref_sched, 4)
    run_all(ref_sched, ref_runner)
    sched, runner = make()
    seqs = workload(sched, 4)
    for _ in range(3):
        batch = sched.schedule()
        sched.commit(batch, runner(batch))
    assert sched.preempt_all() > 0
    assert sched.num_running == 0 and sched.block_manager.usage == 0.0
    sched.block_manager.reset_prefix_cache()  # as after a weight update
    run_all(sched, runner)
    assert outputs(seqs) == outputs(ref)


def test_requests_that_can_never_run_are_rejected_at_add() -> None:
    sched, _ = make(num_blocks=4, max_model_len=64)  # the cache holds 16 tokens
    with pytest.raises(InvalidRequestError) as e:
        sched.add(Sequence("a", 0, list(range(1, 65)), SamplingParams()))
    assert e.value.field == "prompt"  # no room left under max_model_len
    with pytest.raises(InvalidRequestError) as e:
        sched.add(Sequence("b", 0, list(range(1, 18)), SamplingParams()))
    assert e.value.field == "prompt"  # 17 tokens never fit 16 slots
    with pytest.raises(InvalidRequestError) as e:
        sched.add(Sequence("c", 0, list(range(1, 11)), SamplingParams(max_tokens=8)))
    assert e.value.field == "sampling_params.max_tokens"
    assert sched.num_waiting == 0
    sched.add(ok := Sequence("d", 0, list(range(1, 11)), SamplingParams(max_tokens=7)))  # 16 KV slots
    run_all(sched, FakeRunner(4))
    assert ok.num_generated == 7


@pytest.mark.parametrize("trial", range(24))
def test_random_workloads_match_the_unconstrained_run(trial: int) -> None:
    """Random caches, budgets, seat limits and shared prefixes: every request completes, and its
    tokens and logprobs equal those of a run with room for everything (no preemption)."""
    rng = random.Random(trial)
    num_blocks, budget, max_num_seqs = rng.randrange(8, 40), rng.randrange(1, 40), rng.randrange(1, 12)
    prefix = trial % 4 != 0

    def requests(sched: Scheduler) -> list[Sequence]:
        r = random.Random(trial)
        seqs: list[Sequence] = []
        for i in range(15):
            shared = r.choice([[5] * 8, list(range(7, 16)), []])
            prompt = shared + [r.randrange(1, VOCAB) for _ in range(r.randrange(1, 25))]
            params = {"max_tokens": r.randrange(1, 20), "n": r.randrange(1, 5)}
            if len(prompt) + params["max_tokens"] - 1 <= num_blocks * BS:  # else rejected at add
                seqs += add_request(sched, f"r{i}", prompt, **params)
        return seqs

    ref_sched, ref_runner = make(512, max_num_seqs=256, budget=4096, max_model_len=60, prefix=prefix)
    ref = requests(ref_sched)
    run_all(ref_sched, ref_runner)
    sched, runner = make(num_blocks, max_num_seqs, budget, max_model_len=60, prefix=prefix)
    seqs = requests(sched)
    run_all(sched, runner, max_steps=100_000)
    assert outputs(seqs) == outputs(ref)


@pytest.mark.parametrize("prefix", [True, False])
def test_a_sync_keeps_recomputes_or_restarts_each_sequence_as_it_asked(prefix: bool) -> None:
    """Scheduler.on_weights_live between two steps, under memory pressure (some sequences already
    preempted): keep holds its blocks, recompute and abort go back to waiting (abort to its prompt), the
    queue keeps arrival order, the KV the fake runner checks stays right, and every sequence finishes once
    with what a run without the sync gives (the fake model does not change with the weights)."""
    modes = ["keep", "recompute", "abort", "keep", "abort", "recompute"]

    def start(sched: Scheduler) -> list[Sequence]:
        seqs = []
        for i, mode in enumerate(modes):
            (seq,) = add_request(sched, f"r{i}", [i + 1] * 6, max_tokens=14, ignore_eos=True)
            seq.on_sync = mode
            seqs.append(seq)
        return seqs

    ref_sched, ref_runner = make(num_blocks=14, prefix=prefix)
    ref = start(ref_sched)
    run_all(ref_sched, ref_runner)
    sched, runner = make(num_blocks=14, prefix=prefix)
    seqs = start(sched)
    for _ in range(6):
        batch = sched.schedule()
        check_invariants(sched, batch)
        sched.commit(batch, runner(batch))
    had = {s.seq_id: (s.status, s.num_generated, list(s.block_table)) for s in seqs}
    assert any(status is SequenceStatus.WAITING and n for status, n, _ in had.values()), "no pressure"
    restarted = sched.on_weights_live(1)
    sched.block_manager.reset_prefix_cache()
    assert sorted(s.seq_id for s in restarted) == sorted(s.seq_id for s in seqs if s.on_sync == "abort"
                                                          and had[s.seq_id][1])
    for s in seqs:
        status, n, blocks = had[s.seq_id]
        if s.on_sync == "keep":
            assert (s.status, s.num_generated, s.block_table) == (status, n, blocks)
        else:
            assert s.status is SequenceStatus.WAITING and not s.block_table
            aborted = s.on_sync == "abort" and n > 0
            assert s.num_generated == (0 if aborted else n) and s.restarts == aborted
    assert [s.arrival for s in sched.waiting] == sorted(s.arrival for s in sched.waiting)
    run_all(sched, runner)
    assert all(s.is_finished for s in seqs) and not sched.has_unfinished()
    assert [s.completion_token_ids for s in seqs] == [s.completion_token_ids for s in ref]
