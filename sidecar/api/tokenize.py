"""POST /tokenize and /detokenize, with vLLM's bodies: the served model's tokenizer over HTTP, so a
client counts tokens, or builds token-id prompts, exactly as the sidecar will.

/tokenize takes a text `prompt` (special tokens added unless add_special_tokens is false) or chat
`messages` (rendered with the model's chat template, then encoded without special tokens unless
add_special_tokens is true: the template wrote them); it answers {count, max_model_len, tokens,
token_strs (with return_token_strs, else null)}. /detokenize takes `tokens` and answers {prompt}: the
ids decoded with special tokens kept, so that tokenize then detokenize gives the text back. The
text passes the limits of a prompt (--max-prompt-chars, Unicode), the ids the vocabulary; both run
in a worker thread. A model without tokenizer.json is a 400; `model` is checked as on /v1 routes.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter

from inference.core import InvalidRequestError
from inference.text.prompts import check_text, check_token_ids
from sidecar.api.common import ApiError, ServerState, check_model
from sidecar.api.models import DetokenizeRequest, TokenizeRequest
from sidecar.api.openai_format import token_text


def add_tokenize_routes(router: APIRouter, state: ServerState) -> None:
    @router.post("/tokenize", summary="Token ids of a prompt or of chat messages (vLLM's body)")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        check_model(state, body.model)
        ids = await asyncio.to_thread(_tokenize, state, body)
        strs = [token_text(state.tokenizer, t) for t in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": state.plans[0].max_model_len, "tokens": ids,
                "token_strs": strs}

    @router.post("/detokenize", summary="The text of token ids (vLLM's body)")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        check_model(state, body.model)
        tokenizer = _tokenizer(state, "tokens")
        try:
            check_token_ids(body.tokens, state.vocab_size, "tokens")
        except InvalidRequestError as e:
            raise ApiError(400, type(e).__name__, e.message, e.field) from None
        text = await asyncio.to_thread(tokenizer.decode, body.tokens, skip_special_tokens=False)
        return {"prompt": text}


def _tokenizer(state: ServerState, field: str) -> Any:
    if state.tokenizer is None:
        raise ApiError(400, "InvalidRequestError", "this model has no tokenizer.json", field)
    return state.tokenizer


def _tokenize(state: ServerState, body: TokenizeRequest) -> list[int]:
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(400, "InvalidRequestError", "send either prompt or messages", "prompt")
    field = "prompt" if body.prompt is not None else "messages"
    tokenizer = _tokenizer(state, field)
    try:
        if body.prompt is not None:
            text, special = body.prompt, body.add_special_tokens is not False
        else:
            assert body.messages is not None
            text = tokenizer.apply_chat_template([m.template_dict() for m in body.messages],
                                                 add_generation_prompt=body.add_generation_prompt,
                                                 **(body.chat_template_kwargs or {}))
            special = bool(body.add_special_tokens)
        check_text(text, field, state.config.max_prompt_chars)
        return list(state.intake.tokenizer.encode(text, add_special_tokens=special))
    except InvalidRequestError as e:
        raise ApiError(400, type(e).__name__, e.message, e.field if e.field != "prompt" else field) from None
