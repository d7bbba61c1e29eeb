"""Applying a step's results to the sequences: the scheduler's bookkeeping half. Pure Python.

`StepCommit` is a base class of Scheduler (scheduler.py), which owns the state these methods read
(the block manager, max_model_len, the EOS ids, the speculation depth, the in-flight count) and the
one way a sequence leaves its queues (`_finish`). The split keeps the policy (who runs next) apart
from the accounting (what a computed step changes); this file never imports scheduler.py (no cycle).

`commit(batch, sampled)` applies a finished step: computed tokens advance, full blocks register in
the prefix cache, sampled tokens append and the stop rules apply. A speculative row's result is a
run of 1..k+1 tokens; tokens after a stop are dropped.

Async scheduling (the engine overlaps a step's host work with the previous step on the device):
`advance(batch)` accounts a launched step before its tokens are known (computed tokens advance, full
blocks register: stream order puts every reader of their KV after the step that writes it) and gives
each row that samples a placeholder token (sequence.py). `commit_pending(batch, sampled)` replaces
the placeholders with the sampled tokens and applies the stop rules. A sequence that finished on its
pending token (EOS, a stop token) has one wasted row in the step launched meanwhile; its result is
dropped. A preempted sequence keeps its placeholder until that commit.

Stop rules, in order: an EOS id (unless ignore_eos), a stop token id (reported as stop_reason), then
length: max_tokens or max_model_len reached, a pending token counted.
"""

from __future__ import annotations

from inference.core import FinishReason
from inference.sched.block_manager import BlockManager
from inference.sched.scheduler_batch import Sampled, ScheduledBatch, StepResult
from inference.sched.sequence import Sequence, SequenceStatus


class StepCommit:
    """Turns a step's sampled tokens into sequence state; Scheduler sets these attributes."""

    block_manager: BlockManager
    max_model_len: int
    eos_token_ids: frozenset[int]
    num_speculative_tokens: int
    in_flight: int  # steps `advance` accounted whose tokens commit_pending has not applied yet

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
        to fill; only the prefix final in both caches is registered. Returns True if it finished."""
        start = seq.num_computed_tokens
        assert start + 1 == seq.num_tokens and 1 <= len(run) <= lookahead + 1, (seq, len(run), lookahead)
        seq.spec_proposed += lookahead
        seq.spec_accepted += len(run) - 1
        for token_id, logprob, top in run:
            seq.append(token_id, logprob, top)
            seq.num_computed_tokens += 1
            if self._stops(seq, token_id):
                return True
        seq.num_draft_computed = min(seq.num_computed_tokens, start + lookahead)
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
        if params.stop_token_ids and token_id in params.stop_token_ids:
            return FinishReason.STOP, token_id
        if self._reaches_length(seq):
            return FinishReason.LENGTH, None
        return None, None

    def _reaches_length(self, seq: Sequence) -> bool:
        """Its tokens (a pending one counted) reach max_tokens or max_model_len: no token follows."""
        num_tokens = len(seq.token_ids)
        return num_tokens - seq.num_prompt_tokens >= seq.params.max_tokens or num_tokens >= self.max_model_len

    def _finish(self, seq: Sequence, reason: FinishReason, stop_reason: int | str | None) -> None:
        """Take seq out of its queue and free its blocks: Scheduler's, as it owns the queues."""
        raise NotImplementedError


def _may_stop(seq: Sequence, token_id: int, eos: frozenset[int], max_len: int) -> bool:
    """The cheap screen before _stops (which applies the stop rules in full): False only for a token that
    no rule can stop on, so the common row of a commit costs no more than this."""
    num_tokens, params = len(seq.token_ids), seq.params
    return (token_id in eos or bool(params.stop_token_ids) or num_tokens - seq.num_prompt_tokens >= params.max_tokens
            or num_tokens >= max_len)
