"""`KeepAliveWire`: the HTTP/1.1 transport of `SidecarClient` to a plain-http sidecar, on kept-alive
connections (http.client, one per concurrent caller), answering with httpx.Response objects.

Why not httpx's own machinery for these calls: a weight sync is one small control message whose whole
server-side cost is a fraction of a millisecond, and httpx with httpcore spends about 0.35 ms of Python per
request building and parsing (measured on a 2-core CPU box: POST /pause 0.65 ms through httpx, 0.29 ms
through http.client, 0.2 ms with a raw socket). The client still uses httpx where this wire does not
apply: an https URL, an HTTP proxy configured in the environment (httpx honours it), or a `transport`
given by the caller (tests count and fake the wire through it).

Also here: how SidecarClient reads a deferred answer, `ReadOnce` (on the calling thread, once send()
returned: the one-request sync, no thread hop) and `join_both` (a call beside local work, the sidecar's
error first).

Invariants: a connection serves one request at a time (the pool hands it out, the caller returns it
after reading the whole answer); a connection that may hold half an exchange (any error) is closed, never
pooled; an idle connection the server closed (keep-alive timeout) is noticed before it is used, so a POST
is never written to a socket already known dead. Errors are OSError or http.client.HTTPException, for the
caller to turn into SidecarConnectionError.
"""

from __future__ import annotations

import http.client
import json as jsonlib
import select
import threading
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any

import httpx

from inference.core import SidecarError

_IDLE_KEPT = 4  # idle connections kept: a sync uses two at once (update beside finish)


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
        Why split: SidecarClient writes a weight update here, before the sender's send() starts its
        Python work, and only the wait for the answer goes to a worker thread (which would otherwise need
        the GIL that send() holds just to write the request, while the ranks wait for it)."""
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
    """A deferred answer with a future's `result()`, read on the calling thread the first time."""

    def __init__(self, read: Callable[[], Any]) -> None:
        self._read: Callable[[], Any] | None = read
        self._value: Any = None

    def result(self) -> Any:
        if self._read is not None:
            read, self._read = self._read, None
            self._value = read()  # an error is raised once, to the one caller that handles it
        return self._value


def join_both(fut: Any, local: Any) -> Any:
    """Run `local()` while `fut` (an HTTP call) runs; the sidecar's error wins (it names the rank)."""
    try:
        result = local()
    except BaseException:
        try:
            fut.result()
        except SidecarError as remote:
            raise remote from None
        raise
    fut.result()
    return result
