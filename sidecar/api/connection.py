"""The HTTP connection under the app: uvicorn's protocol, httptools or h11, with the bounds they lack (docs/limits.md).

- A connection's request line and headers: at most `max_header_bytes` (431), arriving within
  `header_timeout_s` of their first byte (408); both answered in the JSON error shape, then closed.
  Counted before the parser keeps them, so a 200 MB header costs one read buffer, not 200 MB.
- A new connection that sends nothing for `header_timeout_s`, or one kept alive after a request that
  sends nothing for `idle_timeout_s`, is closed.
- At most `max_connections` are open: a new one closes the longest-idle one, or is answered 503 when
  every open connection is busy. So idle sockets cannot use up the process's descriptors and /health
  always gets through while any connection is idle.
- The parser's own 400 (bytes that are not HTTP) is answered in the JSON error shape.
- A response that closes the connection before its request body was read (a 413) is not followed by
  a reset: the server half-closes and reads and drops what the client still sends for up to
  `linger_s`, so the client reads the answer (closing with unread bytes makes the kernel send RST, and
  the client saw "connection reset" instead of the 413).
Both parsers get these bounds (h11 serves where the server extra is not installed). The body's progress
timeout is the app's (sidecar/api/guard.py): it sees the receive calls.
Every timeout here judges the client, not the server: a timer that fires more than LATE_SHARE of its
delay late means the event loop was busy (a blocked step, a loaded host), and the client's bytes may be
waiting in the socket behind it, so it waits once more (at most LATE_GRACES times) before it refuses.
"""

from __future__ import annotations

import json
import logging
import resource
from dataclasses import dataclass
from typing import Any

import h11  # uvicorn's own dependency: its pure-Python parser

log = logging.getLogger(__name__)


LATE_SHARE = 0.5  # a timer this much of its delay late fired on a busy loop, not on a slow client
LATE_GRACES = 2  # at most this many more periods for a timer that keeps firing late


def overdue(started: float, now: float, delay_s: float) -> bool:
    """Whether a wait of delay_s begun at `started` ended late enough (now) to blame the loop."""
    return now - started > (1 + LATE_SHARE) * delay_s


class PatientTimer:
    """loop.call_later(delay_s, callback), except that a firing overdue (module docstring) arms it again,
    at most LATE_GRACES times. cancel() as a TimerHandle's (uvicorn cancels its keep-alive task so)."""

    def __init__(self, loop: Any, delay_s: float, callback: Any) -> None:
        self._loop, self._delay, self._callback, self._graces = loop, delay_s, callback, LATE_GRACES
        self._arm()

    def _arm(self) -> None:
        self._started = self._loop.time()
        self._handle = self._loop.call_later(self._delay, self._fire)

    def _fire(self) -> None:
        if self._graces and overdue(self._started, self._loop.time(), self._delay):
            self._graces -= 1
            self._arm()
            return
        self._callback()

    def cancel(self) -> None:
        self._handle.cancel()


@dataclass(frozen=True)
class ConnectionLimits:
    max_header_bytes: int
    header_timeout_s: float
    idle_timeout_s: float
    max_connections: int
    linger_s: float = 2.0


def error_bytes(status: int, reason: str, type_: str, message: str, field: str | None = None) -> bytes:
    """A whole HTTP/1.1 response in the API's error shape, closing the connection."""
    body = json.dumps({"error": {"type": type_, "message": message, "field": field, "rank": None}}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n")
    return head.encode("ascii") + body


class _LingeringTransport:
    """The connection's transport as uvicorn sees it: `close()` lingers while a request body is unread."""

    def __init__(self, transport: Any, protocol: Any) -> None:
        self._transport = transport
        self._protocol = protocol

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def close(self) -> None:
        self._protocol.close_lingering()


class _Bounded:
    """The bounds (module docstring) over either uvicorn protocol: a per-server subclass (protocol_class)
    puts a variant below it in the MRO (_HttpToolsVariant or _H11Variant, then uvicorn's class), and sets
    `limits` and `idle`, the server's idle connections, oldest first (a dict kept in insertion order).
    The variant calls `_head_done()` when the parser has a request's whole head, and its
    `_next_request_started()` says, once a response is out, whether the parser already started the next
    request (pipelining). _Bounded comes first in the MRO, so its data_received wraps the variant's."""

    limits: ConnectionLimits
    idle: dict[Any, None]

    def connection_made(self, transport: Any) -> None:
        limits, idle = self.limits, self.idle
        self._raw = transport
        self._in_head, self._head_bytes, self._lingering = True, 0, False
        self._head_timer: Any = None
        full = len(self.connections) >= limits.max_connections
        if full and idle:  # the longest-idle connection makes room
            oldest = next(iter(idle))
            idle.pop(oldest)
            oldest.close_now()
            full = False
        super().connection_made(_LingeringTransport(transport, self))  # type: ignore[misc]
        if full:
            self._refuse(503, "Service Unavailable", "TooManyConnections",
                         f"{limits.max_connections} connections are open and busy (the sidecar's "
                         "--max-connections): retry later")
            return
        self._go_idle(limits.header_timeout_s)  # a new connection owes its first request at once

    def _go_idle(self, timeout_s: float) -> None:
        self.idle[self] = None
        self._unset_keepalive_if_required()
        self.timeout_keep_alive_task = PatientTimer(self.loop, timeout_s, self.close_now)

    def connection_lost(self, exc: Exception | None) -> None:
        self.idle.pop(self, None)
        self._cancel_head_timer()
        super().connection_lost(exc)  # type: ignore[misc]

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return  # read and dropped: the answer is out, the client is still sending its body
        limits = self.limits
        self.idle.pop(self, None)
        if self._in_head:
            if self._head_bytes == 0 and self._head_timer is None:
                self._head_timer = PatientTimer(self.loop, limits.header_timeout_s, self._head_too_slow)
            self._head_bytes += len(data)
        super().data_received(data)  # type: ignore[misc]
        if self._in_head and self._head_bytes > limits.max_header_bytes and not self._lingering:
            self._refuse_head_too_large()

    def _head_done(self) -> None:
        self._in_head, self._head_bytes = False, 0
        self._cancel_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        started = self._next_request_started()  # type: ignore[attr-defined]  # the variant's
        if not self._raw.is_closing() and not self._lingering and not started:
            self._in_head, self._head_bytes = True, 0
            self._go_idle(self.limits.idle_timeout_s)

    def send_400_response(self, msg: str) -> None:
        if self._in_head and self._head_bytes > self.limits.max_header_bytes:
            self._refuse_head_too_large()  # h11 refuses a head past its buffer limit as a parse error
            return
        self._refuse(400, "Bad Request", "MalformedRequest", f"{msg.rstrip('.')}: the request line or a header "
                     "is not HTTP/1.1 (a space or a byte outside ASCII in the target, a bad header name, "
                     "conflicting lengths)", "request")

    def _refuse_head_too_large(self) -> None:
        self._refuse(431, "Request Header Fields Too Large", "HeadersTooLarge",
                     f"the request line and headers exceed {self.limits.max_header_bytes} bytes (the "
                     "sidecar's --max-header-kb)", "headers")

    def _head_too_slow(self) -> None:
        self._head_timer = None
        if self._in_head and not self._raw.is_closing():
            self._refuse(408, "Request Timeout", "RequestTimeout", "the request line and headers did not "
                         f"arrive within {self.limits.header_timeout_s} s (the sidecar's --header-timeout-s)",
                         "headers")

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _refuse(self, status: int, reason: str, type_: str, message: str, field: str | None = None) -> None:
        self.idle.pop(self, None)
        self._cancel_head_timer()
        self._raw.write(error_bytes(status, reason, type_, message, field))
        self.close_lingering(force=True)

    def close_lingering(self, force: bool = False) -> None:
        """Close after an answer; while a request's bytes may still come, half-close and drop them
        for at most linger_s first (module docstring)."""
        unread = force or (self.cycle is not None and self.cycle.more_body)
        if not unread or self._raw.is_closing() or self._lingering or not self._raw.can_write_eof():
            if not self._raw.is_closing():
                self._raw.close()
            return
        self._lingering = True
        self._in_head = False
        self._cancel_head_timer()
        self._unset_keepalive_if_required()
        self._raw.write_eof()
        self._raw.resume_reading()
        self.loop.call_later(self.limits.linger_s, self.close_now)

    def close_now(self) -> None:
        if not self._raw.is_closing():
            self._raw.close()

    def eof_received(self) -> bool | None:
        if self._lingering:
            self.close_now()
        return super().eof_received()  # type: ignore[misc]


class _HttpToolsVariant:
    """httptools tells the end of a head by a callback and queues pipelined requests in `pipeline`."""

    def on_headers_complete(self) -> None:
        self._head_done()  # type: ignore[attr-defined]
        super().on_headers_complete()  # type: ignore[misc]

    def _next_request_started(self) -> bool:
        return bool(self.pipeline)  # type: ignore[attr-defined]


class _H11Variant:
    """h11 has no callback for the end of a head: its state says it. The peer is IDLE until a request's
    head is parsed, and stays IDLE after a response unless a pipelined request's head was parsed."""

    def data_received(self, data: bytes) -> None:
        super().data_received(data)  # type: ignore[misc]
        if self._in_head and not self._lingering and self.conn.their_state is not h11.IDLE:  # type: ignore[attr-defined]
            self._head_done()  # type: ignore[attr-defined]

    def _next_request_started(self) -> bool:
        return self.conn.their_state is not h11.IDLE  # type: ignore[attr-defined]


def protocol_class(limits: ConnectionLimits, http: str) -> type:
    """uvicorn's protocol for `http` ("httptools" or "h11") bounded by `limits`: the same bounds either way
    (module docstring). One class per server: its idle set is shared by its connections."""
    if http == "httptools":
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        bases: tuple[type, ...] = (_Bounded, _HttpToolsVariant, HttpToolsProtocol)
    elif http == "h11":
        from uvicorn.protocols.http.h11_impl import H11Protocol

        bases = (_Bounded, _H11Variant, H11Protocol)
    else:
        raise ValueError(f"http must be 'httptools' or 'h11', got {http!r}")
    return type("BoundedProtocol", bases, {"limits": limits, "idle": {}})


def ensure_descriptors(max_connections: int, spare: int = 256) -> None:
    """Raise this process's soft descriptor limit to hold `max_connections` plus `spare` (files, pipes to
    the ranks), up to the hard limit; warn when even that is too low."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max_connections + spare
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        if new < want:
            log.warning("--max-connections %d needs %d descriptors but the hard limit is %d: lower "
                        "--max-connections or raise `ulimit -n`", max_connections, want, hard)
