"""OpenAI clients against `sidecar launch --model DIR`: /v1/models, /v1/chat/completions with the model's own
chat template (the same tokens as LLM.generate on the rendered prompt), and /v1/completions' text_offset."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from inference.core import CompletionOutput, InvalidRequestError, SamplingParams
from inference.engine.llm import LLM
from inference.models.tiny import IM_START_ID, make_tiny_model
from inference.text.chat_template import render_chat
from inference.text.tokenizer import Tokenizer
from sidecar.api.openai_format import completion_response, text_offsets
from tests.helpers_sidecar import KV_BYTES, Sidecar, launch

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count the sacks of grain."}]
# What openai 3.x's client.chat.completions.create(...) sends for these arguments, byte for byte.
OPENAI_BODY = {"model": "tiny-chat", "messages": MESSAGES, "logprobs": True, "max_tokens": 8, "n": 2, "seed": 5,
               "stop": ["\n"], "temperature": 0.7, "top_logprobs": 2}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("chat") / "tiny-chat")


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[Sidecar]:
    proc = launch("--model", str(model_dir))
    yield proc
    assert proc.stop() == 0, proc.log


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> LLM:
    return LLM(str(model_dir), device="cpu", kv_cache_bytes=KV_BYTES)


def chat(server: Sidecar, body: dict[str, Any]) -> dict[str, Any]:
    """POST the body as the openai package would (through the package itself when it is installed)."""
    try:
        import openai
    except ImportError:
        resp = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120,
                          headers={"Authorization": "Bearer none"})
        assert resp.status_code == 200, resp.text
        return dict(resp.json())
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=120)
    return dict(client.chat.completions.create(**body).model_dump())


@pytest.mark.slow
def test_chat_returns_the_tokens_of_llm_generate_on_the_rendered_prompt(server: Sidecar, engine: LLM) -> None:
    data = chat(server, OPENAI_BODY)
    prompt = engine.tokenizer.apply_chat_template(MESSAGES)
    assert prompt == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nCount the sacks of grain."
                      "<|im_end|>\n<|im_start|>assistant\n")
    want = engine.generate([prompt], SamplingParams(n=2, temperature=0.7, seed=5, max_tokens=8, stop=("\n",),
                                                    logprobs=2))[0]
    assert data["object"] == "chat.completion" and data["weight_version"] == 0
    assert data["prompt_token_ids"] == want.prompt_token_ids
    assert len(data["choices"]) == 2
    for choice, c in zip(data["choices"], want.outputs, strict=True):
        assert choice["index"] == c.index and choice["token_ids"] == c.token_ids
        assert choice["message"] == {"role": "assistant", "content": c.text, **_nulls(choice["message"])}
        assert choice["finish_reason"] == c.finish_reason.value
        content = choice["logprobs"]["content"]
        assert [e["logprob"] for e in content] == pytest.approx(c.logprobs, abs=1e-4)
        assert [len(e["top_logprobs"]) for e in content] == [2] * len(c.token_ids)
        assert all(e["top_logprobs"][0]["logprob"] >= e["top_logprobs"][1]["logprob"] for e in content)
    usage = data["usage"]
    assert usage["prompt_tokens"] == len(want.prompt_token_ids)
    assert usage["completion_tokens"] == sum(len(c.token_ids) for c in want.outputs)


def _nulls(message: dict[str, Any]) -> dict[str, Any]:
    """The null fields the openai package's model adds to a message (refusal, tool_calls, ...)."""
    return {k: v for k, v in message.items() if v is None}


@pytest.mark.slow
def test_greedy_chat_defaults_max_tokens_to_the_rest_of_the_context(server: Sidecar, engine: LLM) -> None:
    body = {"model": "tiny-chat", "messages": [{"role": "user", "content": [{"type": "text", "text": "one, two,"}]}],
            "temperature": 0, "max_completion_tokens": 5}
    resp = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "one, two,"}])
    want = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=5))[0].outputs[0]
    choice = resp.json()["choices"][0]
    assert choice["token_ids"] == want.token_ids and choice["logprobs"] is None


@pytest.mark.slow
def test_models_lists_the_served_model_with_its_weight_version(server: Sidecar, model_dir: Path) -> None:
    data = httpx.get(f"{server.url}/v1/models", timeout=30).json()
    assert data["object"] == "list" and len(data["data"]) == 1
    card = data["data"][0]
    assert (card["id"], card["object"], card["weight_version"]) == (model_dir.name, "model", 0)
    assert card["max_model_len"] == 2048 and card["root"] == str(model_dir)


@pytest.mark.parametrize(("patch", "status", "field"), [
    ({"messages": []}, 422, "messages"),
    ({"messages": [{"role": "user", "content": "x", "colour": 1}]}, 422, "messages[0].colour"),
    ({"stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ({"response_format": {"type": "json_object"}}, 400, "response_format"),
    ({"colour": 1}, 400, "colour"),
    ({"model": "gpt-4"}, 404, "model"),
    ({"logprobs": None}, 400, "top_logprobs"),
    ({"top_logprobs": 21}, 400, "top_logprobs"),
    ({"max_tokens": 4000}, 400, "max_tokens"),
    ({"temperature": -1.0}, 400, "temperature"),
    ({"presence_penalty": 2.5}, 400, "presence_penalty"),
    ({"messages": [{"role": "user", "content": "one " * 3000}], "max_tokens": None}, 400, "messages"),
])
@pytest.mark.slow
def test_bad_chat_requests_name_the_field(server: Sidecar, patch: dict[str, Any], status: int, field: str) -> None:
    resp = httpx.post(f"{server.url}/v1/chat/completions", json={**OPENAI_BODY, **patch}, timeout=60)
    assert resp.status_code == status, resp.text
    assert resp.json()["error"]["field"] == field


# ---- the template engine -------------------------------------------------------------------------
LLAMA_LIKE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}"
              "{% endif %}{% generation %}[{{ m['role'] | upper }}] {{ m['content'] | tojson }}{% endgeneration %}\n"
              "{% endfor %}{% if add_generation_prompt %}[ASSISTANT]{% if enable_thinking %} <think>{% endif %}"
              "{% endif %}")


def test_rendering_equals_transformers_apply_chat_template(model_dir: Path, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    ours = Tokenizer.from_dir(model_dir)
    assert ours is not None
    theirs = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    for gen in (True, False):
        assert ours.apply_chat_template(MESSAGES, add_generation_prompt=gen) == theirs.apply_chat_template(
            MESSAGES, add_generation_prompt=gen, tokenize=False)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": LLAMA_LIKE}))
    for name in ("tokenizer.json", "special_tokens_map.json"):
        (tmp_path / name).write_bytes((model_dir / name).read_bytes())
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    ours = Tokenizer.from_dir(tmp_path)
    assert ours is not None
    chat = [*MESSAGES, {"role": "user", "content": "Zürich"}]
    text = ours.apply_chat_template(chat, enable_thinking=True)
    assert text == theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True, enable_thinking=True)
    # trim_blocks drops the newline after a block tag, in both
    assert text == ('<|startoftext|>[SYSTEM] "Be brief."[USER] "Count the sacks of grain."[USER] "Zürich"'
                    "[ASSISTANT] <think>")


def test_a_template_that_refuses_or_escapes_is_a_400_naming_messages() -> None:
    with pytest.raises(InvalidRequestError, match="no tools") as e:
        render_chat(LLAMA_LIKE, [{"role": "tool", "content": "x"}])
    assert e.value.field == "messages"
    with pytest.raises(InvalidRequestError, match=r"unsafe|access") as e:  # the sandbox: no Python internals
        render_chat("{{ messages.__class__.__mro__ }}", [])
    with pytest.raises(InvalidRequestError) as e:
        render_chat("{% for %}", [])
    assert e.value.field == "messages"


# ---- /v1/completions: text_offset past a special token ---------------------------------------------
def test_text_offset_skips_a_sampled_special_token(model_dir: Path) -> None:
    tok = Tokenizer.from_dir(model_dir)
    assert tok is not None
    plain = lambda text: tok.encode(text, add_special_tokens=False)
    ids = [*plain("The river"), IM_START_ID, *plain(" ran")]
    text = tok.decode(ids)  # what the engine returns: special tokens skipped
    assert text == "The river ran"
    c = CompletionOutput(index=0, token_ids=ids, logprobs=[-1.0] * len(ids), text=text)
    offsets = text_offsets(c, tok)
    special = ids.index(IM_START_ID)
    assert offsets[special] == offsets[special + 1] == len("The river")
    pieces = [text[a:b] for a, b in zip(offsets, [*offsets[1:], len(text)])]
    assert "".join(pieces) == text and pieces[special] == ""
    from inference.core import RequestOutput

    body = completion_response([RequestOutput("r", [1], [c], 0)], "m", 0, tok, "cmpl-1")
    assert body["choices"][0]["logprobs"]["text_offset"] == offsets
    assert body["choices"][0]["logprobs"]["tokens"][special] == "<|im_start|>"
