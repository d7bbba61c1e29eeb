"""The official `openai` client, unchanged, against a real `sidecar launch` of a tiny model: completions and
chat, non-streamed and streamed (the streamed text and tokens equal the non-streamed ones; usage in the
last chunk), n > 1, stop strings, logprobs, penalties, echo, models.list / retrieve, a wrong model
(NotFoundError), an unsupported field (one 400 naming it), /tokenize and /detokenize, and a client that
goes away mid-stream (its request leaves the engine)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from inference.core import SamplingParams
from inference.engine.llm import LLM
from inference.models.tiny import make_tiny_model
from tests.helpers_sidecar import KV_BYTES, Sidecar, launch

openai = pytest.importorskip("openai")

NAME = "tiny/served"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name the grain in the sacks."}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("oai") / "tiny-oai")


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[Sidecar]:
    proc = launch("--model", str(model_dir), "--served-model-name", NAME)
    yield proc
    assert proc.stop() == 0, proc.log


@pytest.fixture(scope="module")
def client(server: Sidecar) -> Any:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> LLM:
    return LLM(str(model_dir), device="cpu", kv_cache_bytes=KV_BYTES)


def streamed_completions(stream: Any) -> tuple[dict[int, str], dict[int, list[int]], dict[int, str], Any]:
    """(text, token ids, finish reason) per choice index, and the usage of the last chunk."""
    texts: dict[int, str] = {}
    ids: dict[int, list[int]] = {}
    finish: dict[int, str] = {}
    usage = None
    chunks = list(stream)
    for chunk in chunks:
        assert usage is None, "usage comes in the last chunk only"
        usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            ids.setdefault(c.index, []).extend(c.model_extra["token_ids"])
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    return texts, ids, finish, usage


@pytest.mark.slow
def test_models_list_retrieve_and_a_wrong_model(client: Any) -> None:
    assert [m.id for m in client.models.list().data] == [NAME]
    assert client.models.retrieve(NAME).id == NAME
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4")
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    error = e.value.body
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "gpt-4" in error["message"] and NAME in error["message"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=MESSAGES, max_tokens=2)


@pytest.mark.parametrize("kw", [dict(temperature=0.0), dict(temperature=0.9, seed=7, n=3)], ids=["greedy", "seeded-n3"])
@pytest.mark.slow
def test_streamed_completions_equal_the_non_streamed(client: Any, kw: dict[str, Any]) -> None:
    prompts = ["The miller counted", "Once upon a"]
    full = client.completions.create(model=NAME, prompt=prompts, max_tokens=12, **kw)
    n = kw.get("n", 1)
    assert [c.index for c in full.choices] == list(range(len(prompts) * n))
    stream = client.completions.create(model=NAME, prompt=prompts, max_tokens=12, stream=True,
                                       stream_options={"include_usage": True}, **kw)
    texts, ids, finish, usage = streamed_completions(stream)
    assert texts == {c.index: c.text for c in full.choices}
    assert ids == {c.index: c.model_extra["token_ids"] for c in full.choices}
    assert finish == {c.index: c.finish_reason for c in full.choices}
    assert usage is not None and usage.model_dump() == full.usage.model_dump()
    assert full.usage.completion_tokens == sum(len(v) for v in ids.values())
    plain = list(client.completions.create(model=NAME, prompt=prompts[0], max_tokens=3, stream=True, **kw))
    assert all(chunk.usage is None for chunk in plain)  # no include_usage: no usage chunk


@pytest.mark.slow
def test_streamed_chat_equals_the_non_streamed_with_logprobs_and_usage(client: Any) -> None:
    kw = dict(model=NAME, messages=MESSAGES, max_completion_tokens=10, n=2, seed=5, temperature=0.8,
              logprobs=True, top_logprobs=2)
    full = client.chat.completions.create(**kw)
    stream = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert stream[-1].choices == [] and stream[-1].usage.model_dump() == full.usage.model_dump()
    texts: dict[int, str] = {}
    lps: dict[int, list[Any]] = {}
    roles = set()
    for chunk in stream[:-1]:
        assert chunk.object == "chat.completion.chunk" and chunk.usage is None
        for c in chunk.choices:
            roles.add(c.delta.role)
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.logprobs is not None:
                lps.setdefault(c.index, []).extend(c.logprobs.content)
    assert "assistant" in roles
    assert texts == {c.index: c.message.content for c in full.choices}
    for c in full.choices:
        # the same tokens; logprobs to float noise (the second call reads the prompt from the prefix cache)
        assert [e.token for e in lps[c.index]] == [e.token for e in c.logprobs.content]
        assert [e.logprob for e in lps[c.index]] == pytest.approx([e.logprob for e in c.logprobs.content], abs=1e-4)
        assert all(len(e.top_logprobs) == 2 for e in c.logprobs.content)


@pytest.mark.slow
def test_stop_strings_and_their_variants(client: Any) -> None:
    free = client.completions.create(model=NAME, prompt="The miller counted", max_tokens=24, temperature=0.0)
    text = free.choices[0].text
    assert len(text) > 8, text
    stop = text[4:7]
    head = text[:text.index(stop)]
    for variant in (stop, [stop], ["\u2603never", stop]):
        got = client.completions.create(model=NAME, prompt="The miller counted", max_tokens=24, temperature=0.0,
                                        stop=variant)
        assert (got.choices[0].text, got.choices[0].finish_reason) == (head, "stop"), variant
        streamed, _, finish, _ = streamed_completions(client.completions.create(
            model=NAME, prompt="The miller counted", max_tokens=24, temperature=0.0, stop=variant, stream=True))
        assert (streamed[0], finish[0]) == (head, "stop")
    none = client.completions.create(model=NAME, prompt="The miller counted", max_tokens=24, temperature=0.0,
                                     stop=None)
    assert none.choices[0].text == text


@pytest.mark.slow
def test_completions_logprobs_echo_token_ids_and_penalties(client: Any, server: Sidecar, engine: LLM) -> None:
    got = client.completions.create(model=NAME, prompt="Once upon a", max_tokens=6, temperature=0.0, logprobs=2,
                                    echo=False)
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert all(len(d) == 2 for d in lp.top_logprobs)
    echoed = client.completions.create(model=NAME, prompt="Once upon a", max_tokens=6, temperature=0.0, echo=True)
    assert echoed.choices[0].text == "Once upon a" + got.choices[0].text
    ids = engine.tokenizer.encode("Once upon a")
    by_ids = client.completions.create(model=NAME, prompt=ids, max_tokens=6, temperature=0.0)
    assert by_ids.choices[0].model_extra["prompt_token_ids"] == ids
    assert by_ids.choices[0].model_extra["token_ids"] == got.choices[0].model_extra["token_ids"]
    params = dict(temperature=0.0, max_tokens=16, frequency_penalty=1.5, presence_penalty=0.5)
    penalized = client.completions.create(model=NAME, prompt="Once upon a", **params,
                                          extra_body={"repetition_penalty": 1.3})
    want = engine.generate(["Once upon a"], SamplingParams(**params, repetition_penalty=1.3))[0].outputs[0]
    assert penalized.choices[0].model_extra["token_ids"] == want.token_ids
    generated = httpx.post(f"{server.url}/generate", timeout=60, json={
        "prompts": ["Once upon a"], "sampling_params": {**params, "repetition_penalty": 1.3}}).json()
    assert generated["outputs"][0]["completions"][0]["token_ids"] == want.token_ids  # /generate takes them too


@pytest.mark.slow
def test_an_unsupported_field_is_one_400_naming_it(client: Any, server: Sidecar) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=MESSAGES, tools=tools)
    assert e.value.body["param"] == "tools" and "not supported" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt="x", extra_body={"colour": 1})
    assert e.value.body["param"] == "colour" and "Unrecognized" in e.value.body["message"]
    ok = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=2,
                                        response_format={"type": "text"}, parallel_tool_calls=False)
    assert ok.choices[0].finish_reason == "length"


@pytest.mark.slow
def test_tokenize_and_detokenize(server: Sidecar, engine: LLM) -> None:
    body = {"model": NAME, "prompt": "Once upon a time", "return_token_strs": True}
    got = httpx.post(f"{server.url}/tokenize", json=body, timeout=30).json()
    assert got["tokens"] == engine.tokenizer.encode("Once upon a time") and got["count"] == len(got["tokens"])
    assert got["max_model_len"] == engine.max_model_len and len(got["token_strs"]) == got["count"]
    back = httpx.post(f"{server.url}/detokenize", json={"tokens": got["tokens"]}, timeout=30).json()
    assert back["prompt"] == engine.tokenizer.decode(got["tokens"], skip_special_tokens=False)
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": MESSAGES}, timeout=30).json()
    assert chat["tokens"] == engine.tokenizer.encode(engine.tokenizer.apply_chat_template(MESSAGES),
                                                     add_special_tokens=False)
    bad = httpx.post(f"{server.url}/detokenize", json={"tokens": [10**7]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    wrong = httpx.post(f"{server.url}/tokenize", json={"model": "gpt-4", "prompt": "x"}, timeout=30)
    assert wrong.status_code == 404


@pytest.mark.slow
def test_tokens_stream_as_they_come_and_a_client_that_goes_away_leaves_nothing_running(server: Sidecar) -> None:
    body = {"model": NAME, "prompt": "The miller", "max_tokens": 1500, "n": 8, "temperature": 1.0,
            "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{server.url}/v1/completions", json=body) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = resp.iter_lines()  # kept open: leaving the loop by `break` would close the connection
        while not ((line := next(lines)).startswith("data: ") and json.loads(line[6:])["choices"][0]["token_ids"]):
            pass  # up to the first token
        state = httpx.get(f"{server.url}/state", timeout=30).json()
        assert state["queue_depth"] == 1, state  # the request still runs: 8 x 1,500 tokens take far longer
    t0 = time.monotonic()
    while (state := httpx.get(f"{server.url}/state", timeout=30).json())["engine_unfinished"] or state["queue_depth"]:
        assert time.monotonic() - t0 < 10, state
        time.sleep(0.2)


def test_a_streamed_sample_restarted_by_a_sync_voids_its_stream() -> None:
    """A weight sync that sends a sample back to its prompt (on_sync abort, max_staleness) makes what was
    streamed void: the stream says so instead of sending a second beginning."""
    from sidecar.api.openai_stream import StreamVoid, _Choice
    from sidecar.ranks.commands import StreamDelta

    choice = _Choice(None, (), False)
    choice.add(StreamDelta("g0-0", 0, 0, 0, (5, 6), (-1.0, -2.0)))
    choice.add(StreamDelta("g0-0", 0, 2, 0, (7,), (-1.0,)))
    with pytest.raises(StreamVoid):
        choice.add(StreamDelta("g0-0", 0, 0, 1, (9,), (-1.0,)))
    fresh = _Choice(None, (), False)  # restarted before any token was streamed: nothing is void
    fresh.add(StreamDelta("g0-1", 0, 0, 1, (9,), (-1.0,)))
    assert fresh.token_ids == [9]
