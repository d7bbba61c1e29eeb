"""The data of one scheduled step: what the scheduler hands the runner (ScheduledBatch) and what a
step gives back per row (StepResult, made of Sampled). Pure Python; inference.sched.scheduler re-exports
all three names, so importers may use either module.

Invariants (checked at construction): the three per-row lists have one entry per sequence, every row
computes at least one token, and a row with lookahead is a decode row (one new token).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from inference.sched.sequence import Sequence

# (token id, logprob, top logprobs or None) for a sequence that sampled, None for one that did not
Sampled = tuple[int, float, dict[int, float] | None]
# a speculative row's accepted run: the accepted draft tokens then the target's own token
StepResult = Sampled | list[Sampled] | None


@dataclass
class ScheduledBatch:
    """One step: seqs[i] computes tokens [c, c + num_new_tokens[i]) where c = its num_computed_tokens
    at schedule time. sample[i] is True when that chunk reaches the end of its tokens, i.e. the step
    produces its next token. Computed at construction, before commit() advances the sequences.
    num_lookahead[i] > 0 (a decode row only) asks for that many draft tokens verified in this step.
    The scheduler passes `sample` (it knows each row's chunk as it plans it); left out, it is computed."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_lookahead: list[int] = field(default_factory=list)  # empty: no speculation in this step
    sample: list[bool] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.num_lookahead:
            self.num_lookahead = [0] * len(self.seqs)
        assert len(self.seqs) == len(self.num_new_tokens) == len(self.num_lookahead)
        assert not any(self.num_lookahead) or all(
            k == 0 or n == 1 for n, k in zip(self.num_new_tokens, self.num_lookahead))
        assert min(self.num_new_tokens, default=1) > 0
        if len(self.sample) != len(self.seqs):
            assert not self.sample, "sample has one entry per row"
            self.sample = [
                s.num_computed_tokens + n == len(s.token_ids) for s, n in zip(self.seqs, self.num_new_tokens)]

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)
