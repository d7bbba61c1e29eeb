"""The HTTP layer's own bounds, tried with raw sockets against a real `sidecar launch` (docs/limits.md): the
request head's size and arrival time, a body that stops coming (or is shorter than its Content-Length),
slowloris clients (a head or a body a byte at a time) cut off while /health answers, a 413 the client
actually reads, a connection cap that closes idle connections instead of starving /health, and every
error of the server itself in the JSON error shape (HEAD /health, /generate/). Every test runs against
both of uvicorn's parsers: httptools (the server extra) and h11 (a machine without it)."""

from __future__ import annotations

import json
import os
import select
import socket
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from tests.helpers_sidecar import REPO, Sidecar, launch

pytestmark = pytest.mark.slow  # every test here starts real processes or runs for seconds

LIMITS = ("--max-header-kb", "8", "--header-timeout-s", "1", "--body-timeout-s", "1", "--max-connections", "12",
          "--max-body-mb", "1")


WITHOUT_HTTPTOOLS = REPO / "tests" / "without_server_extra"  # its sitecustomize hides httptools


@pytest.fixture(scope="module", params=["httptools", "h11"])
def server(request: pytest.FixtureRequest) -> Iterator[Sidecar]:
    env = None
    if request.param == "h11":
        path = os.pathsep.join(p for p in (str(WITHOUT_HTTPTOOLS), str(REPO), os.environ.get("PYTHONPATH", "")) if p)
        env = {"PYTHONPATH": path}
    proc = launch(*LIMITS, "--log-level", "info", "--log-format", "json", env=env)
    try:
        start = next(r for r in map(json.loads, proc.log.splitlines()) if r.get("event") == "start")
        assert start["http"] == request.param, start  # the parser the test means is the one serving
        yield proc
    finally:
        assert proc.stop() == 0, proc.log


def _connect(server: Sidecar) -> socket.socket:
    parts = urlsplit(server.url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=30)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes (a reset is a failure: the answer was lost)."""
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def _answer(raw: bytes) -> tuple[int, dict[str, Any]]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body)["error"]


def _healthy(server: Sidecar) -> None:
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200


def test_an_oversized_head_is_a_431_in_the_json_shape(server: Sidecar) -> None:
    with _connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        for _ in range(64):  # 64 x 1 KiB of headers: 8 KiB is the limit
            try:
                sock.sendall(b"X-Pad: " + b"p" * 1024 + b"\r\n")
            except (BrokenPipeError, ConnectionResetError):
                break
        status, error = _answer(_read_all(sock))
    assert status == 431 and error["field"] == "headers" and "--max-header-kb" in error["message"]
    _healthy(server)


def test_a_head_that_stops_coming_is_a_408_and_a_silent_connection_is_closed(server: Sidecar) -> None:
    with _connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow")  # and nothing more
        status, error = _answer(_read_all(sock))
    assert status == 408 and "--header-timeout-s" in error["message"]
    with _connect(server) as sock:
        t0 = time.monotonic()
        assert _read_all(sock) == b""  # closed by the server after --header-timeout-s, nothing said
        assert time.monotonic() - t0 < 20
    _healthy(server)


def test_a_body_shorter_than_its_content_length_is_a_408(server: Sidecar) -> None:
    with _connect(server) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompts\": [")
        status, error = _answer(_read_all(sock))
    assert status == 408 and error["field"] == "body" and "--body-timeout-s" in error["message"]
    _healthy(server)


def _cut_off(sock: socket.socket) -> bool:
    """The server answered or closed: the socket has something to read (an answer, or EOF)."""
    return bool(select.select([sock], [], [], 0)[0])


def _trickle(server: Sidecar, sock: socket.socket, data: bytes, then_wait: bool, limit_s: float = 60.0) -> None:
    """A slowloris: send `data` a byte at a time, then (`then_wait`) send nothing more, asking /health
    between bytes and while waiting, until the server cuts the connection off. Fails if it was not cut
    off within `limit_s` (far past the bounds the server is launched with) or, without `then_wait`, if
    every byte went through."""
    t0 = time.monotonic()
    with httpx.Client(timeout=30) as health:
        for i in range(len(data) + (10**9 if then_wait else 0)):
            if _cut_off(sock):
                return
            if i < len(data):
                try:
                    sock.sendall(data[i:i + 1])
                except (BrokenPipeError, ConnectionResetError):
                    return
            assert health.get(f"{server.url}/health").status_code == 200  # the others are served meanwhile
            assert time.monotonic() - t0 < limit_s, f"not cut off after {limit_s} s ({min(i + 1, len(data))} bytes)"
            time.sleep(0.01)
    raise AssertionError(f"all {len(data)} bytes went through without the server cutting the connection")


def test_a_slowloris_head_is_cut_off_at_the_header_timeout(server: Sidecar) -> None:
    """A head sent a byte at a time never completes: 408 once --header-timeout-s passed since its first
    byte, although bytes keep coming (under --max-header-kb, so that limit is not what cuts it)."""
    with _connect(server) as sock:
        _trickle(server, sock, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"s" * 7000, then_wait=False)
        status, error = _answer(_read_all(sock))
    assert status == 408 and error["field"] == "headers" and "--header-timeout-s" in error["message"]
    _healthy(server)


def test_a_slowloris_body_is_cut_off_once_it_stalls(server: Sidecar) -> None:
    """A body trickled a byte at a time and then held (a Content-Length it never reaches): 408 naming the
    body once no byte came for --body-timeout-s; /health answered all along."""
    with _connect(server) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100000\r\n\r\n")
        _trickle(server, sock, b'{"prompts": ["' + b"x" * 20 + b'"', then_wait=True)
        status, error = _answer(_read_all(sock))
    assert status == 408 and error["field"] == "body" and "--body-timeout-s" in error["message"]
    _healthy(server)


def test_a_body_that_never_stalls_but_trickles_is_cut_off_at_its_whole_deadline(server: Sidecar) -> None:
    """A byte every few ms never trips the stall timeout: the whole body must come within --body-timeout-s
    plus its length at guard.MIN_BODY_RATE (1 s + 8000 B at 16 KiB/s here), or 408 naming the body."""
    with _connect(server) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 8000\r\n\r\n")
        t0 = time.monotonic()
        _trickle(server, sock, b'{"prompts": ["' + b"x" * 7980 + b'"]}', then_wait=False)
        status, error = _answer(_read_all(sock))
    assert status == 408 and error["field"] == "body" and "sends too slowly" in error["message"], error
    assert time.monotonic() - t0 < 30  # cut off near 1.5 s, not after the 8000 bytes (minutes at this pace)
    _healthy(server)


def test_an_oversized_body_is_answered_413_not_reset(server: Sidecar) -> None:
    body = b'{"prompts": ["' + b"x" * (4 << 20) + b'"]}'  # 4 MiB over --max-body-mb 1
    for _ in range(3):
        resp = httpx.post(f"{server.url}/generate", content=body, headers={"content-type": "application/json"},
                          timeout=30)
        assert resp.status_code == 413 and resp.json()["error"]["field"] == "body"


def test_idle_connections_past_the_cap_make_room_for_health(server: Sidecar) -> None:
    idle = [_connect(server) for _ in range(30)]  # --max-connections 12
    try:
        for sock in idle:  # each holds a connection open without sending a byte
            sock.setblocking(True)
        for _ in range(5):
            _healthy(server)
        closed = 0
        for sock in idle[:10]:  # the oldest were closed to make room
            sock.settimeout(30)
            closed += _read_all(sock) == b""
        assert closed == 10
    finally:
        for sock in idle:
            sock.close()


def test_the_servers_own_errors_are_json(server: Sidecar) -> None:
    assert httpx.head(f"{server.url}/health", timeout=30).status_code == 200
    resp = httpx.post(f"{server.url}/generate/", json={"prompts": ["a"]}, timeout=30)
    assert resp.status_code == 404 and resp.json()["error"]["type"] == "NotFound"
    with _connect(server) as sock:
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        status, error = _answer(_read_all(sock))
    assert status == 400 and error["type"] == "MalformedRequest"
