"""The HTTP API of a real `sidecar launch` process (TP=1, CPU, the embedded tiny model, an API key).

Outputs must equal the in-process engine's; bad requests get a clear 4xx naming the field and the
server keeps serving; sleep holds requests until wake; 64 concurrent clients all get their answer.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from inference.core import SamplingParams
from inference.engine.llm import LLM
from sidecar.client import SidecarClient, SidecarStateError
from tests.helpers_sidecar import KV_BYTES, Sidecar, launch

pytestmark = pytest.mark.slow  # every test here starts real processes or runs for seconds

KEY = "test-secret"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPTS = ["The river ran slowly", [5, 17, 42, 99, 7], "Numbers are honest", "Café, naïve"]


@pytest.fixture(scope="module")
def server() -> Iterator[Sidecar]:
    proc = launch("--api-key", KEY)
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(server: Sidecar) -> Iterator[SidecarClient]:
    with SidecarClient(server.url, api_key=KEY, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def engine() -> LLM:
    return LLM(device="cpu", kv_cache_bytes=KV_BYTES)


def post(server: Sidecar, path: str, body: object = None, *, headers: dict[str, str] | None = None,
         content: str | None = None) -> httpx.Response:
    h = {**AUTH, **(headers or {})}
    if content is not None:
        return httpx.post(server.url + path, content=content, headers={**h, "content-type": "application/json"},
                          timeout=60)
    return httpx.post(server.url + path, json=body, headers=h, timeout=60)


def wait_for_queue_depth(client: SidecarClient, depth: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while client.state()["queue_depth"] != depth:
        assert time.monotonic() < deadline, f"queue depth never reached {depth}"
        time.sleep(0.05)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=12, logprobs=2),
    SamplingParams(temperature=0.9, top_p=0.8, seed=1234, max_tokens=12, n=2),
], ids=["greedy", "seeded"])
def test_generate_over_http_equals_in_process_engine(client: SidecarClient, engine: LLM,
                                                     params: SamplingParams) -> None:
    got = client.generate(PROMPTS, params)
    want = engine.generate(PROMPTS, params)
    assert len(got) == len(want) == len(PROMPTS)
    for g, w in zip(got, want):
        assert g.prompt_token_ids == w.prompt_token_ids
        assert g.weight_version == w.weight_version == 0
        for gc, wc in zip(g.outputs, w.outputs, strict=True):
            assert gc.token_ids == wc.token_ids
            assert gc.text == wc.text
            assert gc.finish_reason == wc.finish_reason
            assert gc.logprobs == pytest.approx(wc.logprobs, abs=1e-4)
            if wc.top_logprobs is not None:
                assert [set(d) for d in gc.top_logprobs] == [set(d) for d in wc.top_logprobs]


def test_openai_completions_match_generate(server: Sidecar, engine: LLM) -> None:
    body = {"prompt": ["Once upon", "The miller"], "max_tokens": 6, "temperature": 0.7,
            "seed": 3, "n": 2, "logprobs": 1, "stop": ["zzz"]}
    resp = post(server, "/v1/completions", body)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    want = engine.generate(["Once upon", "The miller"], SamplingParams(n=2, temperature=0.7, seed=3, max_tokens=6,
                                                                      stop=("zzz",), logprobs=1))
    assert [c["index"] for c in data["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in data["choices"]] == [c.text for o in want for c in o.outputs]
    assert [c["finish_reason"] for c in data["choices"]] == ["length"] * 4
    lp = data["choices"][0]["logprobs"]
    assert lp["token_logprobs"] == pytest.approx(want[0].outputs[0].logprobs, abs=1e-4)
    assert "".join(lp["tokens"]) == want[0].outputs[0].text
    usage = data["usage"]
    assert usage["completion_tokens"] == 4 * 6
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_64_concurrent_clients_each_get_their_own_answer(server: Sidecar, engine: LLM) -> None:
    prompts = [f"Passenger {i} asked why the train was late" for i in range(64)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    want = {p: o.outputs[0].token_ids for p, o in zip(prompts, engine.generate(prompts, params))}

    def ask(prompt: str) -> list[int]:
        body = {"prompts": [prompt], "sampling_params": {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True}}
        resp = post(server, "/generate", body)
        assert resp.status_code == 200, resp.text
        return resp.json()["outputs"][0]["completions"][0]["token_ids"]

    with cf.ThreadPoolExecutor(64) as pool:
        got = dict(zip(prompts, pool.map(ask, prompts)))
    assert got == want


@pytest.mark.parametrize(("body", "status", "field"), [
    ({"prompts": ["hi"], "sampling_params": {"max_tokens": "5"}}, 422, "sampling_params.max_tokens"),
    ({"prompts": ["hi"], "temperature": 0.5}, 422, "temperature"),
    ({"prompts": "hi"}, 422, "prompts"),
    ({"prompts": []}, 422, "prompts"),
    ({"prompts": ["hi"], "sampling_params": {"n": 10**9}}, 400, "sampling_params.n"),
    ({"prompts": ["hi"], "sampling_params": {"max_tokens": 10**9}}, 400, "sampling_params.max_tokens"),
    ({"prompts": ["hi", [1, 2, 10**6]]}, 400, "prompts[1]"),
    ({"prompts": ["a", "b"], "sampling_params": [{"temperature": -1}, {}]}, 400, "sampling_params[0].temperature"),
], ids=["wrong-type", "unknown-field", "not-a-list", "empty", "absurd-n", "absurd-max-tokens", "bad-token",
        "per-prompt-params"])
def test_bad_generate_requests_get_4xx_naming_the_field(server: Sidecar, body: dict, status: int,
                                                        field: str) -> None:
    resp = post(server, "/generate", body)
    assert resp.status_code == status, resp.text
    assert resp.json()["error"]["field"] == field
    assert post(server, "/generate", {"prompts": ["still serving"]}).status_code == 200


def test_malformed_json_auth_and_unknown_routes(server: Sidecar) -> None:
    resp = post(server, "/generate", content='{"prompts": [')
    assert resp.status_code == 400 and resp.json()["error"]["field"] == "body"
    assert post(server, "/v1/completions", {"prompt": "x", "n": 0}).json()["error"]["field"] == "n"
    assert post(server, "/v1/completions", {"prompt": "x", "stream_options": {}}).json()["error"]["field"] == (
        "stream_options")
    for headers in ({"Authorization": ""}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"}):
        resp = httpx.post(server.url + "/generate", json={"prompts": ["x"]}, headers=headers, timeout=30)
        assert resp.status_code == 401 and resp.json()["error"]["type"] == "Unauthorized"
    assert httpx.get(server.url + "/state", timeout=30).status_code == 401
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200  # probes need no key
    assert httpx.get(server.url + "/metrics", timeout=30).status_code == 200
    assert httpx.get(server.url + "/nope", headers=AUTH, timeout=30).status_code == 404
    bad_query = httpx.get(server.url + "/checksums?model=student", headers=AUTH, timeout=30)
    assert bad_query.status_code == 422 and bad_query.json()["error"]["field"] == "model"
    schema = httpx.get(server.url + "/openapi.json", timeout=30).json()
    assert {"/generate", "/v1/completions", "/sleep", "/weights/init", "/audit"} <= set(schema["paths"])
    assert post(server, "/sleep", {"level": 3}).json()["error"]["field"] == "level"
    assert post(server, "/generate", {"prompts": ["still serving"]}).status_code == 200


def test_sleep_refuses_requests_at_once_until_wake(client: SidecarClient, engine: LLM) -> None:
    """While asleep a request is answered 409 at once, naming the state and how to wake it (holding it
    until the client's timeout hung new users; --hold-while-asleep holds: tests/test_hardening.py)."""
    params = SamplingParams(temperature=0.0, max_tokens=5)
    slept = client.sleep(level=1)
    assert slept["state"]["sleeping"] is True
    assert set(slept["state"]["tags"].values()) == {"asleep_mirrored", "asleep_empty"}
    for wait in (False, True):
        with pytest.raises(SidecarStateError, match="asleep"):
            client.generate(["no waiting"], params, wait=wait)
    woke = client.wake_up()
    assert woke["state"]["sleeping"] is False
    got = client.generate(["after the wake"], params)
    assert got[0].outputs[0].token_ids == engine.generate(["after the wake"], params)[0].outputs[0].token_ids


def test_pause_holds_steps_and_resume_continues(client: SidecarClient) -> None:
    client.pause()
    try:
        done: list = []
        t = threading.Thread(target=lambda: done.extend(client.generate(["paused"], SamplingParams(max_tokens=3))))
        t.start()
        wait_for_queue_depth(client, 1)
        time.sleep(0.5)  # a paused driver runs no step: the request is still there afterwards
        assert t.is_alive() and client.state()["paused"] is True
    finally:
        client.resume()
    t.join(60)
    assert len(done[0].outputs[0].token_ids) == 3


def test_state_and_metrics(client: SidecarClient) -> None:
    client.generate(["count me"], SamplingParams(max_tokens=4, ignore_eos=True))
    s = client.state()
    assert s["healthy"] and s["tp"] == 1 and s["weight_versions"] == {"target": 0}
    assert s["ranks"][0]["rank"] == "dp0:pp0:tp0" and s["ranks"][0]["alive"]
    assert s["torn"] == {"target": False}
    text = client.metrics()
    tokens = next(float(line.split()[-1]) for line in text.splitlines()
                  if line.startswith("sidecar_generated_tokens_total"))
    assert tokens >= 4
    assert "sidecar_queue_depth" in text and "sidecar_sleep_seconds" in text
    # the engine's counters (summed over finished requests): a repeated long prompt hits the prefix cache
    long = "the same long prompt " * 30
    client.generate([long], SamplingParams(max_tokens=2, ignore_eos=True))
    client.generate([long], SamplingParams(max_tokens=2, ignore_eos=True))
    counters = metric_values(client.metrics(), "sidecar_draft_tokens_proposed_total", "sidecar_preemptions_total",
                             "sidecar_prefix_cache_hit_tokens_total")
    assert counters["sidecar_prefix_cache_hit_tokens_total"] > 0
    assert counters["sidecar_draft_tokens_proposed_total"] == counters["sidecar_preemptions_total"] == 0
    engine = client.state()["engine"]  # /state carries the same counters
    assert engine["prefix_cache_hit_tokens"] == counters["sidecar_prefix_cache_hit_tokens_total"]
    assert engine["generated_tokens"] >= 8 and engine["draft_tokens_proposed"] == engine["preemptions"] == 0


def metric_values(text: str, *names: str) -> dict[str, float]:
    """The value of each named sample in a /metrics text."""
    values = {line.split()[0]: float(line.split()[-1]) for line in text.splitlines() if not line.startswith("#")}
    return {name: values[name] for name in names}


def test_the_modes_own_draft_shows_on_metrics() -> None:
    """--batch-invariant --self-draft on CPU: the draft proposes and the mode's forward keeps proposals."""
    own = launch("--batch-invariant", "--self-draft", "--num-speculative-tokens", "3")
    try:
        with SidecarClient(own.url, timeout=60) as c:
            c.generate(PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0))
            counters = metric_values(c.metrics(), "sidecar_draft_tokens_proposed_total",
                                     "sidecar_draft_tokens_accepted_total")
    finally:
        assert own.stop() == 0, own.log
    assert 0 < counters["sidecar_draft_tokens_accepted_total"] <= counters["sidecar_draft_tokens_proposed_total"]
