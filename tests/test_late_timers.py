"""The HTTP timeouts judge the client, not the server (sidecar/api/connection.py): a timer that fires
overdue because the event loop was blocked waits again, so a client whose bytes arrived during the
block is served; a timer on a free loop still fires on time. Both the connection's timers
(PatientTimer) and the body's progress timeout (guard._receive_within) follow the rule."""

from __future__ import annotations

import asyncio
import time

from sidecar.api.connection import LATE_GRACES, PatientTimer
from sidecar.api.guard import _receive_within


def test_a_timer_on_a_free_loop_fires_on_time() -> None:
    async def main() -> float:
        loop, fired = asyncio.get_running_loop(), asyncio.Event()
        t0 = loop.time()
        PatientTimer(loop, 0.05, fired.set)
        await asyncio.wait_for(fired.wait(), 5)
        return loop.time() - t0

    assert asyncio.run(main()) < 1.0


def test_an_overdue_timer_waits_again_and_can_be_cancelled_meanwhile() -> None:
    async def main() -> list[str]:
        loop, events = asyncio.get_running_loop(), []
        timer = PatientTimer(loop, 0.05, lambda: events.append("fired"))
        time.sleep(0.3)  # the loop is blocked: the timer comes due 0.25 s late
        await asyncio.sleep(0.01)  # it ran, overdue, and armed itself again
        events.append("after the block")
        timer.cancel()  # the client's bytes came meanwhile: the connection cancels the timeout
        await asyncio.sleep(0.2)
        return events

    assert asyncio.run(main()) == ["after the block"]


def test_a_timer_that_keeps_firing_late_gives_up_after_its_graces() -> None:
    async def main() -> int:
        loop, fired = asyncio.get_running_loop(), asyncio.Event()
        PatientTimer(loop, 0.02, fired.set)
        blocks = 0
        while not fired.is_set():
            time.sleep(0.1)  # every period overdue
            blocks += 1
            await asyncio.sleep(0)
            await asyncio.sleep(0)
        return blocks

    assert asyncio.run(main()) == LATE_GRACES + 1


def test_a_body_that_arrived_while_the_loop_was_blocked_is_read_not_refused() -> None:
    async def main() -> dict:
        loop = asyncio.get_running_loop()
        arrived: asyncio.Future = loop.create_future()

        async def receive() -> dict:
            return await asyncio.shield(arrived)

        # The body lands 10 ms after the 50 ms timeout would end, but the loop is blocked for 300 ms
        # first: both come due in one turn, the timeout first, as on a loaded host.
        loop.call_later(0.06, arrived.set_result, {"type": "http.request", "body": b"{}", "more_body": False})
        loop.call_soon(time.sleep, 0.3)
        return await _receive_within(receive, 0.05)

    assert asyncio.run(main())["body"] == b"{}"


def test_a_body_that_never_comes_is_refused_after_the_timeout() -> None:
    async def main() -> dict | None:
        never: asyncio.Future = asyncio.get_running_loop().create_future()

        async def receive() -> dict:
            return await asyncio.shield(never)

        return await _receive_within(receive, 0.05)

    assert asyncio.run(main()) is None  # the guard answers 408 (BodyTooSlow)
