"""`Wire`: the HTTP exchange of `SidecarClient` with one sidecar: timeouts, retries of idempotent calls
only, and every error response turned into its typed error (trainer_hooks/client_errors.py).

- Plain http to a sidecar (no proxy of the environment, no caller's `transport`) goes over `KeepAliveWire`:
  kept-alive http.client connections, because a request through httpx and httpcore takes about twice as
  long, the difference being Python that builds and parses it (docs/dev/benchmark-log.md). https, a proxy or a
  caller's transport go through httpx.
- Only GETs are retried, on connection errors and timeouts, with exponential backoff; everything else
  is sent once (a retry could run it twice).
- `begin` writes a request now and returns its `Pending` answer: the weight sync writes its update before
  the sender's send() starts and reads the answer once send() returned (on the lean wire that read is on
  the calling thread, no thread hop; through httpx, which writes when it reads, a worker thread waits).

Invariants: a connection serves one request at a time; a connection that may hold half an exchange (any
error) is closed, never pooled; an idle connection the server closed is noticed before it is used.
"""

from __future__ import annotations

import http.client
import json as jsonlib
import select
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import httpx

from trainer_hooks.client_errors import SidecarConnectionError, SidecarHTTPError, error_class

_IDLE_KEPT = 4  # idle connections kept: a sync uses one, calls beside it (a /state, a generate) more
_TRANSPORT_ERRORS = (httpx.TransportError, OSError, http.client.HTTPException)  # the request or its answer is lost


class Pending(Protocol):
    """An answer on its way: `result()` returns the parsed JSON, or raises the call's SidecarError."""

    def result(self) -> Any: ...


class Wire:
    """Requests to one sidecar (module docstring). Thread-safe."""

    def __init__(self, url: str, headers: dict[str, str], timeout: float, *, retries: int, backoff_s: float,
                 transport: httpx.BaseTransport | None) -> None:
        self.url, self.timeout, self.retries, self.backoff_s = url, timeout, retries, backoff_s
        self._http = httpx.Client(base_url=url, headers=headers, timeout=timeout, transport=transport)
        self._lean = KeepAliveWire(url, headers) if transport is None and lean_wire_applies(url) else None
        self._readers = ThreadPoolExecutor(1, thread_name_prefix="sidecar-answer")  # httpx's begun calls

    def close(self) -> None:
        self._http.close()
        if self._lean is not None:
            self._lean.close()
        self._readers.shutdown(wait=True)

    def request(self, method: str, path: str, *, json: Any = None, params: dict[str, Any] | None = None,
                timeout: float | None = None, ok_statuses: tuple[int, ...] = ()) -> httpx.Response:
        """The checked response of one call; a GET is retried on transport errors."""
        attempts = 1 + (self.retries if method == "GET" else 0)
        for attempt in range(attempts):
            try:
                resp = self._send(method, path, json, params, timeout)()
            except _TRANSPORT_ERRORS as e:
                if attempt + 1 < attempts:
                    time.sleep(self.backoff_s * 2**attempt)
                    continue
                raise self._gone(method, path, e) from e
            return _checked(resp, ok_statuses)
        raise AssertionError("unreachable")

    def begin(self, method: str, path: str, json: Any, timeout: float | None = None) -> Pending:
        """A call sent once (never a GET), written now on the lean wire; its answer read by `result()`."""
        assert method != "GET", "a begun call is sent once; GETs are retried"
        try:
            read = self._send(method, path, json, None, timeout)
        except _TRANSPORT_ERRORS as e:
            raise self._gone(method, path, e) from e

        def answer() -> Any:
            try:
                resp = read()
            except _TRANSPORT_ERRORS as e:
                raise self._gone(method, path, e) from e
            return _checked(resp, ()).json()

        return ReadOnce(answer) if self._lean is not None else self._readers.submit(answer)

    def _send(self, method: str, path: str, json: Any, params: dict[str, Any] | None,
              timeout: float | None) -> Callable[[], httpx.Response]:
        t = timeout if timeout is not None else self.timeout
        if self._lean is not None:
            return self._lean.begin(method, path, json=json, params=params, timeout=t)
        return lambda: self._http.request(method, path, json=json, params=params, timeout=t)

    def _gone(self, method: str, path: str, e: BaseException) -> SidecarConnectionError:
        return SidecarConnectionError(f"{method} {self.url}{path}: {type(e).__name__}: {e}")


def error_from_response(resp: httpx.Response) -> SidecarHTTPError:
    """The typed error of an error response, from the sidecar's {"error": {...}} body."""
    try:
        body = resp.json()
    except ValueError:
        body = None
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict):
        err = {"type": resp.reason_phrase or "HTTPError", "message": resp.text[:500]}
    cls = error_class(resp.status_code, str(err.get("type")))
    return cls(resp.status_code, str(err.get("type")), str(err.get("message")), err.get("field"), err.get("rank"), body)


def _checked(resp: httpx.Response, ok_statuses: tuple[int, ...]) -> httpx.Response:
    if resp.is_error and resp.status_code not in ok_statuses:
        raise error_from_response(resp)
    return resp


def lean_wire_applies(url: str) -> bool:
    """True for an http:// URL that no proxy of the environment covers (httpx would route it through one)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        return False
    proxies = urllib.request.getproxies_environment()
    if not (proxies.get("http") or proxies.get("all")):
        return True
    return bool(urllib.request.proxy_bypass_environment(parts.hostname, proxies))


class KeepAliveWire:
    """Requests to one http:// origin over a small pool of kept-alive connections. Thread-safe."""

    def __init__(self, url: str, headers: dict[str, str]) -> None:
        parts = urllib.parse.urlsplit(url)
        assert parts.scheme == "http" and parts.hostname, url
        self.host, self.port = parts.hostname, parts.port or 80
        self.base_path = parts.path.rstrip("/")
        self.headers = {"Accept": "application/json", **headers}
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()
        self._closed = False

    def begin(self, method: str, path: str, *, json: Any = None, params: dict[str, Any] | None = None,
              timeout: float) -> Callable[[], httpx.Response]:
        """Write the request now; the returned callable (call it once, from any thread) reads its answer.
        Why split: the sync writes its update here, before the sender's send() starts its Python work (a
        worker thread would need the GIL that send() holds just to write it, while the ranks wait)."""
        target = self.base_path + path
        if params:
            # httpx's spelling of values: true/false for bools, "" for None
            query = {k: ("true" if v else "false") if isinstance(v, bool) else "" if v is None else v
                     for k, v in params.items()}
            target += "?" + urllib.parse.urlencode(query, doseq=True)
        headers = dict(self.headers)
        body = None
        if json is not None:
            body = jsonlib.dumps(json, separators=(",", ":"), allow_nan=False).encode()
            headers["Content-Type"] = "application/json"
        conn = self._take(timeout)
        try:
            conn.request(method, target, body=body, headers=headers)
        except BaseException:
            conn.close()
            raise

        def answer() -> httpx.Response:
            try:
                resp = conn.getresponse()
                content = resp.read()
            except BaseException:
                conn.close()
                raise
            self._give_back(conn, not resp.will_close)
            return httpx.Response(resp.status, headers=resp.getheaders(), content=content)

        return answer

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def _take(self, timeout: float) -> http.client.HTTPConnection:
        while True:
            with self._lock:
                if self._closed:
                    raise OSError("the client is closed")
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                return http.client.HTTPConnection(self.host, self.port, timeout=timeout)
            if _dropped(conn):  # the server closed it while idle (keep-alive timeout, restart)
                conn.close()
                continue
            assert conn.sock is not None
            conn.sock.settimeout(timeout)
            return conn

    def _give_back(self, conn: http.client.HTTPConnection, reusable: bool) -> None:
        with self._lock:
            if reusable and not self._closed and len(self._idle) < _IDLE_KEPT:
                self._idle.append(conn)
                return
        conn.close()


def _dropped(conn: http.client.HTTPConnection) -> bool:
    """An idle kept-alive connection is readable only if the server closed it (or broke the protocol)."""
    sock = conn.sock
    if sock is None:
        return True
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)


class ReadOnce:
    """A begun call's answer with a future's `result()`, read on the calling thread the first time."""

    def __init__(self, read: Callable[[], Any]) -> None:
        self._read: Callable[[], Any] | None = read
        self._value: Any = None

    def result(self) -> Any:
        if self._read is not None:
            read, self._read = self._read, None
            self._value = read()  # an error is raised once, to the one caller that handles it
        return self._value
