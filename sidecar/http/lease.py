"""The lease of an open weight-update session, kept by the sidecar process (issue 20, item 3).

A session that is opened (POST /weights/start) and never finished holds every generation call: the
engine serves no model with an open session. A trainer that died or hung between its calls would
hold them forever, so the session has a lease: when no weight call of the trainer ran for
`lease_s` (--weight-session-lease-s), the session is aborted on every rank (AbortWeightUpdate) and
generation goes on. Invariant: the lease never expires while one of the session's calls is in flight
(a long update is bounded by the wire's own timeout instead); each call's end renews it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator

log = logging.getLogger(__name__)


class SessionLease:
    """`expire` is awaited once when the lease runs out (it aborts the session on the ranks)."""

    def __init__(self, lease_s: float, expire: Callable[[], Awaitable[None]]) -> None:
        assert lease_s > 0, lease_s
        self.lease_s = lease_s
        self._expire = expire
        self._open = False
        self._busy = 0
        self._deadline = 0.0
        self._task: asyncio.Task | None = None

    @property
    def is_open(self) -> bool:
        return self._open

    def opened(self) -> None:
        """A session was opened: the lease starts now."""
        self._open = True
        self._renew()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._watch())

    def closed(self) -> None:
        """The session ended (finished, failed, abandoned by an init, or aborted)."""
        self._open = False
        if self._task is not None and self._task is not asyncio.current_task():
            self._task.cancel()
        self._task = None

    @contextlib.contextmanager
    def call(self) -> Iterator[None]:
        """Wrap one of the session's calls: the lease holds while it runs and renews when it ends."""
        self._busy += 1
        try:
            yield
        finally:
            self._busy -= 1
            self._renew()

    def _renew(self) -> None:
        self._deadline = asyncio.get_running_loop().time() + self.lease_s

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        while self._open:
            left = self._deadline - loop.time()
            if left > 0 or self._busy:  # a call in flight: look again soon after it may have ended
                await asyncio.sleep(left if left > 0 else self.lease_s / 4)
                continue
            log.warning("the weight-update session sat idle for %g s (--weight-session-lease-s): aborting it",
                        self.lease_s)
            self.closed()
            try:
                await self._expire()
            except Exception:  # no caller to raise to: the abort's failure is logged, /health shows a dead rank
                log.exception("aborting the expired weight-update session failed")
            return
