"""The outermost layer of the HTTP app under Starlette's own (a pure ASGI middleware): what must hold for
every route, whatever its handler does.

- A body larger than --max-body-mb is refused with 413 before it is read: at once when Content-Length
  says so, else as soon as the bytes received pass the limit (a chunked body). Nothing of it is parsed
  or kept, so one client cannot make the process hold gigabytes. A body that makes no progress for
  --body-timeout-s (a stalled client, a Content-Length larger than the body) is answered 408, and so is
  one that trickles: the whole body must arrive within --body-timeout-s plus its length (declared, else
  the limit) at MIN_BODY_RATE, so a byte every few seconds cannot hold a connection for hours.
- Every answer the app writes carries `Server-Timing: app;dur=MS` (the app's time on the request; the
  weight calls add `handler;dur=MS`, and /weights/update `ranks;dur=MS`, the slowest rank's own time), so
  a client can split its own time into the wire's, the framework's, the sidecar's hops and the ranks'.
- An exception that no handler took becomes a JSON 500 here. Why not an `exception_handler(Exception)`:
  Starlette runs that one in ServerErrorMiddleware, which re-raises after answering, and uvicorn then
  closes the connection without saying so; the caller's next request on that kept-alive connection
  would fail (SidecarConnectionError). Answered here, the exception ends here and the connection stays
  usable.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any

from starlette.exceptions import HTTPException

from sidecar.api.common import ApiError, error_response
from sidecar.api.connection import LATE_GRACES, overdue

log = logging.getLogger(__name__)

TIMING_KEY = "sidecar.timing"  # the scope key of a request's timing notes (an ASGI extension key)
Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class BodyTooLarge(HTTPException):
    """413, raised while the body is read; Starlette's handler for HTTPException answers it. The
    connection is closed after the answer: the rest of the body is never read."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body exceeds {limit} bytes (the sidecar's --max-body-mb); send "
                              "fewer or shorter prompts per call, or raise the limit",
                         headers={"Connection": "close"})


MIN_BODY_RATE = 16 * 1024  # bytes per second a body averages at least, beyond --body-timeout-s of slack


class BodyTooSlow(HTTPException):
    """408, raised while the body is read: no new byte of it came for body_timeout_s (a client that
    stalled, or a Content-Length larger than the body it sent), or the whole body did not come within
    `whole_s` (a trickle)."""

    def __init__(self, timeout_s: float, whole_s: float | None = None) -> None:
        if whole_s is None:
            message = (f"no byte of the request body arrived for {timeout_s} s (the sidecar's --body-timeout-s): "
                       "is its Content-Length larger than the body?")
        else:
            message = (f"the request body did not arrive within {whole_s:.0f} s (the sidecar's --body-timeout-s "
                       f"plus its length at {MIN_BODY_RATE // 1024} KiB/s): the client sends too slowly")
        super().__init__(408, message, headers={"Connection": "close"})


async def _receive_within(receive: Receive, timeout_s: float) -> Message | None:
    """The next message, or None after timeout_s without one; a wait that ended overdue (the loop was
    busy: the body may be waiting behind the timer) waits again, as connection.PatientTimer does."""
    loop, graces = asyncio.get_running_loop(), LATE_GRACES
    while True:
        started = loop.time()
        try:
            return await asyncio.wait_for(receive(), timeout_s)
        except TimeoutError:
            if not graces or not overdue(started, loop.time(), timeout_s):
                return None
            graces -= 1


class RequestGuard:
    """ASGI middleware: the body limit, the body's progress timeout and the last-resort JSON 500 (module
    docstring). `on_error(status)` counts the error responses it writes itself."""

    def __init__(self, app: Any, max_body_bytes: int, on_error: Callable[[int], None],
                 body_timeout_s: float | None = None) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.on_error = on_error
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_body_bytes
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            error = BodyTooLarge(limit)
            await self._answer(scope, receive, send, 413, "PayloadTooLarge", str(error.detail), error.headers)
            return
        seen, body_done, timeout_s = 0, False, self.body_timeout_s
        loop = asyncio.get_running_loop()
        whole_s = None if timeout_s is None else timeout_s + (limit if declared is None else declared) / MIN_BODY_RATE
        due = None if whole_s is None else loop.time() + whole_s

        async def limited_receive() -> Message:
            nonlocal seen, body_done
            if body_done or due is None:  # afterwards a receive waits for a disconnect: no bound
                message = await receive()
            else:
                left = due - loop.time()
                got = await _receive_within(receive, min(timeout_s, left)) if left > 0 else None
                if got is None:
                    raise BodyTooSlow(timeout_s, whole_s if left < timeout_s else None)
                message = got
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(limit)
                body_done = body_done or not message.get("more_body", False)
            else:
                body_done = True
            return message

        started = False
        t0 = time.perf_counter()
        timing: dict[str, float] = {}
        scope[TIMING_KEY] = timing  # a handler may note its own time here (note_handler_time)

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start" and not started:
                started = True
                message = {**message, "headers": [*message.get("headers", ()), _server_timing(t0, timing)]}
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except Exception as e:
            if started:  # half a response is out: nothing sane is left to send
                raise
            log.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            await self._answer(scope, receive, send, 500, type(e).__name__, str(e) or type(e).__name__)

    async def _answer(self, scope: Scope, receive: Receive, send: Send, status: int, type_: str, message: str,
                      headers: dict[str, str] | None = None) -> None:
        self.on_error(status)
        field = "body" if status == 413 else None
        await error_response(status, type_, message, field, headers=headers)(scope, receive, send)


def require_key(key: str | None, headers: Mapping[str, str]) -> None:
    """The API-key rule (sidecar/api/app.py says which routes it guards): a 401 naming the field unless no
    key is set or `headers` (lower-case names) carry `Authorization: Bearer KEY`."""
    if key is None:
        return
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise ApiError(401, "Unauthorized", "missing or wrong API key: send 'Authorization: Bearer KEY', KEY "
                       "being the sidecar's (`sidecar launch --api-key` or SIDECAR_API_KEY); from Python "
                       "SidecarClient(url, api_key=KEY), from the CLI --api-key KEY or SIDECAR_API_KEY",
                       "authorization")


def note_handler_time(scope: Scope, t0: float, ranks_s: float | None = None) -> None:
    """A handler's own time (since `t0`, perf_counter) for this request's Server-Timing `handler` entry, and
    the slowest rank's own time on its command (`ranks`: the handler minus it is the sidecar's hops)."""
    timing = scope.get(TIMING_KEY)
    if timing is not None:
        timing["handler_ms"] = (time.perf_counter() - t0) * 1e3
        if ranks_s is not None:
            timing["ranks_ms"] = ranks_s * 1e3


def _server_timing(t0: float, timing: dict[str, float]) -> tuple[bytes, bytes]:
    """`Server-Timing: app;dur=MS[, handler;dur=MS[, ranks;dur=MS]]`: this app's time on the request, from
    this middleware's entry (the headers parsed by the server) to the answer's start (the framework, the
    body and the handler), the handler's own time where it noted one (the weight calls: what the sidecar's
    sync_seconds histogram observes) and the slowest rank's time on its command (an update). A client
    subtracts them from its own time per call to see what the wire and its HTTP code cost, the framework,
    and the sidecar's hops to the ranks and back (scripts/bench/client_sync.py reports each)."""
    value = f"app;dur={(time.perf_counter() - t0) * 1e3:.3f}"
    if "handler_ms" in timing:
        value += f", handler;dur={timing['handler_ms']:.3f}"
    if "ranks_ms" in timing:
        value += f", ranks;dur={timing['ranks_ms']:.3f}"
    return b"server-timing", value.encode()


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
