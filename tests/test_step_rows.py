"""The host work of a step, as the runner and the scheduler do it per row: the step's row inputs equal
the per-token definition, the block-table mirror equals freshly padded tables, the decode graphs are
staged with the eager path's rows, and the one-pass schedule plans the batches the two-pass one did."""

from __future__ import annotations

import random
import struct

import numpy as np
import pytest
import torch
import xxhash

from inference.batch import AttentionMetadata
from inference.core import SamplingParams
from inference.engine.llm import LLM
from inference.runner.inputs import BlockTables, build_step_rows, decode_rows
from inference.sched.block_manager import BlockManager, block_hash
from inference.sched.scheduler import ScheduledBatch, Scheduler, _Plan
from inference.sched.sequence import Sequence, SequenceStatus
from tests.test_async_schedule import LaunchingFakeRunner, run_async, run_sync
from tests.test_scheduler import BS, VOCAB, FakeRunner, add_request, make, next_token


def padded(tables: list[list[int]]) -> np.ndarray:
    out = np.zeros((len(tables), max(map(len, tables), default=0) or 1), dtype=np.int32)
    for row, table in zip(out, tables):
        row[:len(table)] = table
    return out


def test_block_tables_mirror_equals_the_padded_tables() -> None:
    """Rows grown in place, replaced by shorter or equal-length lists, reordered, dropped and brought
    back: the mirror's view is always the tables padded with zeros."""
    rng = random.Random(0)
    mirror = BlockTables()
    tables = [[rng.randrange(100) for _ in range(rng.randrange(1, 6))] for _ in range(8)]
    for _ in range(300):
        op = rng.randrange(5)
        i = rng.randrange(len(tables))
        if op == 0:
            tables[i].append(rng.randrange(100))  # a sequence grew by a block
        elif op == 1:
            tables[i] = [rng.randrange(100) for _ in range(rng.randrange(0, 9))]  # freed and reallocated
        elif op == 2:
            tables[i] = list(tables[i])  # another list with the same blocks
        elif op == 3:
            rng.shuffle(tables)
        rows = tables[: rng.randrange(1, len(tables) + 1)]
        np.testing.assert_array_equal(mirror.update(rows), padded(rows))
    assert mirror._host.shape[0] <= 16 and mirror._host.shape[1] <= 32  # grown by doubling, not per call


def test_block_tables_growth_stays_bounded() -> None:
    """A table that grows by one block per call (a long decode) widens the mirror a few times only."""
    mirror = BlockTables()
    table: list[int] = []
    for block in range(600):
        table.append(block)
        assert mirror.update([table]).tolist() == [table]
    assert mirror._host.shape == (1, 1024)


def reference_rows(batch: ScheduledBatch, bs: int) -> dict[str, list]:
    """The per-token definition (the runner's loop before it went to lists and numpy ranges)."""
    ids, positions, slots, context, sample_rows, last = [], [], [], [], [], []
    for row, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
        start = seq.num_computed_tokens
        ids += seq.token_ids[start:start + n]
        positions += range(start, start + n)
        slots += [seq.block_table[p // bs] * bs + p % bs for p in range(start, start + n)]
        context.append(start + n)
        if start + n == seq.num_tokens:
            sample_rows.append(row)
            last.append(len(ids) - 1)
    return {"ids": ids, "positions": positions, "slots": slots, "context_lens": context,
            "query_lens": list(batch.num_new_tokens), "sample_rows": sample_rows, "last_index": last}


def random_batch(rng: random.Random, decode_only: bool) -> ScheduledBatch:
    seqs, news = [], []
    for _ in range(rng.randrange(1, 12)):
        prompt = [rng.randrange(-5, VOCAB) for _ in range(rng.randrange(1, 60))]  # < 0: placeholders
        seq = Sequence("r", 0, prompt, SamplingParams())
        seq.num_computed_tokens = rng.randrange(len(prompt))
        remaining = len(prompt) - seq.num_computed_tokens
        n = 1 if decode_only else rng.randrange(1, remaining + 1)
        if decode_only:
            seq.num_computed_tokens = len(prompt) - 1
        seq.block_table = rng.sample(range(500), -(-(seq.num_computed_tokens + n) // BS))
        seqs.append(seq)
        news.append(n)
    return ScheduledBatch(seqs, news)


@pytest.mark.parametrize("decode_only", [False, True])
def test_step_rows_equal_the_per_token_definition(decode_only: bool) -> None:
    rng = random.Random(int(decode_only))
    mirror = BlockTables()
    for _ in range(60):
        batch = random_batch(rng, decode_only)
        rows, table_rows = build_step_rows(batch, BS, mirror)
        got = {k: list(np.asarray(getattr(rows, k)).tolist()) for k in reference_rows(batch, BS)}
        assert got == reference_rows(batch, BS)
        np.testing.assert_array_equal(table_rows, padded(rows.tables))
        if decode_only:
            direct = decode_rows(batch.seqs, BS)
            assert (direct.ids, direct.slots, direct.context_lens) == (rows.ids, rows.slots, rows.context_lens)


def test_metadata_from_table_rows_equals_build() -> None:
    rng = random.Random(3)
    for decode in (True, False):
        q = [1 if decode else rng.randrange(1, 9) for _ in range(7)]
        ctx = [rng.randrange(q_i, 90) for q_i in q]
        tables = [list(range(rng.randrange(1, 8))) for _ in q]
        slots = torch.arange(sum(q))
        want = AttentionMetadata.build(q, ctx, slots, tables, BS, "cpu")
        got = AttentionMetadata.from_table_rows(q, ctx, slots, padded(tables), BS, "cpu")
        for name in ("query_lens", "context_lens_host", "max_query_len", "max_context_len", "is_decode"):
            assert getattr(got, name) == getattr(want, name), name
        for name in ("cu_query_lens", "context_lens", "block_tables"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name


def test_block_hash_packs_tokens_as_unsigned_words() -> None:
    """The prefix cache's hash: xxh3-64 over little-endian uint64 words (a token modulo 2**64)."""
    def masked(parent: int | None, tokens: list[int]) -> int:
        words = tokens if parent is None else [parent, *tokens]
        return xxhash.xxh3_64_intdigest(struct.pack(f"<{len(words)}Q", *(w & (2**64 - 1) for w in words)))

    for parent in (None, 0, 2**63 + 5, 2**64 - 1):
        for tokens in ([1, 2, 3, 4], [151_000, 0, 7, 2**40], [-1, -7, 3, 9]):
            assert block_hash(parent, tokens) == masked(parent, tokens)


def test_graph_decode_stages_the_eager_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode graphs exist on CUDA only; a stand-in records what the runner stages: the rows of the
    eager path (ids, positions, slots, context lengths, block tables)."""
    llm = LLM(None, device="cpu", max_num_seqs=8, max_model_len=128)
    runner = llm.worker.runner
    for p in ([5, 6, 7], [9] * 20, [4, 8, 15, 16, 23]):
        llm.add_request(p, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    while True:
        batch = llm.scheduler.schedule()
        if batch.num_tokens == batch.num_seqs and len(batch.seqs) == 3:
            break
        llm.scheduler.commit(batch, llm.worker.execute_model(batch))

    class Staged:
        def can_use(self, n: int, max_blocks: int) -> bool:
            return True

        def replay_staged(self, *args: object) -> torch.Tensor:
            self.args = args
            return torch.zeros(3, llm.model_config.vocab_size)

    staged = Staged()
    monkeypatch.setattr(runner, "graphs", staged)
    assert runner._graph_decode(batch) is not None
    ids, positions, slots, context, tables, pending = staged.args
    inp = runner.prepare(batch)
    assert (list(ids), list(positions)) == (inp.input_ids.tolist(), inp.positions.tolist())
    assert list(slots) == inp.meta.slot_mapping.tolist() and list(context) == inp.meta.context_lens.tolist()
    assert tables == [s.block_table for s in batch.seqs] and pending is None


class TwoPassScheduler(Scheduler):
    """The running pass as it was: sort every running sequence first, then plan decodes, then prefills."""

    def _schedule_running(self, plan: _Plan) -> None:
        decodes, prefills = [], []
        for seq in self.running:
            if seq.num_pending and self._reaches_length(seq):
                plan.num_ending += 1
                continue
            (decodes if seq.num_tokens - seq.num_computed_tokens == 1 else prefills).append(seq)
        speculate = self._speculates(len(decodes)) and not self.in_flight
        for group, decode in ((decodes, True), (prefills, False)):
            for seq in group:
                if plan.budget == 0:
                    return
                if seq.status is SequenceStatus.RUNNING:
                    self._schedule_one(plan, seq, decode, speculate and decode)


def recorded(sched: Scheduler) -> list[tuple]:
    """Every batch the scheduler plans, as (rows, new tokens, lookahead, sample, block tables); its
    sample list checked against the sequences as they are when it is planned."""
    log: list[tuple] = []
    schedule = sched.schedule

    def logged() -> ScheduledBatch:
        batch = schedule()
        want = [s.num_computed_tokens + n == s.num_tokens for s, n in zip(batch.seqs, batch.num_new_tokens)]
        assert batch.sample == want
        log.append(([(s.request_id, s.index) for s in batch.seqs], batch.num_new_tokens, batch.num_lookahead,
                    batch.sample, [list(s.block_table) for s in batch.seqs]))
        return batch

    sched.schedule = logged  # type: ignore[method-assign]
    return log


class SpecFakeRunner(FakeRunner):
    """FakeRunner for speculative rows too: a row with lookahead k accepts a run of 1..k+1 tokens (the
    context decides how many), and the KV of the positions the run makes computed is written."""

    def __call__(self, batch: ScheduledBatch) -> list:
        plain = ScheduledBatch(batch.seqs, batch.num_new_tokens)
        out: list = FakeRunner.__call__(self, plain)
        for row, (seq, k) in enumerate(zip(batch.seqs, batch.num_lookahead)):
            if not k:
                continue
            ctx = self._context(seq, seq.num_tokens)
            run = []
            for j in range(1 + sum(ctx) % (k + 1)):
                run.append(next_token(ctx, seq.index))
                ctx.append(run[-1])
                if j < k:
                    self.kv[self._slot(seq, seq.num_tokens + j)] = (run[-1], seq.num_tokens + j)
            out[row] = [(t, -t / VOCAB, None) for t in run]
        return out


@pytest.mark.parametrize("trial", range(12))
def test_one_pass_schedule_plans_the_two_pass_batches(trial: int) -> None:
    """Random caches (preemption), budgets (exhausted mid-decodes), seat limits and shared prefixes;
    synchronous, async and speculative: the same batches, in the same order, on the same blocks."""
    rng = random.Random(trial)
    num_blocks, budget, max_num_seqs = rng.randrange(10, 40), rng.randrange(1, 40), rng.randrange(1, 12)
    mode = ("sync", "async", "spec")[trial % 3]

    def run(cls: type[Scheduler]) -> list[tuple]:
        sched, runner = make(num_blocks, max_num_seqs, budget, max_model_len=60, prefix=trial % 4 != 0)
        sched.__class__ = cls
        if mode == "spec":
            sched.num_speculative_tokens, runner = 2, SpecFakeRunner(num_blocks)
        r = random.Random(trial)
        for i in range(15):
            prompt = r.choice([[5] * 8, []]) + [r.randrange(1, VOCAB) for _ in range(r.randrange(1, 25))]
            params = {"max_tokens": r.randrange(1, 20), "n": r.randrange(1, 4)}
            if len(prompt) + params["max_tokens"] - 1 <= num_blocks * BS:
                add_request(sched, f"r{i}", prompt, **params)
        log = recorded(sched)
        if mode == "async":
            run_async(sched, LaunchingFakeRunner(num_blocks))
        else:
            run_sync(sched, runner)
        return log

    log = run(Scheduler)
    assert log == run(TwoPassScheduler)
    assert (mode == "spec") == any(any(lookahead) for _, _, lookahead, _, _ in log)


def test_append_free_block_is_appends_result_for_one_token() -> None:
    bm = BlockManager(3, BS)
    seq = Sequence("r", 0, [1] * BS, SamplingParams())
    bm.allocate_prefix(seq, [])
    bm.append(seq, BS)
    seq.num_computed_tokens = BS
    other = Sequence("o", 0, [2] * BS, SamplingParams())
    bm.append(other, 2 * BS)  # takes the last two free blocks
    assert not bm.append_free_block(seq) and len(seq.block_table) == 1
    bm.free(other)
    assert bm.append_free_block(seq) and len(seq.block_table) == 2 and bm.num_free_blocks == 1


@pytest.mark.parametrize("overlap", [False, True])
def test_version_spans_start_where_the_version_changed(overlap: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tokens committed after the weight version changes start a span at the first of them."""
    version = {"now": 3}
    monkeypatch.setattr(LLM, "weight_version", property(lambda self: version["now"]))
    llm = LLM(None, device="cpu", max_num_seqs=4, async_scheduling=overlap)
    ids = [llm.add_request([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)),
           llm.add_request([8] * 9, SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True))]
    outs = {}
    for _ in range(4):
        for out in llm.step():
            outs[out.request_id] = out
    seqs = [s for s in llm.scheduler.running]
    known = [s.num_generated - s.num_pending for s in seqs]  # tokens committed under version 3
    version["now"] = 4
    while llm.has_unfinished():
        for out in llm.step():
            outs[out.request_id] = out
    spans = {s.request_id: s.version_spans for s in seqs}
    for seq, k in zip(seqs, known):
        assert spans[seq.request_id] == [(0, 3), (k, 4)], (spans, known)
    assert [outs[i].outputs[0].weight_version_spans for i in ids] == [spans[i] for i in ids]
