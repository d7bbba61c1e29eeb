"""The many-tensor hashing pipeline: in-place host hashing, and device streaming through staging buffers.

Roles in one run:
- pool threads ("hashers") claim tensors largest first and hash one tensor at a time with that
  tensor's own streaming xxh3 hasher. Host tensors are hashed in place. A staged tensor's chunks
  arrive in its lane (a FIFO) and are hashed in byte order.
- the calling thread is the copier: it picks the next chunk, takes a free buffer, issues the copy
  (on CUDA: on a dedicated copy stream, then records the buffer's event) and only then appends
  (buffer, size) to the tensor's lane.
Invariants:
- a hasher reads a buffer only after waiting on that buffer's copy (its event);
- a buffer goes back to the free list only after its hash finished, so it is never refilled early;
- a tensor's chunks are issued and hashed in byte order, so chunking never changes a digest;
- at most `max_queued` copies are outstanding on the copy stream, so who gets the next buffer is
  decided late and goes to the claimed tensor with the most bytes left: a 1 GB embedding, whose
  hash is sequential, starts first and is never starved by the many small tensors around it;
- at most MAX_AHEAD chunks per tensor are issued and not yet hashed, so no tensor hoards buffers.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from collections import deque
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import torch
import xxhash

from checksum.tensor_bytes import flat_bytes, host_view

MAX_AHEAD = 4  # per tensor: one chunk being hashed, up to three arriving


class Staging(Protocol):
    """Reusable staging buffers and the way bytes get into them."""

    num_buffers: int

    def session(self, device: torch.device | None) -> AbstractContextManager[None]:
        """Context for one run's copies; on exit, no copy into a buffer is still in flight."""
        ...

    def copy(self, buf: int, src: torch.Tensor) -> None:
        """Start copying the 1-D uint8 `src` into buffer `buf` (may return before it lands)."""
        ...

    def wait(self, buf: int) -> None:
        """Block until the last copy issued into `buf` has landed. Releases the GIL while blocked."""
        ...

    def view(self, buf: int, nbytes: int) -> memoryview:
        """The first `nbytes` of buffer `buf`, zero-copy."""
        ...


class HostStaging:
    """Plain host buffers with synchronous copies: runs the device pipeline without a GPU."""

    def __init__(self, chunk_bytes: int, num_buffers: int) -> None:
        self.num_buffers = num_buffers
        self._buffers = [torch.empty(chunk_bytes, dtype=torch.uint8) for _ in range(num_buffers)]
        self._views = [host_view(b) for b in self._buffers]

    @contextmanager
    def session(self, device: torch.device | None) -> Iterator[None]:
        yield

    def copy(self, buf: int, src: torch.Tensor) -> None:
        self._buffers[buf][: src.numel()].copy_(src)

    def wait(self, buf: int) -> None:
        pass  # copies are synchronous

    def view(self, buf: int, nbytes: int) -> memoryview:
        return self._views[buf][:nbytes]


class CudaStaging:
    """Pinned host buffers filled by one copy stream per device, one blocking event per buffer.

    Blocking-sync events make a waiting hasher sleep instead of spinning on a core that another
    hasher needs. Streams and events are made once per device and reused by every run.
    """

    def __init__(self, chunk_bytes: int, num_buffers: int) -> None:
        self.num_buffers = num_buffers
        self._buffers = [
            torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(num_buffers)
        ]
        self._views = [host_view(b) for b in self._buffers]
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._events: dict[int, list[torch.cuda.Event]] = {}
        self._stream: torch.cuda.Stream | None = None
        self._current_events: list[torch.cuda.Event] = []

    @contextmanager
    def session(self, device: torch.device | None) -> Iterator[None]:
        assert device is not None and device.type == "cuda", f"CudaStaging needs a cuda device, got {device}"
        index = device.index if device.index is not None else torch.cuda.current_device()
        with torch.cuda.device(index):
            if index not in self._streams:
                self._streams[index] = torch.cuda.Stream()
                self._events[index] = [torch.cuda.Event(blocking=True) for _ in range(self.num_buffers)]
            stream = self._streams[index]
            # The tensors were written on the caller's current stream: copy only after that work.
            stream.wait_stream(torch.cuda.current_stream())
            self._stream, self._current_events = stream, self._events[index]
            try:
                with torch.cuda.stream(stream):  # contiguous() of strided tensors runs here too
                    yield
            finally:
                # Whatever happened, no DMA may still be writing a buffer once the run is over.
                stream.synchronize()
                self._stream, self._current_events = None, []

    def copy(self, buf: int, src: torch.Tensor) -> None:
        assert self._stream is not None, "copy outside a session"
        self._buffers[buf][: src.numel()].copy_(src, non_blocking=True)
        self._current_events[buf].record(self._stream)

    def wait(self, buf: int) -> None:
        self._current_events[buf].synchronize()

    def view(self, buf: int, nbytes: int) -> memoryview:
        return self._views[buf][:nbytes]


@dataclass(eq=False)
class Job:
    """One tensor to digest. `index` is its position in the caller's input; `digest` the result."""

    index: int
    tensor: torch.Tensor
    nbytes: int
    staged: bool
    digest: str | None = None
    flat: torch.Tensor | None = None  # contiguous uint8 bytes, made when its first chunk is copied
    issued: int = 0  # bytes whose copy has been issued
    outstanding: int = 0  # chunks issued and not yet hashed
    ready: deque[tuple[int, int]] = field(default_factory=deque)  # (buffer, size), copy issued


def run_jobs(
    jobs: list[Job],
    staging: tuple[Staging, torch.device | None] | None,
    pool: concurrent.futures.ThreadPoolExecutor,
    threads: int,
    chunk_bytes: int,
    max_queued: int,
) -> None:
    """Digest every job (all staged on one device, or all hashed in place); sets `job.digest`.

    Returns after every hasher has stopped; re-raises the first error of any thread.
    """
    assert jobs and all(j.nbytes > 0 and j.staged == (staging is not None) for j in jobs)
    run = _Run(jobs, staging[0] if staging else None, chunk_bytes, max_queued)
    # The session outlives the hashers: they still wait on copies after the last one is issued.
    with staging[0].session(staging[1]) if staging is not None else contextlib.nullcontext():
        futures = [pool.submit(run.hasher) for _ in range(min(threads, len(jobs)))]
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
    """Shared state of one run; every field below `lock` is guarded by it."""

    def __init__(self, jobs: list[Job], staging: Staging | None, chunk_bytes: int, max_queued: int) -> None:
        self.staging = staging
        self.chunk_bytes = chunk_bytes
        self.max_queued = max_queued
        self.lock = threading.Lock()
        self.copier_cv = threading.Condition(self.lock)
        self.lane_cv = {id(j): threading.Condition(self.lock) for j in jobs}
        # Longest first: the makespan is bounded below by the biggest tensor's sequential hash.
        self.pending = deque(sorted(jobs, key=lambda j: -j.nbytes))
        self.active: list[Job] = []
        self.free = list(range(staging.num_buffers)) if staging is not None else []
        self.error: BaseException | None = None

    def fail(self, exc: BaseException) -> None:
        """Record the first error and wake everyone so they stop."""
        with self.lock:
            if self.error is None:
                self.error = exc
            self.copier_cv.notify_all()
            for cv in self.lane_cv.values():
                cv.notify_all()

    # -- hashers (pool threads) --------------------------------------------------------------

    def hasher(self) -> None:
        try:
            while (job := self._claim()) is not None:
                digest = self._hash_staged(job) if job.staged else self._hash_in_place(job)
                if digest is None:  # the run failed elsewhere
                    return
                job.digest = digest
        except BaseException as exc:
            self.fail(exc)

    def _claim(self) -> Job | None:
        with self.lock:
            if self.error is not None or not self.pending:
                return None
            job = self.pending.popleft()
            if job.staged:
                self.active.append(job)
                self.copier_cv.notify()
            return job

    def _hash_in_place(self, job: Job) -> str | None:
        view = host_view(flat_bytes(job.tensor))
        hasher = xxhash.xxh3_128()
        for start in range(0, job.nbytes, self.chunk_bytes):
            if self.error is not None:  # a racy read is fine: it only stops a doomed run sooner
                return None
            hasher.update(view[start : start + self.chunk_bytes])
        return hasher.hexdigest()

    def _hash_staged(self, job: Job) -> str | None:
        assert self.staging is not None
        hasher = xxhash.xxh3_128()
        hashed = 0
        cv = self.lane_cv[id(job)]
        while hashed < job.nbytes:
            with self.lock:
                while not job.ready and self.error is None:
                    cv.wait()
                if self.error is not None:
                    return None
                buf, size = job.ready.popleft()
            self.staging.wait(buf)
            hasher.update(self.staging.view(buf, size))
            hashed += size
            with self.lock:
                self.free.append(buf)  # only now may the copier refill it
                job.outstanding -= 1
                if hashed == job.nbytes:
                    self.active.remove(job)
                    job.flat = None  # every copy from it has landed; free a strided tensor's copy
                self.copier_cv.notify()
        return hasher.hexdigest()

    # -- copier (the calling thread) ---------------------------------------------------------

    def copy_all(self) -> None:
        """Issue every chunk of every job; returns when all are issued (or the run failed)."""
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
            job, buf, start, size = picked
            # buf's previous copy has landed (it was hashed since), and copies land in stream order,
            # so every entry up to it is done; dropping them also keeps `queued` free of stale events.
            while queued and queued[0][0] <= last_seq[buf]:
                queued.popleft()
            if job.flat is None:
                job.flat = flat_bytes(job.tensor)
            self.staging.copy(buf, job.flat[start : start + size])
            seq += 1
            last_seq[buf] = seq
            queued.append((seq, buf))
            with self.lock:
                job.ready.append((buf, size))  # after the copy is issued: its event is the real one
                self.lane_cv[id(job)].notify()

    def _next_chunk(self) -> tuple[Job, int, int, int] | None:
        """Reserve (job, buffer, start, size) for the next copy, or None when all is issued."""
        with self.lock:
            while True:
                if self.error is not None:
                    return None
                job = self._most_behind()
                if job is not None and self.free:
                    break
                if job is None and not self.pending and all(j.issued == j.nbytes for j in self.active):
                    return None
                self.copier_cv.wait()
            buf = self.free.pop()  # most recently freed: likeliest still in cache and TLB
            start = job.issued
            size = min(self.chunk_bytes, job.nbytes - start)
            job.issued += size
            job.outstanding += 1
            return job, buf, start, size

    def _most_behind(self) -> Job | None:
        """The claimed job with the most bytes left to issue that may take another buffer."""
        best: Job | None = None
        for job in self.active:
            if job.issued == job.nbytes or job.outstanding >= MAX_AHEAD:
                continue
            if best is None or job.nbytes - job.issued > best.nbytes - best.issued:
                best = job
        return best
