"""OpenAI-compatible routes beside /v1/completions (server.py): GET /v1/models and POST /v1/chat/completions.

A chat request is rendered with the served model's own chat template (tokenizer_config.json or
chat_template.jinja; inference/text/chat_template.py), encoded without adding special tokens (the template
wrote them), and submitted as token ids: the same tokens `LLM.generate` produces for the rendered
text. It passes the intake of /v1/completions (sidecar/api/intake.py, docs/limits.md): n against
--max-request-sequences and the messages' characters against --max-prompt-chars before any template
runs, then rendering and tokenization in a worker thread (never on the event loop), the rendered
prompt checked as a text prompt is. So an OpenAI client, or an RL environment that speaks chat, can
point at the sidecar unchanged and still get what RL needs: `weight_version` on the response,
`token_ids` on each choice, `prompt_token_ids`, and logprobs.

Errors are the API's usual ones: a bad value is a 400 naming the body's field (messages,
max_tokens, top_logprobs, ...), a model without a tokenizer or a chat template a 400 naming
"messages". Registered from server.py (`add_openai_routes`), behind the same API key.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from fastapi import APIRouter, Request

from inference.core import InvalidRequestError, RequestOutput, SamplingParams
from sidecar.api.common import ApiError, ServerState, await_future
from sidecar.api.models import ChatCompletionRequest
from sidecar.api.openai_format import chat_response
from sidecar.ranks.commands import TokenizedPrompt


def add_openai_routes(router: APIRouter, state: ServerState) -> None:
    @router.get("/v1/models", summary="OpenAI-compatible model list: the one served model")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(state)]}

    @router.post("/v1/chat/completions", summary="OpenAI-compatible chat completions, with the model's chat template")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> dict[str, Any]:
        _refuse_unsupported(body)
        state.intake.check_chat(body.n if body.n is not None else 1, message_chars(body))
        prompt = await asyncio.to_thread(render_prompt, state, body)  # template + tokenizer off the loop
        params = chat_params(state, body, len(prompt.token_ids))
        out = await _run(request, state, prompt, params, body)
        return chat_response(out, state.served_model_name, bool(body.logprobs), state.tokenizer,
                             f"chatcmpl-{uuid.uuid4().hex}")


def model_card(state: ServerState) -> dict[str, Any]:
    """The served model as /v1/models lists it, with its max_model_len and current weight version."""
    target = state.driver.held_weights().get("target", {})
    return {"id": state.served_model_name, "object": "model", "created": int(state.started), "owned_by": "sidecar",
            "root": state.plans[0].model, "max_model_len": state.plans[0].max_model_len,
            "weight_version": target.get("version"), "torn": target.get("torn", False),
            "needs_sync": target.get("needs_sync")}


def _refuse_unsupported(body: Any) -> None:
    if body.stream:
        raise ApiError(400, "InvalidRequestError", "streaming is not supported", "stream")
    for name in ("frequency_penalty", "presence_penalty"):
        if getattr(body, name) not in (None, 0, 0.0):
            raise ApiError(400, "InvalidRequestError", "penalties are not supported: send 0 or leave it out", name)
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "InvalidRequestError", "needs logprobs: true", "top_logprobs")


def message_chars(body: Any) -> int:
    """The characters of every message's content: what the template will mostly copy into the prompt."""
    total = 0
    for m in body.messages:
        parts = m.content if isinstance(m.content, list) else [m.content]
        total += sum(len(p if isinstance(p, str) else p.text) for p in parts if p is not None)
    return total


def render_prompt(state: ServerState, body: Any) -> TokenizedPrompt:
    """The prompt's token ids: the messages under the model's chat template, checked and encoded without
    adding special tokens (the template wrote them) by the intake. Runs in a worker thread."""
    tokenizer = state.tokenizer
    if tokenizer is None:
        raise ApiError(400, "InvalidRequestError", "this model has no tokenizer.json: chat needs one (send token "
                                                   "ids to /generate instead)", "messages")
    try:
        text = tokenizer.apply_chat_template([m.template_dict() for m in body.messages],
                                             add_generation_prompt=body.add_generation_prompt,
                                             **(body.chat_template_kwargs or {}))
    except InvalidRequestError as e:
        raise ApiError(400, type(e).__name__, e.message, e.field) from None
    return state.intake.encode_chat(text)


def chat_params(state: ServerState, body: Any, prompt_len: int) -> SamplingParams:
    """The SamplingParams of a chat body; max_tokens unset takes what max_model_len leaves after the
    prompt (a prompt that leaves nothing is refused, naming messages)."""
    max_model_len = state.plans[0].max_model_len
    data = body.sampling_dict()
    if "max_tokens" not in data:
        if prompt_len >= max_model_len:
            raise ApiError(400, "InvalidRequestError", f"the rendered prompt has {prompt_len} tokens: no room for "
                           f"a reply in max_model_len ({max_model_len})", "messages")
        data["max_tokens"] = max_model_len - prompt_len
    try:
        params = SamplingParams.from_dict(data)
        params.check_limits(state.vocab_size, max_model_len, prompt_len)
    except InvalidRequestError as e:
        raise ApiError(400, type(e).__name__, e.message, _body_field(e.field, body)) from None
    return params


def _body_field(field: str | None, body: Any) -> str | None:
    """Engine field names -> this body's: sampling_params.x -> x (max_tokens as the client sent it,
    logprobs as top_logprobs), prompt -> messages."""
    if field is None:
        return None
    if field == "prompt":
        return "messages"
    name = field.removeprefix("sampling_params.")
    if name == "max_tokens" and body.max_completion_tokens is not None:
        return "max_completion_tokens"
    return "top_logprobs" if name == "logprobs" else name


async def _run(request: Request, state: ServerState, prompt: TokenizedPrompt, params: SamplingParams,
               body: Any) -> RequestOutput:
    fut = state.driver.submit([(prompt, params)], wait=body.wait)
    try:
        outs = await await_future(request, fut, state.driver)
    except ApiError as e:
        e.field = _body_field(e.field, body)
        raise
    return outs[0]
