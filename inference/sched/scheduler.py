"""Continuous batching: which sequences compute how many tokens in the next step. Pure Python.

This file holds the policy (Scheduler: queues, admission, chunking, preemption, lookahead). The
step's data types are in scheduler_batch.py (ScheduledBatch, StepResult, Sampled: re-exported here)
and applying a step's results to the sequences in scheduler_commit.py (StepCommit, Scheduler's base:
commit, advance / commit_pending, the stop rules).

One step mixes decodes and prefill chunks under a token budget (max_num_batched_tokens) and a
sequence cap (max_num_seqs), in this order:
1. running decodes (1 token each), oldest arrival first;
2. running prefills in progress (chunked prefill keeps priority over new admissions);
3. waiting sequences FCFS, each with as much of its prompt as the budget leaves (the rest follows in
   later steps). Admission stops at the first sequence that does not fit, so a large prompt is never
   starved by smaller ones behind it.

When a running sequence cannot get a block, the latest-arrived running sequence not yet scheduled
this step (possibly itself) is preempted by recompute: its blocks are freed, num_computed_tokens goes
to 0 and it goes to the FRONT of the waiting queue, keeping its generated tokens and logprobs. A step
that preempted admits nothing (it would only thrash). Samples 1..n-1 of a request wait until sample 0's
prompt is computed, so they hit its full prompt blocks in the prefix cache instead of recomputing them.

Speculative decoding (num_speculative_tokens = k > 0): a running decode also gets a lookahead of up
to k draft tokens (fewer near max_tokens, max_model_len, the token budget or the free blocks; never a
preemption for lookahead). Its blocks cover the k + 1 positions the target verifies; the budget is
charged k + 1 tokens. Its result is a run of 1..k+1 tokens; tokens after a stop are dropped.
Speculation is adaptive (SchedulerConfig.spec_max_batch): a step whose running decodes outnumber the
bound schedules them without lookahead (the draft mirrors their tokens), so the draft works on the
tail of a rollout, where the batch has drained and steps are bound by weight reads, not on a full batch.

Async scheduling (the engine overlaps a step's host work with the previous step on the device):
`advance(batch)` accounts a launched step before its tokens are known and gives each row that samples
a placeholder token (scheduler_commit.py); the next schedule() then counts that token as if it were
known, except that a sequence whose pending token is its last by length (max_tokens, max_model_len)
is not scheduled again, and admission does not count it against max_num_seqs. A preempted sequence
keeps its placeholder until `commit_pending` (a step that preempts admits nothing, so it is not
admitted with one).

Invariants: every live sequence is in exactly one of `waiting` and `running`; waiting sequences hold
no blocks; `running` is sorted by arrival; scheduling is deterministic (every TP rank runs the same
scheduler over the same calls and must choose the same batch).
"""

from __future__ import annotations

import bisect
import operator
from collections import deque
from dataclasses import dataclass, field

from inference.config import SchedulerConfig
from inference.core import FinishReason, InvalidRequestError, SamplingParams
from inference.sched.block_manager import BlockManager
from inference.sched.scheduler_batch import Sampled, ScheduledBatch, StepResult
from inference.sched.scheduler_commit import StepCommit
from inference.sched.sequence import Sequence, SequenceStatus

__all__ = ["Sampled", "ScheduledBatch", "Scheduler", "StepResult"]


@dataclass
class _Plan:
    """The step being built, row by row in batch order. A row is never dropped again: preemption only
    takes sequences not planned yet."""

    budget: int
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_lookahead: list[int] = field(default_factory=list)
    sample: list[bool] = field(default_factory=list)
    preempted: bool = False
    num_ending: int = 0  # running sequences not scheduled: their pending token is their last
    _planned: set[int] | None = None  # seq ids of `seqs`, built at the first preemption of the step

    def add(self, seq: Sequence, num_tokens: int, lookahead: int = 0) -> None:
        assert 0 < num_tokens + lookahead <= self.budget
        assert self._planned is None or seq.seq_id not in self._planned, f"{seq} planned twice"
        self.seqs.append(seq)
        self.num_new_tokens.append(num_tokens)
        self.num_lookahead.append(lookahead)
        self.sample.append(seq.num_computed_tokens + num_tokens == len(seq.token_ids))
        if self._planned is not None:
            self._planned.add(seq.seq_id)
        self.budget -= num_tokens + lookahead

    def add_decodes(self, seqs: list[Sequence]) -> None:
        """Plain decode rows (one token each, the last one: they sample), the budget already charged."""
        self.seqs += seqs
        self.num_new_tokens += [1] * len(seqs)
        self.num_lookahead += [0] * len(seqs)
        self.sample += [True] * len(seqs)
        if self._planned is not None:
            self._planned.update(map(_SEQ_ID, seqs))

    def has(self, seq: Sequence) -> bool:
        if self._planned is None:
            self._planned = set(map(_SEQ_ID, self.seqs))
        return seq.seq_id in self._planned

    def batch(self) -> ScheduledBatch:
        return ScheduledBatch(self.seqs, self.num_new_tokens, self.num_lookahead, self.sample)


_SEQ_ID = operator.attrgetter("seq_id")


def _arrival(seq: Sequence) -> int:
    return seq.arrival


class Scheduler(StepCommit):
    """Owns the waiting queue and the running set; the block manager owns the blocks. Applying a
    step's results (commit, advance, commit_pending, the stop rules) is StepCommit's."""

    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        max_model_len: int,
        eos_token_ids: tuple[int, ...],
        num_speculative_tokens: int = 0,
    ) -> None:
        if config.max_num_seqs < 1:
            raise InvalidRequestError("scheduler.max_num_seqs", f"must be >= 1, got {config.max_num_seqs}")
        if config.max_num_batched_tokens < 1:
            raise InvalidRequestError(
                "scheduler.max_num_batched_tokens", f"must be >= 1, got {config.max_num_batched_tokens}")
        if max_model_len < 2:
            raise InvalidRequestError("max_model_len", f"must be >= 2, got {max_model_len}")
        if config.spec_max_batch < 0:
            raise InvalidRequestError("scheduler.spec_max_batch", f"must be >= 0 (0: no bound), got "
                                      f"{config.spec_max_batch}")
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        assert num_speculative_tokens >= 0
        self.num_speculative_tokens = num_speculative_tokens
        self.in_flight = 0  # steps `advance` accounted whose tokens commit_pending has not applied yet
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._requests: dict[str, list[Sequence]] = {}  # live sequences by request id
        self.preempted = 0  # sequences preempted for lack of blocks, since construction

    # ---- queue state ----------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- requests in ----------------------------------------------------------------------------
    def validate(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Raise InvalidRequestError unless such a sequence can run to completion alone in the cache.

        A completion of L tokens in all needs KV for L - 1 of them (the last one is never fed back).
        """
        if num_prompt_tokens < 1:
            raise InvalidRequestError("prompt", "must contain at least one token")
        if num_prompt_tokens >= self.max_model_len:
            raise InvalidRequestError(
                "prompt", f"has {num_prompt_tokens} tokens; max_model_len is {self.max_model_len}, "
                "which leaves no room for a completion")
        bm = self.block_manager
        capacity = bm.num_blocks * bm.block_size
        if not bm.can_ever_fit(num_prompt_tokens):
            raise InvalidRequestError(
                "prompt", f"has {num_prompt_tokens} tokens; the KV cache holds {capacity} tokens in all")
        final_len = min(num_prompt_tokens + params.max_tokens, self.max_model_len)
        if not bm.can_ever_fit(final_len - 1):
            raise InvalidRequestError(
                "sampling_params.max_tokens",
                f"{params.max_tokens} new tokens after a {num_prompt_tokens}-token prompt exceed the KV "
                f"cache ({capacity} tokens); at most {capacity + 1 - num_prompt_tokens} fit")

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (validated here too; the engine should validate before creating it)."""
        self.validate(seq.num_prompt_tokens, seq.params)
        assert seq.status is SequenceStatus.WAITING and not seq.block_table, f"{seq} is not new"
        self.waiting.append(seq)
        self._requests.setdefault(seq.request_id, []).append(seq)

    # ---- one step -------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        """Choose the next step's work and reserve its blocks. An empty batch means nothing can run."""
        plan = _Plan(self.config.max_num_batched_tokens)
        self._schedule_running(plan)
        if not plan.preempted:
            self._admit(plan)
        return plan.batch()

    # ---- requests out ---------------------------------------------------------------------------
    def finish(self, seq: Sequence, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        """Finish a live sequence from outside (a stop string found by the detokenizer, ...)."""
        assert not seq.is_finished, f"{seq} is already finished"
        self._finish(seq, reason, stop_reason)

    def abort(self, request_id: str) -> list[Sequence]:
        """Finish every live sequence of the request with ABORT; return them (empty if none)."""
        seqs = list(self._requests.get(request_id, ()))
        for seq in seqs:
            self._finish(seq, FinishReason.ABORT, None)
        return seqs

    def preempt_all(self) -> int:
        """Send every running sequence back to waiting (recompute), e.g. before the KV cache is dropped
        on sleep. Not counted in `preempted`. Returns how many were running."""
        count = len(self.running)
        while self.running:
            self._preempt(self.running[-1])
        return count

    # ---- internals ------------------------------------------------------------------------------
    def _schedule_running(self, plan: _Plan) -> None:
        """Schedule running decodes (remaining == 1) in arrival order, then running prefills
        (remaining > 1). A sequence whose pending token is its last is left out (async scheduling: it
        finishes at commit).

        The common decode row is planned inline: no lookahead, and the blocks it holds cover its new
        token, or a free block does (no preemption). Runs of such rows join the plan together; any
        other decode goes through _schedule_one, in order. One pass over `running` (a copy: preemption
        removes from it) sorts and plans, and stops once the budget is spent; num_ending is then
        short, but only admission reads it, and a step without budget admits nothing."""
        # never while a step is in flight: a speculative step needs every token known and runs
        # synchronously (LLM.step settles first when speculates_next says so)
        speculate = bool(self.num_speculative_tokens) and not self.in_flight and self._speculates(self._num_decodes())
        prefills: list[Sequence] = []
        run: list[Sequence] = []  # plain decode rows, not in the plan yet
        bm, max_len, running = self.block_manager, self.max_model_len, SequenceStatus.RUNNING
        budget, tokens_held = plan.budget, bm.block_size
        for seq in list(self.running):  # this loop runs for every row of every step: kept lean
            if seq.status is not running:  # preempted earlier in this step
                continue
            num_tokens, computed = len(seq.token_ids), seq.num_computed_tokens
            assert num_tokens > computed, f"{seq} has nothing to compute"
            if seq.num_pending and (num_tokens >= max_len  # _reaches_length, inlined
                                    or num_tokens - seq.num_prompt_tokens >= seq.params.max_tokens):
                plan.num_ending += 1
                continue
            if num_tokens - computed > 1:
                prefills.append(seq)
                continue
            if budget == 0:
                break
            if not speculate and (computed < len(seq.block_table) * tokens_held or bm.append_free_block(seq)):
                run.append(seq)
                budget -= 1
                continue
            plan.budget = budget
            plan.add_decodes(run)
            run = []
            self._schedule_one(plan, seq, True, speculate)
            budget = plan.budget
        plan.budget = budget
        plan.add_decodes(run)
        for seq in prefills:
            if plan.budget == 0:
                return
            if seq.status is running:
                self._schedule_one(plan, seq, False)

    def _num_decodes(self) -> int:
        """Running sequences that decode in the next step: one token left to compute, and not ending."""
        return sum(len(s.token_ids) - s.num_computed_tokens == 1 and not (s.num_pending and self._reaches_length(s))
                   for s in self.running)

    def speculates_next(self) -> bool:
        """Whether the next schedule() may give draft tokens (at most spec_max_batch running): an
        engine with a step in flight settles it first, so that step's tokens are known."""
        return self._speculates(len(self.running))

    def _speculates(self, num_decodes: int) -> bool:
        """Whether this step's decodes get draft tokens: a draft, and a batch small enough to gain."""
        bound = self.config.spec_max_batch
        return self.num_speculative_tokens > 0 and (bound == 0 or num_decodes <= bound)

    def _schedule_one(self, plan: _Plan, seq: Sequence, decodes: bool, speculate: bool = False) -> None:
        remaining = len(seq.token_ids) - seq.num_computed_tokens
        if decodes and speculate:
            n = self._reserve(seq, 1 + self._lookahead(seq, plan.budget - 1), plan)
            if n:
                plan.add(seq, 1, n - 1)
            return
        n = self._reserve(seq, min(remaining, plan.budget), plan)
        if n:
            plan.add(seq, n)

    def _lookahead(self, seq: Sequence, room: int) -> int:
        """Draft tokens worth proposing: the run (lookahead + 1 tokens) must fit max_tokens,
        max_model_len and the budget left."""
        left = min(seq.params.max_tokens - seq.num_generated, self.max_model_len - seq.num_tokens)
        return max(0, min(self.num_speculative_tokens, left - 1, room))

    def _reserve(self, seq: Sequence, want: int, plan: _Plan) -> int:
        """Get blocks for up to `want` new tokens of a running seq (fewer if that is all that fits),
        preempting latest arrivals while none fit. Returns 0 if seq itself was preempted."""
        if seq.num_computed_tokens + want <= len(seq.block_table) * self.block_manager.block_size:
            return want  # the blocks it holds suffice (the common decode step): nothing to allocate
        while True:
            fit = min(want, self.block_manager.num_appendable_tokens(seq))
            if fit > 0:
                self.block_manager.append(seq, fit)
                return fit
            victim = next(s for s in reversed(self.running) if not plan.has(s))
            self._preempt(victim)
            self.preempted += 1
            plan.preempted = True
            if victim is seq:
                return 0

    def _admit(self, plan: _Plan) -> None:
        """Admit waiting sequences FCFS; samples whose leader's prompt is not computed yet are skipped
        (they keep their place)."""
        bm = self.block_manager
        skipped: list[Sequence] = []
        while self.waiting and plan.budget > 0 and len(self.running) - plan.num_ending < self.config.max_num_seqs:
            seq = self.waiting[0]
            if self._waits_for_leader(seq):
                skipped.append(self.waiting.popleft())
                continue
            hit = bm.match_prefix(seq)
            hit_tokens = len(hit) * bm.block_size
            n = min(seq.num_tokens - hit_tokens, plan.budget)
            if not bm.can_allocate(hit, hit_tokens + n):
                break
            self.waiting.popleft()
            bm.allocate_prefix(seq, hit)
            bm.append(seq, n)
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=_arrival)
            plan.add(seq, n)
        self.waiting.extendleft(reversed(skipped))

    def _waits_for_leader(self, seq: Sequence) -> bool:
        leader = seq.leader
        if leader is None or leader.is_finished or not self.block_manager.enable_prefix_caching:
            return False
        if (leader.num_prompt_tokens - 1) // self.block_manager.block_size == 0:
            return False  # no full prompt block to share
        return leader.num_computed_tokens < leader.num_prompt_tokens

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def _finish(self, seq: Sequence, reason: FinishReason, stop_reason: int | str | None) -> None:
        if seq.num_pending:
            seq.drop_pending()  # its token is not read yet: the step's result for it is dropped
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        live = self._requests[seq.request_id]
        live.remove(seq)
        if not live:
            del self._requests[seq.request_id]
