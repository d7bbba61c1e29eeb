"""Issue 20: the HTTP API fuzzed from its own OpenAPI schema (schemathesis, valid and invalid bodies and
query strings) over every route of a real `sidecar launch` of the tiny model on CPU.

Properties, per example: no 5xx but the documented state codes (502 wire, 503 rank dead, 507 wake OOM);
every error body has the shape sidecar/server_common.error_response writes, and every input error
(400, 401, 413, 422) names its field. After the run: the launcher and its rank live on, and greedy
output equals LLM.generate's on the same tiny model.

Each example starts from a serving sidecar: an example that put it to sleep, paused it, or dropped its
weights (sleep level 2) is followed by wake_up / resume / a re-sync of the tiny model's own weights
over gloo, so the generation routes are fuzzed awake rather than answering 409 for the rest of the run.
Headers and query strings are fuzzed too, as raw bytes on a socket (no client library cleans them):
arbitrary header names and values (Content-Length and Transfer-Encoding included), arbitrary request
targets; every request is answered, in the JSON error shape when it is an error, never a 5xx.
Bounded to about 2 minutes on a 2-core CPU box (EXAMPLES per route, --max-model-len keeps outputs short).
"""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")  # the dev extra installs it; CI always has it

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from inference.core import SamplingParams  # noqa: E402
from inference.engine.llm import LLM  # noqa: E402
from inference.models.tiny import DEFAULT_TINY, default_model_dir, random_weights  # noqa: E402
from inference.transfer.sender import WeightSender  # noqa: E402
from tests.helpers_sidecar import KV_BYTES, Sidecar, launch  # noqa: E402
from trainer_hooks.client import SidecarClient  # noqa: E402

pytestmark = pytest.mark.slow  # every test here starts real processes or runs for seconds

EXAMPLES = 80  # per route: 17 routes x 80 examples take ~75 s here
LIMITS = ("--max-body-mb", "1", "--max-prompt-chars", "20000", "--max-request-sequences", "16",
          "--max-queued-sequences", "64", "--max-model-len", "128", "--header-timeout-s", "2", "--body-timeout-s", "2",
          "--max-header-kb", "16")
STATE_CODES = {502, 503, 507}  # documented: wire failure, rank dead, wake out of memory
FIELD_CODES = {400, 401, 413, 422}  # errors caused by one input value: the body names it
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = ["The miller's daughter", [11, 12, 13, 14]]


@pytest.fixture(scope="module")
def fuzzed() -> Iterator[Sidecar]:
    server = launch(*LIMITS)
    try:
        yield server
    finally:
        assert server.stop() == 0, server.log


@pytest.fixture(scope="module")
def operations(fuzzed: Sidecar) -> list[Any]:
    """Every route of the served OpenAPI schema (schemathesis parses it; hypothesis drives the examples
    directly, so the test does not lean on schemathesis' pytest plugin, which broke on pytest 9.2)."""
    schema = schemathesis.openapi.from_url(f"{fuzzed.url}/openapi.json")
    return [result.ok() for result in schema.get_all_operations()]


def check_response(label: str, status: int, body: Any) -> None:
    """The per-example properties (see the module docstring)."""
    assert status < 500 or status in STATE_CODES, f"{label}: undocumented {status}: {body}"
    if status < 400:
        return
    assert isinstance(body, dict) and isinstance(body.get("error"), dict), f"{label}: {status} body {body}"
    error = body["error"]
    assert set(error) >= {"type", "message", "field", "rank"} and error["type"] and error["message"], error
    if status in FIELD_CODES:
        assert isinstance(error["field"], str) and error["field"], f"{label}: {status} names no field: {error}"


def restore(c: SidecarClient) -> None:
    """Bring the sidecar back to serving: resume, wake everything, re-sync the tiny model's weights
    when a level-2 sleep dropped them (a fresh gloo sender each time: the fuzzer may have re-inited)."""
    state = c.state()
    if state["paused"]:
        c.resume()
    if state["sleeping"] or any(tag != "awake" for tag in state["tags"].values()):
        c.wake_up()
        state = c.state()
    if not state["ready"] or any(state["torn"].values()):
        sender = WeightSender("gloo", num_receivers=len(state["ranks"]), timeout_s=60)
        try:
            c.connect_sender(sender)
            version = max(state["weight_versions"].values()) + 1
            assert c.sync_weights(sender, random_weights(DEFAULT_TINY), version=version)["ok"]
        finally:
            sender.close()


def test_unparsable_body_is_a_400_naming_the_body(fuzzed: Sidecar) -> None:
    """Found by the fuzzer: bytes that are not UTF-8 under a JSON content type got FastAPI's own 400
    with no field; the body is the culprit, and the connection stays usable."""
    with httpx.Client(base_url=fuzzed.url, timeout=60) as http:
        resp = http.post("/generate", content=b'\xff\xfe{"prompts', headers={"content-type": "application/json"})
        assert resp.status_code == 400 and resp.json()["error"]["field"] == "body", resp.text
        check_response("POST /generate", resp.status_code, resp.json())
        assert http.get("/health").status_code == 200


def fuzz_one_route(operation: Any, fuzzed: Sidecar) -> int:
    """EXAMPLES cases of one route, valid and invalid (schemathesis' positive and negative modes);
    returns how many ran."""
    ran = []
    cases = st.one_of(*(operation.as_strategy(generation_mode=mode) for mode in schemathesis.GenerationMode))

    @given(case=cases)
    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def run(case: Any) -> None:
        response = case.call(base_url=fuzzed.url, timeout=60)
        try:
            body = response.json()
        except ValueError:
            body = response.text
        check_response(f"{case.method} {case.path}", response.status_code, body)
        ran.append(response.status_code)
        if case.path in ("/sleep", "/pause", "/weights/init") and response.status_code < 300:
            with SidecarClient(fuzzed.url, timeout=120) as c:
                restore(c)

    run()
    return len(ran)


@pytest.mark.slow
def test_every_route_holds_under_fuzzing(operations: list[Any], fuzzed: Sidecar) -> None:
    labels = {op.label for op in operations}
    assert {"POST /generate", "POST /weights/update", "GET /health", "POST /audit"} <= labels, labels
    for operation in operations:
        assert fuzz_one_route(operation, fuzzed) > 0, operation.label


@pytest.mark.slow
def test_still_serves_fresh_greedy_output_after_fuzzing(fuzzed: Sidecar) -> None:
    """Runs after the fuzzing above (file order): the same launcher, its ranks alive, the fresh model's
    greedy tokens."""
    assert fuzzed.proc.poll() is None, fuzzed.log
    with SidecarClient(fuzzed.url, timeout=120) as c:
        restore(c)
        state = c.state()
        assert state["healthy"] and all(r["alive"] for r in state["ranks"]), state
        got = [o.outputs[0].token_ids for o in c.generate(PROMPTS, GREEDY)]
    reference = LLM(default_model_dir(), device="cpu", kv_cache_bytes=KV_BYTES)
    assert got == [o.outputs[0].token_ids for o in reference.generate(PROMPTS, GREEDY)]


# ---- headers and query strings, as raw bytes ---------------------------------------------------------
TOKEN = "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
SPECIAL = ["content-length", "transfer-encoding", "content-type", "authorization", "expect", "connection",
           "host", "accept-encoding"]
header_names = st.one_of(st.sampled_from(SPECIAL), st.text(TOKEN, min_size=1, max_size=30),
                         st.binary(min_size=1, max_size=30))
header_values = st.one_of(st.sampled_from([b"-1", b"abc", b"99999999999999999999", b"chunked", b"gzip, chunked",
                                           b"100-continue", b"close", b"application/json", b"Bearer \xff"]),
                          st.binary(max_size=200), st.text(max_size=100).map(lambda t: t.encode("utf-8", "replace")))
headers = st.lists(st.tuples(header_names, header_values), max_size=6)
targets = st.one_of(st.binary(max_size=80), st.text(max_size=60).map(lambda t: t.encode("utf-8", "replace")))
ROUTES = [("GET", "/health"), ("GET", "/state"), ("GET", "/checksums"), ("POST", "/generate"),
          ("POST", "/v1/completions"), ("GET", "/v1/models"), ("HEAD", "/health")]
BODY = json.dumps({"prompts": ["a"], "sampling_params": {"max_tokens": 2}}).encode()


def _name(n: str | bytes) -> bytes:
    return n.encode() if isinstance(n, str) else n


def raw_exchange(url: str, request: bytes, head_only: bool = False) -> tuple[int, bytes]:
    """Send `request` as is; (status, body) of the answer (after any 100 Continue). The server must answer
    before it closes. `head_only`: a HEAD's answer has no body whatever its Content-Length says."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as sock:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(request)  # refused mid-request: the answer is still to be read
        data = b""
        while not _complete(data, head_only):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    data = data.removeprefix(b"HTTP/1.1 100 Continue\r\n\r\n")
    assert data.startswith(b"HTTP/1.1 "), f"no answer to {request[:300]!r}: {data[:200]!r}"
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def _complete(data: bytes, head_only: bool) -> bool:
    data = data.removeprefix(b"HTTP/1.1 100 Continue\r\n\r\n")
    head, sep, body = data.partition(b"\r\n\r\n")
    if not sep:
        return False
    if head_only:
        return True
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value)
    return False  # no length: read until the server closes


def check_raw(label: str, request: bytes, status: int, body: bytes) -> None:
    parsed: Any = body.decode("utf-8", "replace")
    if status >= 400:
        assert body, f"{label}: {status} with no body for {request[:300]!r}"
        parsed = json.loads(body)
    check_response(label, status, parsed)


@pytest.mark.slow
def test_headers_and_query_strings_hold_under_fuzzing(fuzzed: Sidecar) -> None:
    @given(route=st.sampled_from(ROUTES), extra=headers, query=targets)
    @settings(max_examples=3 * EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def run(route: tuple[str, str], extra: list[tuple[str | bytes, bytes]], query: bytes) -> None:
        method, path = route
        body = BODY if method == "POST" else b""
        lines = [f"{method} {path}?".encode() + query + b" HTTP/1.1", b"host: fuzz",
                 b"content-type: application/json", b"content-length: " + str(len(body)).encode()]
        lines += [_name(n) + b": " + v for n, v in extra]
        request = b"\r\n".join(lines) + b"\r\n\r\n" + body
        status, answer = raw_exchange(fuzzed.url, request, head_only=method == "HEAD")
        check_raw(f"{method} {path}", request, status, answer)

    run()
    with httpx.Client(base_url=fuzzed.url, timeout=60) as http:
        assert http.get("/health").status_code == 200
