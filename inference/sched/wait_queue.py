"""The scheduler's waiting queue: fair admission between shares (one share per call), FCFS inside each.

Why: admitting sequences strictly in arrival order let one large call (n = 1024, or 16 of them) hold a
small call behind every one of its sequences for minutes. Here every share (the sidecar passes one per
HTTP call; the engine's default is one per request) gets its turn: a sequence's tag is one past the
later of its share's last tag and the tag of the last sequence admitted (start-time fair queueing), and
admission takes the lowest tag, ties by arrival. So shares that wait are admitted round-robin, a new
share starts at once instead of behind the backlog, and a share alone (one RL batch) is admitted in
arrival order, at the same pace as before: fairness decides only the order, never leaves a slot empty.

Sequences that were running (preempted, or sent back by a weight sync) go to the front, in the order
given, ahead of every share: they had their turn. A sequence the scheduler skips in a pass (a sample
waiting for its leader's prompt) keeps its place and tag. Deterministic: every TP
rank builds the same queue from the same calls.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator

from inference.sched.sequence import Sequence


class WaitQueue:
    """`append` a new sequence, `appendleft` one that goes first, `peek`/`popleft` the
    next to admit, `skip` it for this pass (`end_pass` puts the skipped back), `remove` a finished one.
    Iteration yields the admission order."""

    def __init__(self) -> None:
        self._front: deque[Sequence] = deque()
        self._shares: dict[str, deque[Sequence]] = {}
        self._heads: list[tuple[int, int, str]] = []  # (tag, arrival, share) of each share's head; stale ok
        self._tags: dict[int, int] = {}  # seq_id -> tag, for the sequences in `_shares`
        self._vtime = 0  # the tag of the last sequence admitted from a share
        self._skipped: list[tuple[str | None, Sequence]] = []  # set aside in this pass (share None: front)
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def __iter__(self) -> Iterator[Sequence]:
        yield from self._front
        queued = [s for q in self._shares.values() for s in q]
        yield from sorted(queued, key=lambda s: (self._tags[s.seq_id], s.arrival))

    def append(self, seq: Sequence) -> None:
        share = seq.share
        q = self._shares.get(share)
        last = self._tags[q[-1].seq_id] if q else 0
        tag = max(self._vtime, last) + 1
        self._tags[seq.seq_id] = tag
        if q is None:
            q = self._shares[share] = deque()
        q.append(seq)
        if len(q) == 1:
            heapq.heappush(self._heads, (tag, seq.arrival, share))
        self._size += 1

    def appendleft(self, seq: Sequence) -> None:
        self._front.appendleft(seq)
        self._size += 1

    def peek(self) -> Sequence:
        if self._front:
            return self._front[0]
        return self._shares[self._head_share()][0]

    def popleft(self) -> Sequence:
        if self._front:
            self._size -= 1
            return self._front.popleft()
        share = self._head_share()
        q = self._shares[share]
        seq = q.popleft()
        self._vtime = self._tags.pop(seq.seq_id)
        self._after_head_change(share, q)
        self._size -= 1
        return seq

    def skip(self) -> None:
        """Set the next sequence aside for this admission pass (a sample waiting for its leader): it keeps
        its place and tag, and `end_pass` puts it back."""
        if self._front:
            self._skipped.append((None, self._front.popleft()))
        else:
            share = self._head_share()
            q = self._shares[share]
            seq = q.popleft()
            self._skipped.append((share, seq))
            self._after_head_change(share, q)
        self._size -= 1

    def end_pass(self) -> None:
        """Put the skipped sequences back where they were, in order."""
        for share, seq in reversed(self._skipped):
            if share is None:
                self._front.appendleft(seq)
            else:
                q = self._shares.setdefault(share, deque())
                q.appendleft(seq)
                heapq.heappush(self._heads, (self._tags[seq.seq_id], seq.arrival, share))
            self._size += 1
        self._skipped.clear()

    def remove(self, seq: Sequence) -> None:
        if seq.seq_id not in self._tags:
            self._front.remove(seq)
        else:
            q = self._shares[seq.share]
            was_head = q[0] is seq
            q.remove(seq)
            del self._tags[seq.seq_id]
            if was_head:
                self._after_head_change(seq.share, q)
        self._size -= 1

    def _after_head_change(self, share: str, q: deque[Sequence]) -> None:
        if q:
            head = q[0]
            heapq.heappush(self._heads, (self._tags[head.seq_id], head.arrival, share))
        else:
            del self._shares[share]

    def _head_share(self) -> str:
        """The share whose head has the lowest (tag, arrival), dropping stale heap entries."""
        while True:
            tag, arrival, share = self._heads[0]
            q = self._shares.get(share)
            if q and q[0].arrival == arrival and self._tags[q[0].seq_id] == tag:
                return share
            heapq.heappop(self._heads)
