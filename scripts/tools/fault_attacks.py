"""The attacks of scripts/tools/fault_load.py: the sidecar's LIMITS under test (small, so each attack is
cheap and its timeout fits the run), ABUSES (JSON requests at and past each limit, with the status and
field each must get) and RAW_ATTACKS (below HTTP: big headers, slow bodies, idle connections), each a
coroutine that runs one attempt and says "expected ..." or "unexpected ..."."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

MIB = 1 << 20
PAUSE_LEASE_S = 1.0  # the pauser's lease; the sidecar's --max-pause-s is twice it
# The sidecar's limits under test: small ones, so each attack is cheap to send and its timeout fits the run.
LIMITS = {"max_body_mb": 1, "max_prompt_chars": 20_000, "max_request_sequences": 16,
          "max_pause_s": 2 * PAUSE_LEASE_S, "max_stops": 64, "max_stop_chars": 2048, "max_chat_messages": 64,
          "max_response_tokens": 32_768, "max_header_kb": 8, "header_timeout_s": 2.0, "body_timeout_s": 1.0}
IDLE_CONNECTIONS = 300  # held open at once by the idle-connection attack, then released
LINGER_S = 2.0  # how long the sidecar drops a refused body's bytes before it closes (sidecar/api/connection.py)
# Each abuse: the route it goes to, the statuses it may get, and the field a refusal must name (None: any
# field; sidecar/api/common.py). A 200 is served work (an abuse at a limit, not past it); a 409 of the
# default mode (asleep or torn) is the state's answer, not the abuse's.
ABUSES: dict[str, tuple[str, tuple[int, ...], str | None]] = {
    "oversized_body": ("/generate", (413,), "body"), "long_prompt": ("/generate", (400,), None),
    "malformed_json": ("/generate", (400,), None), "bad_value": ("/generate", (400, 422), None),
    "lone_surrogate": ("/generate", (400,), None), "too_many_sequences": ("/generate", (400, 429), None),
    "shape_integers": ("/weights/update", (400,), None),
    "stops_at_limit": ("/generate", (200, 409), None),
    "too_many_stops": ("/generate", (400,), "sampling_params.stop"),
    "too_many_stop_ids": ("/generate", (400,), "sampling_params.stop_token_ids"),
    "stop_chars": ("/generate", (400,), "sampling_params.stop"),
    "too_many_messages": ("/v1/chat/completions", (400,), "messages"),
    "answer_bomb": ("/generate", (400,), "sampling_params.max_tokens")}
# Attacks that are no JSON request (idle connections, partial headers, huge headers, ...): name -> a
# coroutine given the sidecar's URL that runs one attempt and returns its outcome, "expected <what>" or
# "unexpected <what>". Registered by whoever bounds that layer; run in turn beside ABUSES.
RAW_ATTACKS: dict[str, Callable[[str], Awaitable[str]]] = {}


def abuse_body(kind: str) -> tuple[bytes, dict[str, str]]:
    """One hostile request body of this kind (JSON content type unless the kind is about JSON itself)."""
    sampling = {"max_tokens": 2}
    huge = int("9" * 4000)  # a shape's product of these used to freeze the event loop
    stops = int(LIMITS["max_stops"])
    per = int(LIMITS["max_stop_chars"]) // stops  # each stop string this long: all of them exactly at the limit
    shape = {"name": "w", "dtype": "float32", "shape": [huge] * 60, "digest": "0" * 32}
    bodies: dict[str, Any] = {
        "oversized_body": {"prompts": ["x" * (int(LIMITS["max_body_mb"]) * MIB + 1)]},
        "shape_integers": {"start": {"version": 1, "manifest": {"tensors": [shape]}}},
        "long_prompt": {"prompts": ["y" * (LIMITS["max_prompt_chars"] + 1)], "sampling_params": sampling},
        "bad_value": {"prompts": ["ok"], "sampling_params": {"temperature": -1.0, "max_tokens": 2}},
        "too_many_sequences": {"prompts": ["ok"], "sampling_params": {"n": LIMITS["max_request_sequences"] + 1}},
        # At the limits: as many stop strings (their characters too) and stop ids as one prompt may carry.
        "stops_at_limit": {"prompts": ["stop here"], "sampling_params": {
            "max_tokens": 2, "stop": [f"{i:0{per}d}" for i in range(stops)], "stop_token_ids": list(range(stops))}},
        "too_many_stops": {"prompts": ["ok"], "sampling_params": {"max_tokens": 2,
                                                                  "stop": [str(i) for i in range(stops + 1)]}},
        "too_many_stop_ids": {"prompts": ["ok"], "sampling_params": {"max_tokens": 2,
                                                                     "stop_token_ids": list(range(stops + 1))}},
        "stop_chars": {"prompts": ["ok"], "sampling_params": {"max_tokens": 2,
                                                              "stop": ["z" * (int(LIMITS["max_stop_chars"]) + 1)]}},
        "too_many_messages": {"messages": [{"role": "user", "content": "m"}] * (int(LIMITS["max_chat_messages"]) + 1),
                              "max_tokens": 2},
        # n x max_tokens x (1 + logprobs) = 16 x 100 x 21 = 33,600 past --max-response-tokens: a ~100-byte body.
        "answer_bomb": {"prompts": ["ok"], "sampling_params": {"n": LIMITS["max_request_sequences"],
                                                               "max_tokens": 100, "logprobs": 20}},
    }
    headers = {"content-type": "application/json"}
    if kind == "malformed_json":
        return b'{"prompts": ["unterminated', headers
    if kind == "lone_surrogate":
        return b'{"prompts": ["\\ud800 alone"], "sampling_params": {"max_tokens": 2}}', headers
    return json.dumps(bodies[kind]).encode(), headers


# ---- attacks below HTTP: raw sockets ----------------------------------------------------------------


async def _open(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = url.removeprefix("http://").rstrip("/").rsplit(":", 1)
    return await asyncio.open_connection(host, int(port))


async def _answer_then_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                             timeout_s: float) -> tuple[int, dict[str, Any]]:
    """Everything the server sends until it closes the connection, as (status, its JSON error); a reset
    before the answer (the answer lost) is (0, {})."""
    try:
        raw = await asyncio.wait_for(reader.read(), timeout_s)
    except (ConnectionResetError, BrokenPipeError):
        raw = b""
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    try:
        return int(head.split(b" ", 2)[1]), dict(json.loads(body).get("error") or {})
    except (IndexError, ValueError, AttributeError):
        return 0, {}


def _verdict(status: int, error: dict[str, Any], want: int, field_name: str) -> str:
    ok = status == want and error.get("field") == field_name
    return f"{'expected' if ok else 'unexpected'} {status} field {error.get('field')}"


async def big_header(url: str) -> str:
    """Headers past --max-header-kb, 1 KiB at a time: 431 in the JSON shape naming `headers`, then closed.
    The sidecar drops what still comes for LINGER_S after its answer, then closes: an upload slower than
    that (this script's own busy loop) may lose the answer to the reset, as an oversized body may."""
    reader, writer = await _open(url)
    t = time.monotonic()
    try:
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        for _ in range(2 * int(LIMITS["max_header_kb"])):
            writer.write(b"X-Pad: " + b"p" * 1024 + b"\r\n")
            await writer.drain()
    except (BrokenPipeError, ConnectionResetError):
        pass  # refused while still sending: the answer is read below
    status, error = await _answer_then_close(reader, writer, 30)
    if status == 0 and time.monotonic() - t > LINGER_S:
        return "expected answer lost after a slow upload"
    return _verdict(status, error, 431, "headers")


async def slow_body(url: str) -> str:
    """A Content-Length larger than the body sent: 408 naming `body` after --body-timeout-s, then closed."""
    reader, writer = await _open(url)
    writer.write(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100\r\n\r\n{\"prompts\": [")
    await writer.drain()
    return _verdict(*await _answer_then_close(reader, writer, float(LIMITS["body_timeout_s"]) + 30), 408, "body")


async def idle_connections(url: str) -> str:
    """IDLE_CONNECTIONS connections opened at once and held without a byte, /health asked on one more
    meanwhile (it must answer 200), then all released."""
    import httpx

    held = await asyncio.gather(*(_open(url) for _ in range(IDLE_CONNECTIONS)), return_exceptions=True)
    try:
        opened = sum(not isinstance(h, BaseException) for h in held)
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            status = (await http.get("/health")).status_code
    finally:
        for h in held:
            if not isinstance(h, BaseException):
                h[1].close()
    ok = opened == IDLE_CONNECTIONS and status == 200
    return f"{'expected' if ok else 'unexpected'} held, /health {status}" + ("" if ok else f", {opened} opened")


RAW_ATTACKS.update({"big_header": big_header, "slow_body": slow_body, "idle_connections": idle_connections})
