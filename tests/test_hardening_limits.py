"""Per-request work is bounded before it starts (docs/limits.md), against a real `sidecar launch` with small
limits: stop strings and stop token ids (count and characters), the size of the answer a call asks for
(n x max_tokens x (1 + logprobs)), messages per chat, chat_template_kwargs that clash with the body's own
fields; and, in-process, the tokenizer pool's bounded, smallest-first queue."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from inference.models.tiny import make_tiny_model
from sidecar.api.common import ApiError
from sidecar.api.text_pool import TextPool
from tests.helpers_sidecar import Sidecar, launch

LIMITS = ("--max-stops", "4", "--max-stop-chars", "40", "--max-response-tokens", "1000", "--max-chat-messages", "6")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sidecar]:
    model = make_tiny_model(tmp_path_factory.mktemp("limits") / "tiny-chat")
    proc = launch("--model", str(model), *LIMITS)
    yield proc
    assert proc.stop() == 0, proc.log


@pytest.fixture(scope="module")
def http(server: Sidecar) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def _error(resp: httpx.Response, status: int = 400) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    return dict(resp.json()["error"])


def _generate(http: httpx.Client, sampling_params: Any, prompts: Any = ("a",)) -> httpx.Response:
    return http.post("/generate", json={"prompts": list(prompts), "sampling_params": sampling_params})


@pytest.mark.slow
def test_stop_strings_and_stop_ids_are_bounded_naming_the_field(http: httpx.Client) -> None:
    base = {"max_tokens": 2, "temperature": 0.0}
    error = _error(_generate(http, {**base, "stop": ["s1", "s2", "s3", "s4", "s5"]}))
    assert error["field"] == "sampling_params.stop" and "--max-stops" in error["message"]
    error = _error(_generate(http, {**base, "stop_token_ids": [1, 2, 3, 4, 5]}))
    assert error["field"] == "sampling_params.stop_token_ids" and "--max-stops" in error["message"]
    error = _error(_generate(http, {**base, "stop": ["x" * 30, "y" * 11]}))
    assert error["field"] == "sampling_params.stop" and "--max-stop-chars" in error["message"]
    per_prompt = [base, {**base, "stop": ["a", "b", "c", "d", "e"]}]
    assert _error(_generate(http, per_prompt, ["a", "b"]))["field"] == "sampling_params[1].stop"
    five = ["1", "2", "3", "4", "5"]
    error = _error(http.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, "stop": five}))
    assert error["field"] == "stop"
    resp = _generate(http, {**base, "stop": ["x" * 20, "y" * 20], "stop_token_ids": [1, 2, 3, 4]})
    assert resp.status_code == 200, resp.text  # at the limits: served


@pytest.mark.slow
def test_a_stop_token_id_ends_the_completion(http: httpx.Client) -> None:
    free = _generate(http, {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}).json()
    tokens = free["outputs"][0]["completions"][0]["token_ids"]
    stopped = _generate(http, {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True,
                               "stop_token_ids": [tokens[2]]}).json()["outputs"][0]["completions"][0]
    first = tokens.index(tokens[2])
    assert stopped["token_ids"] == tokens[:first + 1] and stopped["stop_reason"] == tokens[2]


@pytest.mark.slow
def test_the_answer_a_call_asks_for_is_bounded(http: httpx.Client) -> None:
    # 105 bytes asked for n x max_tokens x 21 entries; here 4 x 100 x 3 = 1,200 > 1,000
    error = _error(_generate(http, {"n": 4, "max_tokens": 100, "logprobs": 2}))
    assert error["field"] == "sampling_params.max_tokens" and "--max-response-tokens" in error["message"]
    error = _error(_generate(http, {"n": 2, "max_tokens": 100, "logprobs": 2}, ["a", "b"]))  # summed: 1,200
    assert error["field"] == "sampling_params" and "1200" in error["message"]
    assert _generate(http, {"n": 2, "max_tokens": 100, "logprobs": 2, "ignore_eos": True}).status_code == 200
    chat = {"messages": [{"role": "user", "content": "hi"}], "n": 4, "max_tokens": 100, "logprobs": True,
            "top_logprobs": 2}
    error = _error(http.post("/v1/chat/completions", json=chat))
    assert error["field"] == "max_tokens" and "--max-response-tokens" in error["message"]


@pytest.mark.slow
def test_chat_messages_are_counted_before_the_template_runs(http: httpx.Client) -> None:
    messages = [{"role": "user", "content": ""}] * 7
    error = _error(http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2}))
    assert error["field"] == "messages" and "--max-chat-messages" in error["message"]
    ok = http.post("/v1/chat/completions", json={"messages": messages[:6], "max_tokens": 2})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("kwargs", [{"messages": []}, {"add_generation_prompt": False}])
@pytest.mark.slow
def test_template_kwargs_that_clash_with_the_body_are_a_400(http: httpx.Client, kwargs: dict[str, Any]) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "chat_template_kwargs": kwargs}
    error = _error(http.post("/v1/chat/completions", json=body))
    assert error["field"] == f"chat_template_kwargs.{next(iter(kwargs))}"


def test_the_text_pool_runs_the_smallest_waiting_job_first_and_refuses_past_its_queue() -> None:
    gate = threading.Event()
    order: list[str] = []

    def job(name: str) -> str:
        if name == "running":
            gate.wait(30)
        order.append(name)
        return name

    async def main() -> None:
        pool = TextPool(workers=1, max_queue=2)
        running = asyncio.create_task(pool.run(10**6, job, "running"))
        await asyncio.sleep(0)  # the task takes the only worker
        big = asyncio.create_task(pool.run(4 << 20, job, "big"))
        small = asyncio.create_task(pool.run(4, job, "small"))
        while pool.queued < 2:
            await asyncio.sleep(0)
        with pytest.raises(ApiError) as refused:
            await pool.run(1, job, "over")
        assert refused.value.status == 429 and refused.value.headers == {"Retry-After": "1"}
        gate.set()
        assert await asyncio.gather(running, big, small) == ["running", "big", "small"]
        pool.close()

    asyncio.run(main())
    assert order == ["running", "small", "big"]  # the 4-character call went before the 4 MB one


def test_a_cancelled_waiter_leaves_the_pool_usable() -> None:
    gate = threading.Event()

    async def main() -> None:
        pool = TextPool(workers=1, max_queue=4)
        running = asyncio.create_task(pool.run(1, gate.wait, 30))
        await asyncio.sleep(0)
        waiting = asyncio.create_task(pool.run(1, lambda: "never"))
        while pool.queued < 1:
            await asyncio.sleep(0)
        waiting.cancel()
        gate.set()
        assert await running is True
        assert await pool.run(1, lambda: "next") == "next"
        pool.close()

    asyncio.run(main())
