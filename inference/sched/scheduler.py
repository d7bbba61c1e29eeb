"""Continuous batching: which sequences compute how many tokens in the next step, and what a computed
step changes. Pure Python; every TP rank runs the same scheduler over the same calls.

`schedule()` plans a ScheduledBatch (decodes, then prefills in progress, then admissions FCFS, under
a token budget and a sequence cap; preemption by recompute when blocks run out; a lookahead of draft
tokens per decode while speculation pays). `commit(batch, sampled)` applies a finished step: computed
tokens advance, full blocks register in the prefix cache, sampled tokens append and the stop rules
apply. With async scheduling `advance(batch)` accounts a launched step before its tokens are known
(each sampling row gets a placeholder token) and `commit_pending` fills the placeholders in.

Invariants: every live sequence is in exactly one of `waiting` and `running`; waiting sequences hold
no blocks; `running` is sorted by arrival; scheduling is deterministic (every rank must choose the
same batch). Stop rules, in order: an EOS id (unless ignore_eos), a stop token id (reported as
stop_reason), then length: max_tokens or max_model_len reached, a pending token counted.
"""

from __future__ import annotations

import bisect
import operator
from dataclasses import dataclass, field

from inference.config import SchedulerConfig
from inference.core import FinishReason, InvalidRequestError, SamplingParams
from inference.sched.block_manager import BlockManager
from inference.sched.sequence import Sequence, SequenceStatus
from inference.sched.wait_queue import WaitQueue

# (token id, logprob, top logprobs or None) for a sequence that sampled, None for one that did not
Sampled = tuple[int, float, dict[int, float] | None]
# a speculative row's accepted run: the accepted draft tokens then the target's own token
StepResult = Sampled | list[Sampled] | None


@dataclass
class ScheduledBatch:
    """One step, what the scheduler hands the runner: seqs[i] computes tokens [c, c + num_new_tokens[i])
    where c = its num_computed_tokens at schedule time. sample[i] is True when that chunk reaches the
    end of its tokens, i.e. the step produces its next token (computed at construction, before
    commit() advances the sequences, unless the scheduler passes it: it knows each row's chunk).
    num_lookahead[i] > 0 (a decode row only) asks for that many draft tokens verified in this step.
    Checked at construction: one entry per sequence in each list, every row computes at least one
    token, and a row with lookahead is a decode row (one new token)."""

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


class Scheduler:
    """Owns the waiting queue and the running set; the block manager owns the blocks.

    One step mixes decodes and prefill chunks under a token budget (max_num_batched_tokens) and a
    sequence cap (max_num_seqs), in this order:
    1. running decodes (1 token each), oldest arrival first;
    2. running prefills in progress (chunked prefill keeps priority over new admissions);
    3. waiting sequences, each with as much of its prompt as the budget leaves (the rest follows in
       later steps): FCFS inside a share (a call), round-robin between shares (WaitQueue), so one large
       call cannot hold a small one behind all its sequences. Admission stops at the first sequence
       that does not fit, so a large prompt is never starved by smaller ones behind it.

    When a running sequence cannot get a block, the latest-arrived running sequence not yet scheduled
    this step (possibly itself) is preempted by recompute: its blocks are freed, num_computed_tokens
    goes to 0 and it goes to the FRONT of the waiting queue, keeping its generated tokens and logprobs.
    A step that preempted admits nothing (it would only thrash). Samples 1..n-1 of a request wait until
    sample 0's prompt is computed, so they hit its full prompt blocks in the prefix cache (returning
    routing: until its prompt's routing is read back too, as they hit only blocks that kept theirs).

    Speculative decoding (num_speculative_tokens = k > 0): a running decode also gets a lookahead of up
    to k draft tokens (fewer near max_tokens, max_model_len, the token budget or the free blocks; none
    for a row with penalties; never a preemption for lookahead). Its blocks cover the k + 1 positions
    the target verifies; the budget is charged k + 1 tokens. Its result is a run of 1..k+1 tokens;
    tokens after a stop are dropped. A step whose running decodes outnumber
    SchedulerConfig.spec_max_batch schedules them without lookahead (the draft mirrors their tokens):
    the draft works on the tail of a rollout, where steps are bound by weight reads, not on a full
    batch. `draft_shares_kv` (the batch-invariant mode's SelfDraft): the draft writes the target's own
    cache, so every position the verify computed is final, and the draft needs no catch-up.

    Async scheduling: after `advance`, the next schedule() counts a pending token as if it were known,
    except that a sequence whose pending token is its last by length is not scheduled again, and
    admission does not count it against max_num_seqs. A sequence that finished on its pending token
    (EOS, a stop token) has one wasted row in the step launched meanwhile; its result is dropped. A
    preempted sequence keeps its placeholder until `commit_pending` (a step that preempts admits
    nothing, so it is not admitted with one).
    """

    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        max_model_len: int,
        eos_token_ids: tuple[int, ...],
        num_speculative_tokens: int = 0,
        draft_shares_kv: bool = False,
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
        # the draft writes the target's own cache (SelfDraft): a position the verify computed is final in it
        self.draft_shares_kv = draft_shares_kv
        self.in_flight = 0  # steps `advance` accounted whose tokens commit_pending has not applied yet
        self.waiting = WaitQueue()
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

    def on_weights_live(self, live_version: int) -> list[Sequence]:
        """A weight sync went live between two steps (none in flight): apply each live sequence's
        policy (Sequence.on_sync, max_staleness; core.SyncPolicy). "keep" leaves it as it is; "recompute"
        sends a running one back to waiting (its KV is recomputed by prefill, its tokens kept); "abort",
        or a sequence whose oldest token is more than max_staleness versions behind `live_version`,
        goes back to waiting and restarts from its prompt. Preempted sequences keep their arrival order
        at the front of the queue. Returns the restarted sequences. The caller drops the prefix cache.
        """
        assert not self.in_flight, "a sync goes live between steps only"
        restarted = [s for s in list(self.running) + list(self.waiting) if _restarts(s, live_version)]
        again = {s.seq_id for s in restarted}
        for seq in reversed(list(self.running)):  # latest first: appendleft keeps the order
            if seq.seq_id in again or seq.on_sync != "keep":
                self._preempt(seq)
        for seq in restarted:
            seq.restart()
        return restarted

    # ---- a computed step in --------------------------------------------------------------------
    def commit(self, batch: ScheduledBatch, sampled: list[StepResult]) -> list[Sequence]:
        """Apply a finished step: advance computed tokens, register full blocks in the prefix cache,
        append sampled tokens and apply the token-level stop rules. Return the sequences that finished.

        sampled[i] is given exactly when batch.sample[i]; it is a list (an accepted run) exactly when
        batch.num_lookahead[i] > 0. Sequences finished or aborted since schedule() are skipped (their
        blocks are already free).
        """
        assert len(sampled) == len(batch.seqs), (len(sampled), len(batch.seqs))
        assert [out is not None for out in sampled] == batch.sample, "sampled output given iff the row samples"
        finished: list[Sequence] = []
        eos, max_len, running = self.eos_token_ids, self.max_model_len, SequenceStatus.RUNNING
        for seq, n, k, out in zip(batch.seqs, batch.num_new_tokens, batch.num_lookahead, sampled):
            if seq.status is not running:
                continue
            if k:
                assert isinstance(out, list), f"{seq}: a speculative row returns its accepted run"
                if self._commit_run(seq, k, out):
                    finished.append(seq)
                continue
            self._account(seq, n)
            if out is None:
                continue
            assert not isinstance(out, list)
            token_id, logprob, top = out
            seq.append(token_id, logprob, top)
            if _may_stop(seq, token_id, eos, max_len) and self._stops(seq, token_id):
                finished.append(seq)
        return finished

    def _commit_run(self, seq: Sequence, lookahead: int, run: list[Sampled]) -> bool:
        """Apply a speculative row: 1 + (accepted draft tokens) tokens, cut at the first stop. Each
        appended token makes one more position's KV final. The draft wrote positions up to
        start + lookahead - 1, so a fully accepted run leaves one draft position for the next step
        to fill; only the prefix final in both caches is registered (a draft sharing the target's cache:
        every position the verify computed). Returns True if it finished."""
        start = seq.num_computed_tokens
        assert start + 1 == seq.num_tokens and 1 <= len(run) <= lookahead + 1, (seq, len(run), lookahead)
        seq.spec_proposed += lookahead
        seq.spec_accepted += len(run) - 1
        for token_id, logprob, top in run:
            seq.append(token_id, logprob, top)
            seq.num_computed_tokens += 1
            if self._stops(seq, token_id):
                return True
        seq.num_draft_computed = (seq.num_computed_tokens if self.draft_shares_kv
                                  else min(seq.num_computed_tokens, start + lookahead))
        self.block_manager.commit(seq, seq.num_draft_computed)
        return False

    def advance(self, batch: ScheduledBatch) -> None:
        """Account a launched step whose tokens are not read yet (async scheduling): computed tokens
        advance, newly full blocks register, and the row that samples r-th gets placeholder(r).

        Call it after the previous step's commit_pending (so every token its chunks cover is known)
        and before the next schedule(). Rows of sequences finished since schedule() are skipped."""
        assert not any(batch.num_lookahead), "speculative steps commit synchronously"
        self.in_flight += 1
        row = -1  # the current row's index among the batch's sampled rows (finished ones count too)
        running = SequenceStatus.RUNNING
        bm, draft = self.block_manager, bool(self.num_speculative_tokens)
        block_size, caching = bm.block_size, bm.enable_prefix_caching
        # the loops below run for every row of every step: _account and the Sequence methods that
        # keep a placeholder are inlined (change both together)
        for seq, n, do_sample in zip(batch.seqs, batch.num_new_tokens, batch.sample):
            row += do_sample
            if seq.status is not running:
                continue
            computed = seq.num_computed_tokens = seq.num_computed_tokens + n
            assert computed <= len(seq.token_ids), f"{seq} computed past its tokens"
            if draft:
                seq.num_draft_computed = computed
            if caching and len(seq.cache_keys) < computed // block_size:
                bm.commit(seq)
            if do_sample:  # Sequence.add_pending, inlined: placeholder(row) stands for the token
                assert not seq.num_pending, f"{seq} already has a pending token"
                seq.token_ids.append(-1 - row)
                seq.logprobs.append(0.0)
                if seq.top_logprobs is not None:
                    seq.top_logprobs.append({})
                seq.num_pending = 1

    def commit_pending(self, batch: ScheduledBatch, sampled: list[StepResult]) -> list[Sequence]:
        """Apply the tokens of a step `advance` accounted: each placeholder becomes its token, then the
        token-level stop rules. Return the sequences that finished. A preempted sequence takes its
        token too (it was sampled before the preemption); a finished one's is dropped."""
        assert len(sampled) == len(batch.seqs), (len(sampled), len(batch.seqs))
        assert [out is not None for out in sampled] == batch.sample, "sampled output given iff the row samples"
        self.in_flight -= 1
        finished: list[Sequence] = []
        eos, max_len, finished_status = self.eos_token_ids, self.max_model_len, SequenceStatus.FINISHED
        for seq, out in zip(batch.seqs, sampled):
            if out is None or seq.status is finished_status:
                continue
            token_id, logprob, top = out  # (int, float, dict or None): ModelRunner._to_host's types
            assert seq.num_pending, f"{seq} has no pending token"
            seq.token_ids[-1] = token_id  # Sequence.resolve_pending, inlined
            seq.logprobs[-1] = logprob
            if top is not None:
                seq.top_logprobs[-1] = top  # type: ignore[index]
            seq.num_pending = 0
            if _may_stop(seq, token_id, eos, max_len) and self._stops(seq, token_id):
                finished.append(seq)
        return finished

    def _account(self, seq: Sequence, n: int) -> None:
        """A chunk of n tokens was computed: they count as computed (mirrored by the draft, which
        follows every non-speculative step), and a newly full block registers in the prefix cache."""
        seq.num_computed_tokens += n
        assert seq.num_computed_tokens <= len(seq.token_ids), f"{seq} computed past its tokens"
        if self.num_speculative_tokens:
            seq.num_draft_computed = seq.num_computed_tokens
        if len(seq.cache_keys) < seq.num_computed_tokens // self.block_manager.block_size:
            self.block_manager.commit(seq)

    def _stops(self, seq: Sequence, token_id: int) -> bool:
        """Apply the stop rules to seq's newest token `token_id`; finish it (and say so) if one holds."""
        reason, stop_reason = self._stop_rule(seq, token_id)
        if reason is None:
            return False
        self._finish(seq, reason, stop_reason)
        return True

    def _stop_rule(self, seq: Sequence, token_id: int) -> tuple[FinishReason | None, int | None]:
        """Why seq stops at its newest token `token_id`, if it does. The commit loops screen every row
        with a cheap superset of these rules first (an EOS id even under ignore_eos, any stop token
        ids, the length bounds) and call _stops only for the rows it lets through: change both."""
        params = seq.params
        if token_id in self.eos_token_ids and not params.ignore_eos:
            return FinishReason.STOP, None
        if params.stop_token_ids and token_id in params.stop_id_set:
            return FinishReason.STOP, token_id
        if self._reaches_length(seq):
            return FinishReason.LENGTH, None
        return None, None

    def _reaches_length(self, seq: Sequence) -> bool:
        """Its tokens (a pending one counted) reach max_tokens or max_model_len: no token follows."""
        num_tokens = len(seq.token_ids)
        return num_tokens - seq.num_prompt_tokens >= seq.params.max_tokens or num_tokens >= self.max_model_len

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
        max_model_len and the budget left. A row with penalties decodes one token a step (its logits
        change with every token it takes, which the verify rows do not model), the draft following it."""
        if seq.params.has_penalties:
            return 0
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
            victim.preemptions += 1
            plan.preempted = True
            if victim is seq:
                return 0

    def _admit(self, plan: _Plan) -> None:
        """Admit waiting sequences in the WaitQueue's order; samples whose leader's prompt is not computed
        yet are skipped (they keep their place)."""
        bm = self.block_manager
        while self.waiting and plan.budget > 0 and len(self.running) - plan.num_ending < self.config.max_num_seqs:
            seq = self.waiting.peek()
            if self._waits_for_leader(seq):
                self.waiting.skip()
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
        self.waiting.end_pass()

    def _waits_for_leader(self, seq: Sequence) -> bool:
        leader = seq.leader
        if leader is None or leader.is_finished or not self.block_manager.enable_prefix_caching:
            return False
        if (leader.num_prompt_tokens - 1) // self.block_manager.block_size == 0:
            return False  # no full prompt block to share
        if seq.routing is not None and leader.routing is not None and leader.routing.fresh < leader.num_prompt_tokens:
            return True  # its blocks are hit only with their routing, which reaches the host after the step
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


def _restarts(seq: Sequence, live_version: int) -> bool:
    """Whether a sync to `live_version` sends seq back to its prompt: its mode says so, or its oldest
    token is too stale. One without a token has nothing to drop ("abort" then recomputes its KV)."""
    if not seq.num_generated:
        return False
    if seq.on_sync == "abort":
        return True
    oldest, bound = seq.oldest_version, seq.max_staleness
    return oldest is not None and bound is not None and live_version - oldest > bound


def _may_stop(seq: Sequence, token_id: int, eos: frozenset[int], max_len: int) -> bool:
    """The cheap screen before _stops (which applies the stop rules in full): False only for a token that
    no rule can stop on, so the common row of a commit costs no more than this."""
    num_tokens, params = len(seq.token_ids), seq.params
    return (token_id in eos or token_id in params.stop_id_set or num_tokens - seq.num_prompt_tokens >= params.max_tokens
            or num_tokens >= max_len)
