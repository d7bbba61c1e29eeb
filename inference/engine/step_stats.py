"""Per-step records of the engine, kept only when asked (benchmarks: bench_rollout's roofline).

`LLM.step_log = StepLog()` starts recording; every step that runs then appends one StepRecord.
Counting happens on the host from the scheduled batch before the step runs (the step advances
its sequences), so a record costs a few sums over the batch and no device sync.
"""

from __future__ import annotations

import operator
import time
from dataclasses import dataclass

from inference.sched.scheduler import ScheduledBatch

_COMPUTED = operator.attrgetter("num_computed_tokens")


@dataclass(frozen=True)
class StepRecord:
    """One engine step. A row computes m = n + k query tokens (n scheduled, k draft lookahead) after
    its c computed ones; its attention reads the KV of c + m positions.

    Invariants: decode_tokens + prefill_tokens == the tokens the target computed; context_tokens
    >= that; attended_pairs == sum over rows of m * c + m * (m + 1) / 2 (causal attention).
    """

    num_seqs: int  # rows scheduled (the running batch of this step)
    num_decode: int  # rows that compute one token (plus lookahead) and sample: decode rows
    decode_tokens: int  # query tokens of decode rows, lookahead included
    prefill_tokens: int  # query tokens of the other rows (prompt chunks, recompute after preemption)
    context_tokens: int  # sum over rows of c + m: the KV positions the step's attention reads
    attended_pairs: int  # (query token, key position) pairs attention computes
    num_sampled: int  # rows that produce a token (rows of logits)
    num_finished: int  # sequences the step finished
    start_s: float  # time.perf_counter() before the step ran (after scheduling)
    end_s: float  # time.perf_counter() after its results were committed


@dataclass(frozen=True)
class _Pending:
    counts: tuple[int, int, int, int, int, int, int]
    start_s: float


class StepLog:
    """The records of the steps run since it was attached, oldest first."""

    def __init__(self) -> None:
        self.records: list[StepRecord] = []

    def begin(self, batch: ScheduledBatch) -> _Pending:
        """Count a scheduled batch (before it runs)."""
        return _Pending(count_batch(batch), time.perf_counter())

    def end(self, pending: _Pending, num_finished: int) -> None:
        self.records.append(StepRecord(*pending.counts, num_finished, pending.start_s, time.perf_counter()))


def count_batch(batch: ScheduledBatch) -> tuple[int, int, int, int, int, int, int]:
    """(num_seqs, num_decode, decode_tokens, prefill_tokens, context_tokens, attended_pairs,
    num_sampled) of a batch whose sequences have not advanced yet."""
    rows = len(batch.seqs)
    sampled = sum(batch.sample)
    computed = sum(map(_COMPUTED, batch.seqs))
    if sum(batch.num_new_tokens) == rows == sampled and not any(batch.num_lookahead):
        # the common decode step: one query token per row, attending to c + 1 positions
        return rows, rows, rows, 0, computed + rows, computed + rows, sampled
    num_decode = decode_tokens = prefill_tokens = context = pairs = 0
    for seq, n, k, samples in zip(batch.seqs, batch.num_new_tokens, batch.num_lookahead, batch.sample):
        c, m = seq.num_computed_tokens, n + k
        context += c + m
        pairs += m * c + m * (m + 1) // 2
        if n == 1 and samples:
            num_decode += 1
            decode_tokens += m
        else:
            prefill_tokens += m
    return rows, num_decode, decode_tokens, prefill_tokens, context, pairs, sampled
