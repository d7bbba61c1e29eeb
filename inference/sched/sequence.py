"""One sampled completion in flight: its tokens, its KV blocks and where it stands.

Pure Python (no torch): the scheduler, the block manager and their CPU tests use it.

Invariants the scheduler and the block manager keep:
- token_ids is the prompt followed by the generated tokens; it only grows while the sequence lives.
- num_computed_tokens <= num_tokens, and the KV of tokens [0, num_computed_tokens) is in the blocks
  of block_table (len(block_table) * block_size >= num_computed_tokens).
- A WAITING sequence holds no blocks and has num_computed_tokens == 0; a preempted one keeps its
  generated tokens and logprobs and recomputes their KV when it is admitted again.
- token_ids shrinks only at `restart` (a waiting sequence back to its prompt: a weight sync dropped
  its tokens) and `truncate` (a finished one); both clear the block_hashes memo.
- With async scheduling the last entry of token_ids (and of logprobs) may be a placeholder for a
  token that a launched step samples on the device and the host has not read yet (num_pending == 1):
  placeholder(row) = -1 - row, row being the token's row among that step's sampled rows, so the
  runner can fetch it on the device. It is never computed KV (no block hash covers it), it is
  replaced in place when the step is committed, and dropped if the sequence finishes first.
"""

from __future__ import annotations

import enum
import itertools

import xxhash

from inference.core import INT64_MAX, FinishReason, SamplingParams
from inference.sched.routing_rows import RoutingRows

# One counter for ids and arrival order: creation order is FCFS order, and every TP rank that creates
# the same requests in the same order gets the same ids (the SPMD engine relies on that).
_next_id = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


def placeholder(row: int) -> int:
    """The token id standing for the token sampled in row `row` of the step in flight (always < 0)."""
    assert row >= 0, row
    return -1 - row


def placeholder_row(token_id: int) -> int:
    """The sampled row a placeholder stands for (the inverse of `placeholder`)."""
    assert token_id < 0, token_id
    return -1 - token_id


def derive_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a request seeded with `seed`: stable across processes and runs.

    Python's hash() is salted per process, so xxh3 over a text encoding (any int size) is used instead.
    The result fits a signed 64-bit integer (what torch.Generator.manual_seed accepts).
    """
    return xxhash.xxh3_64_intdigest(f"{seed}:{index}".encode()) & INT64_MAX


class Sequence:
    """One sample of one request. Sample i > 0 of n > 1 should have `leader` = sample 0 (set it at
    construction or right after, before the scheduler sees it; group() does it).

    Fields owned by the block manager: block_table, num_computed_tokens (reset on free),
    block_hashes (chained content hashes of the full blocks of token_ids, a memo that stays valid
    because token_ids only grows) and cache_keys (the prefix-cache entries its committed full blocks
    match, cleared on free).
    """

    def __init__(
        self,
        request_id: str,
        index: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        leader: Sequence | None = None,
    ) -> None:
        assert prompt_token_ids, "a sequence needs at least one prompt token"
        assert leader is None or index > 0, "sample 0 has no leader"
        self.seq_id = next(_next_id)
        self.arrival = self.seq_id
        self.request_id = request_id
        self.share = request_id  # the unit of fair admission (inference/sched/wait_queue.py): a call's id
        self.index = index
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.params = params
        self.seed: int | None = None if params.seed is None else derive_seed(params.seed, index)
        self.leader = leader
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        # speculative decoding: the draft's KV is valid for tokens [0, num_draft_computed) (<= computed)
        self.num_draft_computed = 0
        self.spec_proposed = 0  # draft tokens proposed for this sequence
        self.spec_accepted = 0  # of which the target accepted
        self.preemptions = 0  # times the scheduler preempted it for KV blocks (recomputed later)
        self.block_hashes: list[int] = []
        self.cache_keys: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[dict[int, float]] | None = [] if params.logprobs > 0 else None
        self.num_pending = 0  # 1 while the last token is a placeholder (see the module docstring)
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None
        # (index of the first completion token, weight version) for each run of tokens of one version;
        # span_version repeats the last run's version (None before the first) so that the engine's
        # per-step check reads the sequence alone: start_span keeps the two together
        self.version_spans: list[tuple[int, int]] = []
        self.span_version: int | None = None
        self.draft_version_spans: list[tuple[int, int]] = []  # the same for the draft model's version
        self.draft_span_version: int | None = None
        # what a weight sync does to it (core.SyncPolicy, resolved against the engine's default)
        self.on_sync = "recompute"
        self.max_staleness: int | None = None
        self.restarts = 0  # times a sync sent it back to its prompt
        # the experts chosen for its tokens, by position (params.return_routing; the engine sets it, as it
        # knows the model's row size): inference/sched/routing_rows.py
        self.routing: RoutingRows | None = None

    @classmethod
    def group(cls, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> list[Sequence]:
        """The params.n samples of one request, sample 0 first; the others lead back to it. Each runs with
        its own max_tokens when the params give one per sample."""
        first = cls(request_id, 0, prompt_token_ids, params.for_sample(0))
        return [first] + [cls(request_id, i, prompt_token_ids, params.for_sample(i), first)
                          for i in range(1, params.n)]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append(self, token_id: int, logprob: float, top_logprobs: dict[int, float] | None = None) -> None:
        """Add one sampled token. top_logprobs is given exactly when params.logprobs > 0."""
        assert not self.is_finished, f"sequence {self.seq_id} is finished"
        assert (top_logprobs is not None) == (self.top_logprobs is not None), (
            f"top_logprobs must be given iff params.logprobs > 0 (got {top_logprobs!r})")
        self.token_ids.append(int(token_id))
        self.logprobs.append(float(logprob))
        if self.top_logprobs is not None:
            assert top_logprobs is not None
            self.top_logprobs.append(top_logprobs)

    def add_pending(self, row: int) -> None:
        """Stand in for the token that row `row` of the step just launched samples (async scheduling):
        lengths, output positions and block reservations count it from now on. (Scheduler.advance
        inlines this for its rows: change both.)"""
        assert not self.num_pending and row >= 0, (self, row)
        self.token_ids.append(-1 - row)  # placeholder(row), inlined: this runs for every row of a step
        self.logprobs.append(0.0)
        if self.top_logprobs is not None:
            self.top_logprobs.append({})
        self.num_pending = 1

    def resolve_pending(self, token_id: int, logprob: float, top_logprobs: dict[int, float] | None = None) -> None:
        """Replace the placeholder with the sampled token, in place: the same result as `append`
        without one. (Scheduler.commit_pending inlines this for its rows: change both.)"""
        assert self.num_pending and (top_logprobs is not None) == (self.top_logprobs is not None), (
            f"{self}: no pending token, or top_logprobs given iff params.logprobs > 0 broken")
        self.token_ids[-1] = int(token_id)
        self.logprobs[-1] = float(logprob)
        if top_logprobs is not None:
            self.top_logprobs[-1] = top_logprobs  # type: ignore[index]
        self.num_pending = 0

    def drop_pending(self) -> None:
        """Forget the placeholder (the sequence finished or was aborted before its token was read)."""
        assert self.num_pending and self.token_ids[-1] < 0, f"{self} has no pending token"
        self.token_ids.pop()
        self.logprobs.pop()
        if self.top_logprobs is not None:
            self.top_logprobs.pop()
        self.num_pending = 0

    def start_span(self, index: int, version: int) -> None:
        """Completion tokens from `index` on were sampled with weights of `version`."""
        self.version_spans.append((index, version))
        self.span_version = version

    def start_draft_span(self, index: int, version: int) -> None:
        """Completion tokens from `index` on were committed while the draft held `version`."""
        self.draft_version_spans.append((index, version))
        self.draft_span_version = version

    @property
    def oldest_version(self) -> int | None:
        """The target version of its oldest generated token (None: no token yet). Versions only grow."""
        return self.version_spans[0][1] if self.version_spans else None

    def restart(self) -> None:
        """Back to the prompt: generated tokens, logprobs and version spans dropped (a weight sync made
        them unwanted). Only a WAITING sequence (no blocks) restarts; its place in line is kept."""
        assert self.status is SequenceStatus.WAITING and not self.block_table and not self.num_pending, self
        del self.token_ids[self.num_prompt_tokens:]
        self.logprobs.clear()
        if self.top_logprobs is not None:
            self.top_logprobs.clear()
        self.version_spans, self.span_version = [], None
        self.draft_version_spans, self.draft_span_version = [], None
        self.block_hashes.clear()  # a memo of the dropped tokens too; rebuilt on demand
        if self.routing is not None:
            self.routing.clear()
        self.restarts += 1

    def truncate(self, num_tokens: int) -> None:
        """Drop tokens beyond `num_tokens` of a FINISHED sequence (a stop string inside a multi-token
        speculative run). Live sequences never shrink: block_hashes assumes token_ids only grows."""
        assert self.is_finished and not self.block_table, f"{self} must be finished to truncate"
        assert self.num_prompt_tokens <= num_tokens <= self.num_tokens, (num_tokens, self)
        del self.token_ids[num_tokens:]
        del self.logprobs[num_tokens - self.num_prompt_tokens:]
        if self.top_logprobs is not None:
            del self.top_logprobs[num_tokens - self.num_prompt_tokens:]
        self.block_hashes.clear()  # a memo of the old tokens; a finished sequence needs none

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, request={self.request_id!r}, index={self.index}, "
                f"status={self.status.name}, tokens={self.num_tokens}, computed={self.num_computed_tokens})")
