"""How many experts each engine step of an MoE model touched, counted from the routing the engine records
(SamplingParams.return_routing; docs/moe.md): what the active-weight rooflines of bench_generate and
bench_rollout charge a step for its experts (each (MoE layer, expert) pair the step's tokens went to is
read once).

`SpanLog` is a StepLog that also keeps, per step, which positions of which sequences the step computed
(host references and one list of ints a step: what StepLog's own counting costs). After a run whose
requests returned their routing, `touched_per_step` maps every step's positions onto those routing rows
(row p: the experts token p went to) and counts the distinct pairs. A run without routing is counted on
the routing of another run of the same workload (the same samples and positions: the same tokens in the
greedy and seeded modes, up to the batch's rounding).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import numpy as np

from inference.engine.step_stats import StepLog
from inference.sched.scheduler import ScheduledBatch
from inference.sched.sequence import Sequence

_COMPUTED = operator.attrgetter("num_computed_tokens")


def touched_per_layer(rows: np.ndarray, num_experts: int) -> np.ndarray:
    """rows [tokens, moe layers, k] of expert ids -> [moe layers]: the distinct experts of each layer."""
    layers = rows.shape[1]
    seen = np.zeros((layers, num_experts), dtype=bool)
    seen[np.broadcast_to(np.arange(layers)[None, :, None], rows.shape), rows.astype(np.int64)] = True
    return seen.sum(axis=1)


@dataclass(frozen=True)
class StepSpans:
    """The rows of one step: its sequences, each one's first position and its count of positions."""

    seqs: tuple[Sequence, ...]
    starts: list[int]
    counts: list[int]


class SpanLog(StepLog):
    """A StepLog that also records each step's StepSpans, in the order of its records."""

    def __init__(self) -> None:
        super().__init__()
        self.spans: list[StepSpans] = []

    def begin(self, batch: ScheduledBatch) -> Any:
        pending = super().begin(batch)
        # m = n + k positions from c on, as count_batch counts them (the sequences have not advanced yet)
        self.spans.append(StepSpans(tuple(batch.seqs), list(map(_COMPUTED, batch.seqs)),
                                    list(map(operator.add, batch.num_new_tokens, batch.num_lookahead))))
        return pending


def touched_per_step(spans: Seq[StepSpans], sample_of: dict[tuple[str, int], int], routings: Seq[np.ndarray],
                     num_experts: int) -> np.ndarray:
    """[steps]: the (MoE layer, expert) pairs each step touched. sample_of maps a sequence's (request id,
    index) to its routing in `routings` ([tokens, moe layers, k] each). A step position past its
    sample's routing rows means the log and the routing disagree: RuntimeError naming the sample."""
    steps, samples, starts, counts = [], [], [], []
    for step, s in enumerate(spans):
        for seq, c, m in zip(s.seqs, s.starts, s.counts):
            sample = sample_of[seq.request_id, seq.index]
            if c + m > len(routings[sample]):
                raise RuntimeError(f"step {step} computed positions {c}..{c + m - 1} of sample {sample} "
                                   f"({seq.request_id}, {seq.index}), whose routing has {len(routings[sample])} rows")
            steps.append(step)
            samples.append(sample)
            starts.append(c)
            counts.append(m)
    if not routings:
        return np.zeros(len(spans), dtype=np.int64)
    layers = routings[0].shape[1]
    offsets = np.cumsum([0] + [len(r) for r in routings])[:-1]
    all_rows = np.concatenate(routings)  # [sum of tokens, moe layers, k]
    count = np.asarray(counts, dtype=np.int64)
    first = offsets[np.asarray(samples, dtype=np.int64)] + np.asarray(starts, dtype=np.int64)
    # each span's rows first..first+count-1, flattened: a running index shifted per span
    row = np.repeat(first - np.cumsum(count) + count, count) + np.arange(count.sum())
    step = np.repeat(np.asarray(steps, dtype=np.int64), count)
    layer_of = np.arange(layers)[None, :, None]
    key = (step[:, None, None] * layers + layer_of) * num_experts + all_rows[row].astype(np.int64)
    seen = np.zeros(len(spans) * layers * num_experts, dtype=bool)
    seen[key.ravel()] = True
    return seen.reshape(len(spans), layers * num_experts).sum(axis=1)
