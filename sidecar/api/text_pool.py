"""The threads that tokenize prompts and render chat templates for the HTTP layer, with a bounded queue.

A generation call's text work (sidecar/api/intake.py) runs on one of `workers` threads, never on the
event loop. When every thread is busy a call waits in a queue ordered by its size (characters or
token ids; the smallest first, then arrival), so a 4-token call waits for at most one running job, not
for every large prompt queued before it. The queue holds at most `max_queue` calls: one more is
answered 429 `TextQueueFull` with Retry-After at once, so a flood of large prompts costs memory for
the running jobs and the queued bodies only. A caller that goes away while queued leaves the queue; a
job already running finishes on its thread (a thread cannot be stopped) and only then frees its slot,
so the pool never runs more than `workers` jobs.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from sidecar.api.common import ApiError

T = TypeVar("T")
RETRY_AFTER_S = 1


def default_workers() -> int:
    """The machine's cores (those this process may use), at most 8: tokenization releases the GIL."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(8, cores))


class TextPool:
    """`await pool.run(size, fn, *args)`: fn(*args) on a worker thread, smallest queued job first."""

    def __init__(self, workers: int, max_queue: int) -> None:
        self.workers = workers
        self.max_queue = max_queue
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="sidecar-text")
        self._running = 0
        self._queue: list[tuple[int, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    @property
    def queued(self) -> int:
        return sum(not w.done() for _, _, w in self._queue)

    async def run(self, size: int, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        if self._running < self.workers:
            self._running += 1
        else:
            await self._wait_turn(loop, size)
        try:
            job: Future[T] = self._executor.submit(fn, *args)
        except BaseException:
            self._release()
            raise
        # The slot is freed when the thread is done, even if this caller was cancelled before that.
        job.add_done_callback(lambda _: loop.call_soon_threadsafe(self._release))
        return await asyncio.wrap_future(job)

    async def _wait_turn(self, loop: asyncio.AbstractEventLoop, size: int) -> None:
        """Wait until a finishing job hands its slot over (`_release`), or refuse at once when full."""
        if self.queued >= self.max_queue:
            raise ApiError(429, "TextQueueFull", f"{self.max_queue} calls already wait for tokenization (the "
                           "sidecar's --max-text-queue): retry later", "prompts",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        waiter: asyncio.Future[None] = loop.create_future()
        heapq.heappush(self._queue, (size, next(self._order), waiter))
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():  # handed a slot it will not use: pass it on
                self._release()
            raise

    def _release(self) -> None:
        """A job finished: hand its slot to the smallest waiting job, else free it."""
        while self._queue:
            _, _, waiter = heapq.heappop(self._queue)
            if not waiter.done():
                waiter.set_result(None)
                return
        self._running -= 1

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
