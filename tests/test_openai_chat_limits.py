"""/v1/chat/completions passes the intake of /v1/completions (docs/limits.md): an oversized chat gets the
same status as an oversized completion (400 over --max-prompt-chars, 413 over --max-body-mb), n over
--max-request-sequences is refused naming n, and a prompt no tokenizer can encode is a 400, not a 500."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from inference.models.tiny import make_tiny_model
from tests.helpers_sidecar import Sidecar, launch

pytestmark = pytest.mark.slow  # every test here starts real processes or runs for seconds

MAX_CHARS, MAX_SEQUENCES = 2000, 8


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sidecar]:
    model = make_tiny_model(tmp_path_factory.mktemp("chat-limits") / "tiny-chat")
    proc = launch("--model", str(model), "--max-prompt-chars", str(MAX_CHARS), "--max-request-sequences",
                  str(MAX_SEQUENCES), "--max-body-mb", "1")
    yield proc
    assert proc.stop() == 0, proc.log


def chat(server: Sidecar, content: str, **extra: Any) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 2, **extra}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)


def completion(server: Sidecar, prompt: str, **extra: Any) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", json={"prompt": prompt, "max_tokens": 2, **extra}, timeout=60)


def error(resp: httpx.Response) -> dict[str, Any]:
    return dict(resp.json()["error"])


def test_within_the_limits_chat_answers(server: Sidecar) -> None:
    resp = chat(server, "Count the sacks.", n=MAX_SEQUENCES)
    assert resp.status_code == 200, resp.text
    assert len(resp.json()["choices"]) == MAX_SEQUENCES


def test_a_prompt_over_the_character_limit_is_a_400_for_both(server: Sidecar) -> None:
    text = "a" * (MAX_CHARS + 1)
    plain, chatted = completion(server, text), chat(server, text)
    assert plain.status_code == chatted.status_code == 400, (plain.text, chatted.text)
    assert error(plain)["field"] == "prompt[0]" and error(chatted)["field"] == "messages"
    assert "--max-prompt-chars" in error(plain)["message"] and "--max-prompt-chars" in error(chatted)["message"]


def test_the_rendered_prompt_is_held_to_the_limit_too(server: Sidecar) -> None:
    """Messages just under the limit, which the template's role headers push over it."""
    resp = chat(server, "a" * (MAX_CHARS - 5))
    assert resp.status_code == 400, resp.text
    assert error(resp)["field"] == "messages" and "--max-prompt-chars" in error(resp)["message"]


def test_a_body_over_the_size_limit_is_a_413_for_both(server: Sidecar) -> None:
    text = "a" * (1 << 20)
    plain, chatted = completion(server, text), chat(server, text)
    assert plain.status_code == chatted.status_code == 413, (plain.text[:200], chatted.text[:200])
    assert error(chatted)["field"] == "body"


def test_n_over_the_sequence_limit_is_refused_for_both(server: Sidecar) -> None:
    plain, chatted = completion(server, "x", n=MAX_SEQUENCES + 1), chat(server, "x", n=MAX_SEQUENCES + 1)
    assert plain.status_code == chatted.status_code == 400, (plain.text, chatted.text)
    assert error(chatted)["field"] == "n" and "--max-request-sequences" in error(chatted)["message"]
    assert "--max-request-sequences" in error(plain)["message"]


def test_a_lone_surrogate_is_a_400_naming_messages(server: Sidecar) -> None:
    """JSON may carry "\\ud800"; the tokenizer cannot encode it (a TypeError, a 500, before the intake)."""
    raw = b'{"messages": [{"role": "user", "content": "bad \\ud800 half"}], "max_tokens": 2}'
    resp = httpx.post(f"{server.url}/v1/chat/completions", content=raw, timeout=60,
                      headers={"Content-Type": "application/json"})
    assert resp.status_code == 400, resp.text
    assert error(resp)["field"] == "messages" and "surrogate" in error(resp)["message"]
    assert chat(server, "still serving").status_code == 200
