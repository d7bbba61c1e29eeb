"""The HTTP layer's own bounds, tried with raw sockets against a real `sidecar launch` (docs/limits.md): the
request head's size and arrival time, a body that stops coming (or is shorter than its Content-Length),
a 413 the client actually reads, a connection cap that closes idle connections instead of starving
/health, and every error of the server itself in the JSON error shape (HEAD /health, /generate/)."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from tests.helpers_sidecar import Sidecar, launch

pytestmark = pytest.mark.slow  # every test here starts real processes or runs for seconds

LIMITS = ("--max-header-kb", "8", "--header-timeout-s", "1", "--body-timeout-s", "1", "--max-connections", "12",
          "--max-body-mb", "1")


@pytest.fixture(scope="module")
def server() -> Iterator[Sidecar]:
    proc = launch(*LIMITS)
    yield proc
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
