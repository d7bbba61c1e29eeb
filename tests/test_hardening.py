"""Issue 20, tried as a hostile or careless client would, against a real `sidecar launch` (TP=1, CPU, small
limits): oversized bodies and prompts are refused before any work, limits count sequences, bad inputs
are 4xx naming the field on a connection that stays usable, weight versions only grow, a request to a
sleeping sidecar is answered at once. Also, in-process: a generic 500 keeps the connection, and the
driver's token-rate window stays bounded without scrapes. The TP=2 and shutdown cases are in
tests/test_hardening_ranks.py; the audit CLI's in tests/test_audit_cli.py."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from http.client import HTTPConnection
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from torch import nn

from inference.core import CompletionOutput, RequestOutput, SamplingParams
from inference.models.tiny import TinyModelSpec, random_weights
from inference.transfer.sender import WeightSender
from sidecar.client import SidecarBusyError, SidecarClient, SidecarRequestError, SidecarStateError
from sidecar.ranks.commands import RankPlan
from tests.helpers_sidecar import Sidecar, launch
from trainer_hooks.hook import WeightSyncHook

LIMITS = ("--max-body-mb", "1", "--max-prompt-chars", "100000", "--max-request-sequences", "64",
          "--max-queued-sequences", "96")
TINY = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)


@pytest.fixture(scope="module")
def server() -> Iterator[Sidecar]:
    proc = launch(*LIMITS)
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def http(server: Sidecar) -> Iterator[httpx.Client]:
    """One kept-alive connection for a whole test: an error must not cost it."""
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def _error(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    return resp.json()["error"]


def _served(http: httpx.Client) -> None:
    resp = http.post("/generate", json={"prompts": ["still serving"], "sampling_params": {"max_tokens": 2}})
    assert resp.status_code == 200, resp.text


# ---- item 1: sizes are checked before any work ---------------------------------------------------


@pytest.mark.slow
def test_oversized_bodies_and_prompts_are_refused_before_any_work(http: httpx.Client) -> None:
    big = {"prompts": ["x" * (1 << 20)]}  # over --max-body-mb 1
    error = _error(http.post("/generate", json=big), 413)
    assert error["field"] == "body" and "--max-body-mb" in error["message"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        yield b'{"prompts": ["'
        for _ in range(40):
            yield b"y" * 65536
        yield b'"]}'

    chunked = http.post("/generate", content=chunks(), headers={"content-type": "application/json"})
    assert _error(chunked, 413)["field"] == "body"
    long_prompt = {"prompts": ["fine", "z" * 100_001], "sampling_params": {"max_tokens": 2}}
    error = _error(http.post("/generate", json=long_prompt), 400)
    assert error["field"] == "prompts[1]" and "--max-prompt-chars" in error["message"]
    _served(http)


# ---- item 6: limits count sequences (n x prompts) ------------------------------------------------


@pytest.mark.slow
def test_limits_count_sequences_not_prompts(server: Sidecar, http: httpx.Client) -> None:
    two = {"prompts": ["a", "b"], "sampling_params": {"n": 40, "max_tokens": 2}}  # 80 > 64 in one call
    error = _error(http.post("/generate", json=two), 400)
    assert error["field"] == "prompts" and "80 sequences" in error["message"]
    with SidecarClient(server.url, timeout=60) as c:
        c.pause()
        held: list[Any] = []
        try:
            first = threading.Thread(target=lambda: held.append(c.generate(["held"], _n(64))))
            first.start()
            _wait_until(lambda: c.state()["queued_sequences"] == 64)
            with pytest.raises(SidecarBusyError, match="sequences"):  # one prompt, but 64 + 40 > 96
                c.generate(["one prompt"], _n(40))
            second = threading.Thread(target=lambda: held.append(c.generate(["fits"], _n(32))))
            second.start()
            _wait_until(lambda: c.state()["queued_sequences"] == 96)
        finally:
            c.resume()
        first.join(120)
        second.join(120)
        assert sorted(len(outs[0].outputs) for outs in held) == [32, 64]
        assert c.state()["queued_sequences"] == 0


def _n(n: int) -> SamplingParams:
    return SamplingParams(n=n, temperature=0.0, max_tokens=2, ignore_eos=True)


def _wait_until(condition: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.05)


# ---- item 8 (and 11: versions): bad input is a 4xx naming the field; the connection stays ------------


@pytest.mark.slow
def test_bad_inputs_are_4xx_naming_the_field_on_a_connection_that_stays(server: Sidecar, http: httpx.Client) -> None:
    surrogate = '{"prompts": ["a\\ud800b"]}'  # a lone surrogate: valid JSON, not valid Unicode
    resp = http.post("/generate", content=surrogate, headers={"content-type": "application/json"})
    assert _error(resp, 400)["field"] == "prompts[0]"
    resp = http.post("/v1/completions", content='{"prompt": "\\udfff"}', headers={"content-type": "application/json"})
    assert _error(resp, 400)["field"] == "prompt[0]"
    no_entry = {"start": {"version": 1, "manifest": {}}, "update_info": []}
    assert _error(http.post("/weights/update", json=no_entry), 400)["field"] == "update_info"
    info = {"backend": "gloo", "master_host": 5, "master_port": 29500, "world_size": 2, "bucket_bytes": 1 << 20,
            "timeout_s": 30.0, "session_id": "s"}
    assert _error(http.post("/weights/init", json={"init_info": info}), 422)["field"] == "init_info.master_host"
    manifest = http.get("/checksums").json()["manifests"][0]
    error = _error(http.post("/audit", json={"expected": [manifest] * 3}), 400)
    assert error["field"] == "expected" and "second expected manifest" in error["message"]
    bad = {**manifest, "tensors": [{**manifest["tensors"][0], "dtype": ["float32"]}]}
    assert _error(http.post("/audit", json={"expected": bad}), 422)["field"] == "expected.tensors[0].dtype"
    _stale_versions_are_refused(server)
    _served(http)


def _stale_versions_are_refused(server: Sidecar) -> None:
    """Versions only grow: a sync of a version not newer than the live one is a 400 naming `version`
    (the start inside the update is refused and the sender's send() fails at once); nothing is torn."""
    weights = random_weights(TinyModelSpec(seed=8))
    sender = WeightSender("gloo", num_receivers=1, timeout_s=60)
    try:
        with SidecarClient(server.url, timeout=60) as c:
            c.connect_sender(sender)
            live = int(c.state()["weight_versions"]["target"])
            assert c.sync_weights(sender, weights, version=live + 1)["ok"]
            for stale in (live + 1, 0):
                with pytest.raises(SidecarRequestError) as e:
                    c.sync_weights(sender, weights, version=stale)
                assert e.value.field == "version", e.value
            assert c.state()["weight_versions"] == {"target": live + 1} and c.state()["torn"] == {"target": False}
    finally:
        sender.close()


def test_a_generic_500_keeps_the_connection() -> None:
    """A bug in a handler (here: the driver's queue_depth raises) is a JSON 500, and the same TCP
    connection then serves the next request (Starlette's own 500 path closed it)."""
    import uvicorn

    from sidecar.api.app import ServerState, create_app
    from sidecar.api.metrics import Metrics
    from sidecar.config import LaunchConfig

    driver = _BrokenDriver()
    plan = RankPlan(**{"rank": "dp0:pp0:tp0", "pid": 1, "device": "cpu", "weights_bytes": {}, "kv_blocks": 1,
                       "kv_bytes": 1,
            "vocab_size": 512, "max_model_len": 64, "model": "m", "draft_model": None, "models": ("target",),
            "dtype": "float32", "block_size": 16, "has_tokenizer": False, "num_threads": 1})
    app = create_app(ServerState(driver, LaunchConfig(), [plan], Metrics(driver)))  # type: ignore[arg-type]
    sock = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, lifespan="off", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        _wait_until(lambda: server.started, 30)
        conn = HTTPConnection("127.0.0.1", sock.getsockname()[1], timeout=30)
        conn.request("GET", "/state")
        first = conn.getresponse()
        body = first.read()
        assert first.status == 500 and b'"type":"RuntimeError"' in body, body
        assert (first.getheader("connection") or "").lower() != "close"
        conn.request("GET", "/health")  # the same socket
        second = conn.getresponse()
        assert second.status == 200 and b'"ok"' in second.read()
        conn.close()
    finally:
        server.should_exit = True
        thread.join(30)


class _BrokenDriver:
    failure = None
    failure_rank = None
    paused = False
    busy = None
    statuses: list[Any] = [None]  # noqa: RUF012
    tokens_total = 0
    pool = SimpleNamespace(alive=lambda: [True])

    def queue_depth(self) -> int:
        raise RuntimeError("a bug in the driver")

    def rank_alive(self) -> list[bool]:
        return [True]

    def held_weights(self) -> dict[str, Any]:
        return {}

    def queued_sequences(self) -> int:
        return 0

    def tokens_per_second(self) -> float:
        return 0.0


# ---- item 12: a sleeping sidecar answers at once --------------------------------------------------


@pytest.mark.slow
def test_a_request_to_a_sleeping_sidecar_is_answered_at_once(server: Sidecar) -> None:
    with SidecarClient(server.url, timeout=20, long_timeout=20) as c:
        c.sleep(level=1)
        try:
            t0 = time.monotonic()
            with pytest.raises(SidecarStateError) as e:
                c.generate(["anyone awake?"], TINY)  # the client's default: wait=True
            assert "asleep" in e.value.message and "/wake_up" in e.value.message
            assert time.monotonic() - t0 < 10
            assert c.state()["queue_depth"] == 0  # nothing was left waiting
            # A new hook attaches: it reads that the sidecar sleeps, and its wake() wakes it.
            WeightSyncHook(c, nn.Linear(2, 2)).wake()
            assert not c.state()["sleeping"]
        finally:
            if c.state()["sleeping"]:
                c.wake_up()
        assert len(c.generate(["awake again"], TINY)[0].outputs[0].token_ids) == 2


@pytest.mark.slow
def test_hold_while_asleep_holds_until_wake() -> None:
    """The launch flag keeps the old behaviour for callers that sleep and generate from separate
    processes: the request waits, and is served once someone wakes the sidecar."""
    server = launch("--hold-while-asleep")
    try:
        with SidecarClient(server.url, timeout=60) as c:
            c.sleep(level=1)
            with pytest.raises(SidecarStateError):
                c.generate(["no waiting"], TINY, wait=False)
            held: list[Any] = []
            waiter = threading.Thread(target=lambda: held.extend(c.generate(["held prompt"], TINY)))
            waiter.start()
            _wait_until(lambda: c.state()["queue_depth"] == 1)
            assert waiter.is_alive()
            c.wake_up()
            waiter.join(60)
            assert len(held[0].outputs[0].token_ids) == 2
    finally:
        assert server.stop() == 0, server.log


# ---- item 11: the token-rate window is bounded without scrapes ------------------------------------


def test_token_events_stay_bounded_without_metrics_scrapes(monkeypatch: pytest.MonkeyPatch) -> None:
    import sidecar.ranks.driver as driver_module

    now = [0.0]
    monkeypatch.setattr(driver_module, "time", SimpleNamespace(monotonic=lambda: now[0]))
    driver = driver_module.Driver(SimpleNamespace(size=1, plans=[]), step_timeout_s=1.0,  # type: ignore[arg-type]
                                  rpc_timeout_s=1.0)
    out = RequestOutput("nobody-0", [1], [CompletionOutput(0, [7, 8, 9], [0.0] * 3)], 0)
    for step in range(1000):
        now[0] = step * 1.0
        with driver._cv:
            driver._resolve_locked([out])
    assert len(driver._token_events) <= driver_module.TOKENS_WINDOW_S + 1
    assert driver.tokens_total == 3000 and driver.tokens_per_second() == pytest.approx(3.3, abs=0.31)


# ---- item 1 and 8, in-process: prompt intake is the engine's own ------------------------------------


@pytest.mark.parametrize("add_bos", [None, True, False])
def test_the_gil_free_tokenizer_encodes_what_the_tokenizer_encodes(add_bos: bool | None) -> None:
    from inference.models.tiny import default_model_dir
    from inference.text.prompts import GilFreeTokenizer
    from inference.text.tokenizer import Tokenizer

    base = Tokenizer.from_dir(default_model_dir())
    assert base is not None
    tok = Tokenizer(base.hf_tokenizer, eos_token_ids=base.eos_token_ids, bos_token_id=3, add_bos_token=add_bos)
    fast = GilFreeTokenizer(tok)
    for text in ["The river ran slowly", "Café, naïve 東京", "", "  spaces  ", "x" * 5000]:
        assert fast.encode(text) == tok.encode(text), text
        assert fast.encode(text, add_special_tokens=False) == tok.encode(text, add_special_tokens=False)


def test_the_in_process_engine_refuses_a_lone_surrogate_naming_the_prompt() -> None:
    from inference.core import InvalidRequestError
    from inference.engine.llm import LLM
    from tests.helpers_sidecar import KV_BYTES

    llm = LLM(device="cpu", kv_cache_bytes=KV_BYTES)
    with pytest.raises(InvalidRequestError) as e:
        llm.generate(["fine", "broken \ud800 text"], TINY)
    assert e.value.field == "prompts[1]" and "surrogate" in e.value.message
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        llm.generate([[1, 2, 10**6]], TINY)
