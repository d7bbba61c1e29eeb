"""The many-tensor hashing pipeline: in-place host hashing, and device streaming through staging buffers
(checksum/staging_buffers.py).

Work items are the digest rule's work spans (checksum/definition.py, `Algorithm`): for the default
rule a tensor of n bytes is ceil(n / 64 MiB) segments, each hashed by one thread with its own
streaming hasher, so many threads share one embedding (DEVICE_ALGORITHM's host items are 64 MiB runs
of its 64 KiB segments). A tensor's digest is combined from its items' digests when its last one
finishes. The code below says "segment" for a work item.
Small tensors (one segment, at most half a chunk) are packed, in input order, into "packs" of at
most one chunk: a pack is one work item, staged with one gather and one copy, and its tensors are
hashed back to back from the one buffer, so hundreds of norms and biases cost a handful of items.

Invariant: a chunk lies inside one segment (chunks are cut from each segment's start) and a pack's
tensors are hashed from their own byte ranges, so neither the chunk size, the packing nor the thread
count changes a digest. The roles and the buffer rules of one run: `_Run`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import cast

import torch

from checksum.definition import ALGORITHM, ALGORITHMS, Algorithm
from checksum.staging_buffers import Staging
from checksum.tensor_bytes import flat_bytes, host_view

MAX_AHEAD = 4  # per segment: one chunk being hashed, up to three arriving


@dataclass(eq=False)
class Job:
    """One tensor to digest. `index` is its position in the caller's input; `digest` the result.

    The fields after `digest` belong to the run that digests the job.
    """

    index: int
    tensor: torch.Tensor
    nbytes: int
    staged: bool
    digest: str | None = None
    # Contiguous uint8 bytes, made once by whoever first needs them and dropped when the last
    # segment is hashed (for a strided tensor that is a full copy, so it must not outlive the job).
    flat: torch.Tensor | None = None
    flat_lock: threading.Lock = field(default_factory=threading.Lock)  # in-place: hashers race to make `flat`
    segment_digests: list[bytes | None] = field(default_factory=list)
    segments_left: int = 0


@dataclass(eq=False)
class _Segment:
    """One work item: bytes [start, end) of `job`. `issued` is the next byte whose copy is not issued."""

    job: Job
    number: int
    start: int
    end: int
    lane: threading.Condition  # shares the run's lock; notified when `ready` grows or the run fails
    issued: int = 0
    outstanding: int = 0  # chunks issued and not yet hashed
    ready: deque[tuple[int, int]] = field(default_factory=deque)  # (buffer, size), copy issued
    # A pack: whole one-segment jobs (job is parts[0]) laid out back to back in [0, end); staged
    # packs are gathered into `gathered` by the copier, dropped once hashed.
    parts: tuple[Job, ...] = ()
    gathered: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.issued = self.start


def run_jobs(
    jobs: list[Job],
    staging: tuple[Staging, torch.device | None] | None,
    pool: concurrent.futures.ThreadPoolExecutor,
    threads: int,
    chunk_bytes: int,
    max_queued: int,
    algorithm: Algorithm = ALGORITHMS[ALGORITHM],
) -> None:
    """Digest every job (all staged on one device, or all hashed in place) by `algorithm`'s rule;
    sets `job.digest`.

    Staged chunks hold at most `chunk_bytes` (the staging buffers' size) and never cross a segment
    boundary. Returns after every hasher has stopped; re-raises the first error of any thread.
    """
    assert jobs and all(j.nbytes > 0 and j.staged == (staging is not None) for j in jobs)
    assert chunk_bytes >= 1 and max_queued >= 1
    run = _Run(jobs, staging[0] if staging else None, chunk_bytes, max_queued, algorithm)
    # The session outlives the hashers: they still wait on copies after the last one is issued.
    with staging[0].session(staging[1]) if staging is not None else contextlib.nullcontext():
        futures = [pool.submit(run.hasher) for _ in range(min(threads, len(run.pending)))]
        try:
            if staging is not None:
                run.copy_all()
        except BaseException as exc:
            run.fail(exc)
            raise
        finally:
            concurrent.futures.wait(futures)
    if run.error is not None:
        raise run.error


class _Run:
    """Shared state of one run; every field below `lock` is guarded by it.

    Pool threads ("hashers") claim segments, largest tensors first (a tensor's segments in order), and
    hash one at a time: host segments in place, a staged segment's chunks from its lane (a FIFO) in byte
    order. The calling thread is the copier: it picks the next chunk, takes a free buffer, issues the copy
    (on CUDA: on a dedicated copy stream, then records the buffer's event) and only then appends
    (buffer, size) to the segment's lane. Invariants:
    - a hasher reads a buffer only after waiting on that buffer's copy (its event);
    - a buffer goes back to the free list only after its hash finished, so it is never refilled early;
    - at most `max_queued` copies are outstanding on the copy stream, so who gets the next buffer is
      decided late: the claimed segment with the most bytes left to issue, so claimed segments progress
      together and none is starved by the many small tensors around it;
    - at most MAX_AHEAD chunks per segment are issued and not yet hashed, so no segment hoards buffers.
    """

    def __init__(self, jobs: list[Job], staging: Staging | None, chunk_bytes: int, max_queued: int,
                 algorithm: Algorithm) -> None:
        self.staging = staging
        self.algorithm = algorithm
        self.chunk_bytes = chunk_bytes
        self.max_queued = max_queued
        self.lock = threading.Lock()
        self.copier_cv = threading.Condition(self.lock)
        # Largest items first: big tensors' segments are most of the work; packs fill the tail.
        units: list[tuple[int, list[_Segment]]] = []
        singles, packs = _pack(jobs, chunk_bytes, algorithm)
        for job in singles:
            spans = algorithm.work_spans(job.nbytes)
            job.segment_digests, job.segments_left, job.flat = [None] * len(spans), len(spans), None
            units.append((job.nbytes, [_Segment(job, k, start, end, threading.Condition(self.lock))
                                       for k, (start, end) in enumerate(spans)]))
        for parts in packs:
            for job in parts:
                job.segment_digests, job.segments_left, job.flat = [None], 1, None
            size = sum(j.nbytes for j in parts)
            units.append((size, [_Segment(parts[0], 0, 0, size, threading.Condition(self.lock), parts=parts)]))
        self.pending: deque[_Segment] = deque()
        for _, segments in sorted(units, key=lambda u: -u[0]):
            self.pending.extend(segments)
        self.all_segments = tuple(self.pending)
        self.active: list[_Segment] = []  # claimed staged segments not yet fully hashed
        self.free = list(range(staging.num_buffers)) if staging is not None else []
        self.error: BaseException | None = None

    def fail(self, exc: BaseException) -> None:
        """Record the first error and wake everyone so they stop."""
        with self.lock:
            if self.error is None:
                self.error = exc
            self.copier_cv.notify_all()
            for segment in self.all_segments:
                segment.lane.notify_all()

    # -- hashers (pool threads) --------------------------------------------------------------

    def hasher(self) -> None:
        try:
            while (segment := self._claim()) is not None:
                if segment.parts:
                    digests = self._hash_pack(segment)
                    if digests is None:
                        return
                    for job, digest in zip(segment.parts, digests):
                        self._finish(_Segment(job, 0, 0, job.nbytes, segment.lane), digest)
                    continue
                digest = self._hash_staged(segment) if segment.job.staged else self._hash_in_place(segment)
                if digest is None:  # the run failed elsewhere
                    return
                self._finish(segment, digest)
        except BaseException as exc:
            self.fail(exc)

    def _hash_pack(self, segment: _Segment) -> list[bytes] | None:
        """Each part's digest: from its byte range of the one staged chunk, or from the tensor in place."""
        if not segment.job.staged:
            if self.error is not None:
                return None
            return [_hash_host(self.algorithm, flat_bytes(job.tensor)) for job in segment.parts]
        assert self.staging is not None
        ready = self._next_ready(segment)
        if ready is None:
            return None
        buf, size = ready
        assert size == segment.end, "a pack is staged as one chunk"
        self.staging.wait(buf)
        view = self.staging.view(buf, size)
        digests, offset = [], 0
        for job in segment.parts:
            digests.append(_hash_view(self.algorithm, view[offset:offset + job.nbytes]))
            offset += job.nbytes
        with self.lock:
            self.free.append(buf)
            segment.outstanding -= 1
            segment.gathered = None  # its copy landed and every part is hashed
            self.active.remove(segment)
            self.copier_cv.notify()
        return digests

    def _next_ready(self, segment: _Segment) -> tuple | None:
        """The segment's next staged (buffer, size), waiting for the copier; None once a run failed."""
        with self.lock:
            while not segment.ready and self.error is None:
                segment.lane.wait()
            if self.error is not None:
                return None
            return segment.ready.popleft()

    def _claim(self) -> _Segment | None:
        with self.lock:
            if self.error is not None or not self.pending:
                return None
            segment = self.pending.popleft()
            if segment.job.staged:
                self.active.append(segment)
                self.copier_cv.notify()
            return segment

    def _finish(self, segment: _Segment, digest: bytes) -> None:
        """Store a segment's digest; the thread that stores a job's last one combines them."""
        job = segment.job
        with self.lock:
            assert job.segment_digests[segment.number] is None, "segment hashed twice"
            job.segment_digests[segment.number] = digest
            job.segments_left -= 1
            last = job.segments_left == 0
            if last:
                job.flat = None  # every copy from it has landed and every segment is hashed
        if last:
            assert all(d is not None for d in job.segment_digests)
            job.digest = self.algorithm.combine(cast(list[bytes], job.segment_digests), job.nbytes)

    def _hash_in_place(self, segment: _Segment) -> bytes | None:
        if self.error is not None:  # a racy read is fine: it only stops a doomed run sooner
            return None
        job = segment.job
        with job.flat_lock:  # one contiguous copy per strided tensor, whichever segment comes first
            if job.flat is None:
                job.flat = flat_bytes(job.tensor)
            flat = job.flat
        return _hash_view(self.algorithm, host_view(flat)[segment.start : segment.end])

    def _hash_staged(self, segment: _Segment) -> bytes | None:
        assert self.staging is not None
        hasher = self.algorithm.hasher()
        hashed, size_total = 0, segment.end - segment.start
        while hashed < size_total:
            ready = self._next_ready(segment)
            if ready is None:
                return None
            buf, size = ready
            self.staging.wait(buf)
            hasher.update(self.staging.view(buf, size))
            hashed += size
            assert hashed <= size_total, "a chunk crossed the end of its segment"
            with self.lock:
                self.free.append(buf)  # only now may the copier refill it
                segment.outstanding -= 1
                if hashed == size_total:
                    self.active.remove(segment)
                self.copier_cv.notify()
        return hasher.digest()

    # -- copier (the calling thread) ---------------------------------------------------------

    def copy_all(self) -> None:
        """Issue every chunk of every segment; returns when all are issued (or the run failed)."""
        assert self.staging is not None
        queued: deque[tuple[int, int]] = deque()  # (seq, buffer) of issued copies, in stream order
        last_seq = [0] * self.staging.num_buffers
        seq = 0
        while True:
            if len(queued) >= self.max_queued:
                self.staging.wait(queued.popleft()[1])
                continue
            picked = self._next_chunk()
            if picked is None:
                return
            segment, buf, start, size = picked
            # buf's previous copy has landed (it was hashed since), and copies land in stream order,
            # so every entry up to it is done; dropping them also keeps `queued` free of stale events.
            while queued and queued[0][0] <= last_seq[buf]:
                queued.popleft()
            job = segment.job
            if segment.parts:  # one gather on the copy stream, one copy out
                assert start == 0 and size == segment.end
                segment.gathered = torch.cat([flat_bytes(j.tensor) for j in segment.parts])
                self.staging.copy(buf, segment.gathered)
            else:
                if job.flat is None:  # only this thread makes a staged job's bytes; hashers only drop them
                    job.flat = flat_bytes(job.tensor)
                self.staging.copy(buf, job.flat[start : start + size])
            seq += 1
            last_seq[buf] = seq
            queued.append((seq, buf))
            with self.lock:
                segment.ready.append((buf, size))  # after the copy is issued: its event is the real one
                segment.lane.notify()

    def _next_chunk(self) -> tuple[_Segment, int, int, int] | None:
        """Reserve (segment, buffer, start, size) for the next copy, or None when all is issued."""
        with self.lock:
            while True:
                if self.error is not None:
                    return None
                segment = self._most_behind()
                if segment is not None and self.free:
                    break
                if segment is None and not self.pending and all(s.issued == s.end for s in self.active):
                    return None
                self.copier_cv.wait()
            buf = self.free.pop()  # most recently freed: likeliest still in cache and TLB
            start = segment.issued
            size = min(self.chunk_bytes, segment.end - start)  # never past the segment's end
            assert size > 0, "reserved a chunk of a fully issued segment"
            segment.issued += size
            segment.outstanding += 1
            return segment, buf, start, size

    def _most_behind(self) -> _Segment | None:
        """The claimed segment with the most bytes left to issue that may take another buffer."""
        best: _Segment | None = None
        for segment in self.active:
            if segment.issued == segment.end or segment.outstanding >= MAX_AHEAD:
                continue
            if best is None or segment.end - segment.issued > best.end - best.issued:
                best = segment
        return best


def _hash_view(algorithm: Algorithm, view: memoryview) -> bytes:
    """The digest of one whole work item."""
    hasher = algorithm.hasher()
    hasher.update(view)
    return hasher.digest()


def _hash_host(algorithm: Algorithm, flat: torch.Tensor) -> bytes:
    """One work item's digest of a host byte tensor, kept alive (a strided tensor's copy) while hashed."""
    return _hash_view(algorithm, host_view(flat))


def _pack(jobs: list[Job], chunk_bytes: int, algorithm: Algorithm) -> tuple[list[Job], list[tuple[Job, ...]]]:
    """(jobs hashed on their own, packs): jobs of one segment and at most half a chunk are packed in
    input order (neighbours in a model are often neighbours in memory), each pack at most one chunk.
    A pack of one job is just that job."""
    singles: list[Job] = []
    packs: list[list[Job]] = []
    used = chunk_bytes  # no open pack
    for job in jobs:
        if job.nbytes * 2 > chunk_bytes or len(algorithm.work_spans(job.nbytes)) != 1:
            singles.append(job)
            continue
        if used + job.nbytes > chunk_bytes:
            packs.append([])
            used = 0
        packs[-1].append(job)
        used += job.nbytes
    singles.extend(p[0] for p in packs if len(p) == 1)
    return singles, [tuple(p) for p in packs if len(p) > 1]
