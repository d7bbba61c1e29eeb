"""OpenAI-compatible routes: GET /v1/models, GET /v1/models/{id}, POST /v1/completions and
/v1/chat/completions, each non-streamed or streamed (stream=true: sidecar/api/openai_stream.py).

A chat request is rendered with the served model's own chat template (tokenizer_config.json or
chat_template.jinja; inference/text/chat_template.py), encoded without adding special tokens (the
template wrote them), and submitted as token ids: the same tokens `LLM.generate` produces for the
rendered text. Both pass the intake of /generate (sidecar/api/intake.py, docs/limits.md), tokenizing
off the event loop. RL extras on the answers: `weight_version`, `token_ids` per choice,
`prompt_token_ids`, and logprobs in OpenAI's shapes (openai_format.py).

OpenAI's rules kept: `model` must be the served name (--served-model-name) or left out, else a 404
naming both (code model_not_found); a known OpenAI field this server does not implement (tools,
response_format other than text, logit_bias, ...) is one 400 naming it (code unsupported_parameter);
an unknown field is a 400 "Unrecognized request argument supplied" naming it, as OpenAI answers.
Every error is the app's body, which includes OpenAI's {message, type, param, code}.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from inference.core import InvalidRequestError, SamplingParams
from inference.text.chat_template import check_template_kwargs
from sidecar.api.common import ApiError, ServerState, await_future, check_model
from sidecar.api.models import ChatCompletionRequest, CompletionRequest
from sidecar.api.openai_format import chat_response, completion_response, echo_prompt
from sidecar.api.openai_stream import ChatStream, CompletionStream, StreamFeed, stream_body
from sidecar.api.tokenize import add_tokenize_routes
from sidecar.ranks.commands import TokenizedPrompt

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

# OpenAI fields not implemented here -> the values that mean "not used" (accepted, nothing to do)
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}), "logit_bias": (None, {}), "suffix": (None, ""),
    "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,), "reasoning_effort": (None,),
    "web_search_options": (None,), "verbosity": (None,), "best_of": (None, 1),
}
# OpenAI fields that change nothing a client can observe of a self-hosted model: accepted, ignored
IGNORED = frozenset({"parallel_tool_calls", "metadata", "service_tier", "store", "prompt_cache_key",
                     "safety_identifier"})


def add_openai_routes(router: APIRouter, state: ServerState, check_params: Callable[..., SamplingParams],
                      submit_group: Callable[..., Any], rename_group_error: Callable[..., ApiError]) -> None:
    """The routes on `router`; check_params, submit_group and rename_group_error are the app's
    (sidecar/api/app.py): the same checks and queueing as /generate."""
    add_tokenize_routes(router, state)

    @router.get("/v1/models", summary="OpenAI-compatible model list: the one served model")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(state)]}

    @router.get("/v1/models/{model_id:path}", summary="OpenAI-compatible model retrieve: 404 unless served")
    async def model(model_id: str) -> dict[str, Any]:
        check_model(state, model_id)
        return model_card(state)

    @router.post("/v1/completions", summary="OpenAI-compatible completions (a subset; stream too)")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        check_openai_body(state, body)
        if body.echo and body.logprobs is not None:
            raise _unsupported("echo", "echo with logprobs is not supported (prompt logprobs are not computed)")
        params = check_params(body, state, "")
        prompts = body.prompts()
        if not prompts:
            raise ApiError(400, "InvalidRequestError", "must not be empty", "prompt")
        names = ("prompt", "", False)
        rid, echo = f"cmpl-{uuid.uuid4().hex}", bool(body.echo)
        if body.stream:
            feed = StreamFeed()
            fut = await submit_group(state, prompts, [params] * len(prompts), body.wait, names,
                                     on_progress=feed.on_progress)
            texts = [echo_prompt(p, state.tokenizer) for p in prompts] if echo else None
            fmt = CompletionStream(state.served_model_name, rid, _include_usage(body), state.tokenizer, params.n,
                                   len(prompts), params.stop, body.logprobs, texts)
            return _streaming(stream_body(fmt, feed, fut, state.driver, lambda e: rename_group_error(e, names)))
        fut = await submit_group(state, prompts, [params] * len(prompts), body.wait, names)
        try:
            outs = await await_future(request, fut, state.driver)
        except ApiError as e:
            raise rename_group_error(e, names) from None
        return completion_response(outs, state.served_model_name, body.logprobs, state.tokenizer, rid, echo)

    @router.post("/v1/chat/completions", summary="OpenAI-compatible chat completions, with the model's chat "
                                                 "template (stream too)")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        check_openai_body(state, body)
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "InvalidRequestError", "needs logprobs: true", "top_logprobs")
        chars = message_chars(body)
        state.intake.check_chat(body.n if body.n is not None else 1, chars, len(body.messages))
        prompt = await state.intake.run_text(chars, render_prompt, state, body)  # template + tokenizer off the loop
        params = chat_params(state, body, len(prompt.token_ids))
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        if body.stream:
            feed = StreamFeed()
            fut = state.driver.submit([(prompt, params)], wait=body.wait, on_progress=feed.on_progress)
            fmt = ChatStream(state.served_model_name, rid, _include_usage(body), state.tokenizer, params.n,
                             params.stop, bool(body.logprobs))
            return _streaming(stream_body(fmt, feed, fut, state.driver, lambda e: _renamed(e, body)))
        fut = state.driver.submit([(prompt, params)], wait=body.wait)
        try:
            outs = await await_future(request, fut, state.driver)
        except ApiError as e:
            raise _renamed(e, body) from None
        return chat_response(outs[0], state.served_model_name, bool(body.logprobs), state.tokenizer, rid)


def model_card(state: ServerState) -> dict[str, Any]:
    """The served model as /v1/models lists it, with its max_model_len and current weight version."""
    target = state.driver.held_weights().get("target", {})
    return {"id": state.served_model_name, "object": "model", "created": int(state.started), "owned_by": "sidecar",
            "root": state.plans[0].model, "max_model_len": state.plans[0].max_model_len,
            "weight_version": target.get("version"), "torn": target.get("torn", False),
            "needs_sync": target.get("needs_sync")}


def check_openai_body(state: ServerState, body: Any) -> None:
    """The model, then the fields sent that this server does not implement or does not know (one 400
    naming the field), then stream_options without stream."""
    check_model(state, body.model)
    for name, value in (body.model_extra or {}).items():
        if name in IGNORED:
            continue
        if name not in UNSUPPORTED:
            raise ApiError(400, "InvalidRequestError", f"Unrecognized request argument supplied: {name or repr(name)}",
                           name or "body")
        if value not in UNSUPPORTED[name] and not (name == "best_of" and value == body.n):
            raise _unsupported(name, f"{name} is not supported by this server (send null or leave it out)")
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, "InvalidRequestError", "only allowed with stream: true", "stream_options")
    if getattr(body, "return_routing", None):
        raise _unsupported("return_routing", "an OpenAI response has no place for routing: ask /generate or "
                                             "/rollouts for it")


def _unsupported(name: str, message: str) -> ApiError:
    return ApiError(400, "InvalidRequestError", message, name, code="unsupported_parameter")


def _streaming(chunks: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(chunks, media_type="text/event-stream", headers=SSE_HEADERS)


def _renamed(e: ApiError, body: Any) -> ApiError:
    e.field = _body_field(e.field, body)
    return e


def _include_usage(body: Any) -> bool:
    return bool(body.stream_options is not None and body.stream_options.include_usage)


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
        check_template_kwargs(body.chat_template_kwargs or {})
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
        state.intake.check_params(params)
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
