"""SidecarClient's lean wire (trainer_hooks/wire.py) against a stdlib HTTP/1.1 server: kept-alive
connections, a connection the server dropped while idle, a deferred POST written before its answer is read,
the typed errors, and when httpx carries the calls instead (https, a proxy)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from tests.helpers_tp import free_port
from trainer_hooks.client import SidecarClient, SidecarConnectionError, SidecarStateError
from trainer_hooks.wire import lean_wire_applies


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.connections = 0
        self.arrived = threading.Event()  # a POST /slow arrived
        self.release = threading.Event()  # /slow may answer
        self.close_after_answer = False


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def setup(self) -> None:
        super().setup()
        self.server.connections += 1

    def log_message(self, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/slow":
            self.server.arrived.set()
            self.server.release.wait(10)
        if self.path == "/conflict":
            self._answer(409, {"error": {"type": "StateError", "message": "torn", "field": "model", "rank": "tp0"}})
            return
        self._answer(200, {"echo": body, "path": self.path})

    def do_GET(self) -> None:
        self._answer(200, {"status": "ok", "path": self.path})

    def _answer(self, status: int, obj: Any) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        # Closing without a "Connection: close" header: the client learns it only when it reuses the socket.
        self.close_connection = self.server.close_after_answer


@pytest.fixture
def server() -> Iterator[_Server]:
    srv = _Server()
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _client(srv: _Server, **kw: Any) -> SidecarClient:
    host, port = srv.server_address[:2]
    c = SidecarClient(f"http://{host}:{port}", timeout=10, backoff_s=0.0, **kw)
    assert c.wire._lean is not None, "a plain http URL without a proxy takes the lean wire"
    return c


def test_calls_share_one_kept_alive_connection(server: _Server) -> None:
    with _client(server) as c:
        for i in range(5):
            assert c._post("/weights/finish", {"i": i}) == {"echo": {"i": i}, "path": "/weights/finish"}
        assert c._get("/state", params={"a": 1}) == {"status": "ok", "path": "/state?a=1"}
    assert server.connections == 1


def test_a_connection_the_server_closed_while_idle_is_replaced(server: _Server) -> None:
    server.close_after_answer = True
    with _client(server) as c:
        for i in range(3):
            assert c._post("/weights/update", {"i": i})["echo"] == {"i": i}  # a POST is never retried: the
            time.sleep(0.05)  # wire must see the dropped socket before it writes
    assert server.connections == 3


def test_a_deferred_post_is_written_before_its_answer_is_read(server: _Server) -> None:
    with _client(server) as c:
        pending = c.wire.begin("POST", "/slow", {"start": 1})
        assert server.arrived.wait(5), "the request reached the server before anyone read its answer"
        server.release.set()
        assert pending.result() == {"echo": {"start": 1}, "path": "/slow"}


def test_error_answers_and_a_dead_port_raise_typed_errors(server: _Server) -> None:
    with _client(server) as c:
        with pytest.raises(SidecarStateError) as e:
            c._post("/conflict", {})
        assert (e.value.status, e.value.field, e.value.rank) == (409, "model", "tp0")
        assert c._post("/after", {})["path"] == "/after", "the connection stays usable after an error answer"
    port = free_port()  # nobody listens on it once closed
    with SidecarClient(f"http://127.0.0.1:{port}", timeout=2, retries=1, backoff_s=0.0) as c:
        with pytest.raises(SidecarConnectionError, match=r"GET .*/health"):
            c.health()
        with pytest.raises(SidecarConnectionError, match=r"POST .*/weights/abort"):
            c.abort_weights()


def test_httpx_carries_https_and_proxied_urls(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY", "no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    assert lean_wire_applies("http://127.0.0.1:8000")
    assert not lean_wire_applies("https://sidecar.example:8000")
    monkeypatch.setenv("http_proxy", "http://proxy.example:3128")
    assert not lean_wire_applies("http://sidecar.example:8000")
    monkeypatch.setenv("no_proxy", "sidecar.example")
    assert lean_wire_applies("http://sidecar.example:8000")
