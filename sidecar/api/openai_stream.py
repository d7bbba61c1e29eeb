"""The streamed (stream=true) forms of /v1/completions and /v1/chat/completions: server-sent events.

The wire: `data: {chunk}\\n\\n` per chunk, then `data: [DONE]\\n\\n`. A chunk carries one token of one
choice (choices interleaved by position, each with its `index`); a choice's pieces of text joined are
exactly its non-streamed text (they are cut from it at each token's text offset, openai_format.py),
and its `token_ids` joined its token ids. Completions chunks are `text_completion` objects (legacy
logprobs per token; finish_reason on the choice's last chunk); chat chunks are `chat.completion.chunk`
objects (a first delta with the role, content deltas with logprobs.content entries, then an empty
delta with the finish_reason), as OpenAI sends them. With stream_options.include_usage every chunk
has "usage": null and a last chunk with no choices carries the usage (and `weight_version`).

The chunks are built from the finished outputs (`stream_when_done`): the response starts at once,
sends an SSE comment (": keep-alive") every second while the request runs, and then the chunks, so
the text arrives when the request finishes, not token by token (docs/limits.md). A client that goes
away aborts its request in the engine (the write fails or Starlette cancels the stream; either way
the request's future is aborted). An error after the response started (a rank refused the group, the
sidecar fell asleep with wait=false) is one `data: {"error": {...}}` chunk, as OpenAI streams one.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future
from typing import Any

from inference.core import CompletionOutput, RequestOutput
from sidecar.api.common import ApiError, rank_error_to_api
from sidecar.api.openai_format import (
    chat_logprobs,
    echo_text,
    finish_reason,
    text_offsets,
    token_text,
    usage,
)
from sidecar.ranks.driver import RankError

DONE = b"data: [DONE]\n\n"
KEEPALIVE = b": keep-alive\n\n"
KEEPALIVE_S = 1.0


async def stream_when_done(fut: Future, driver: Any, chunks: Callable[[list[RequestOutput]], Iterator[bytes]],
                           rename: Callable[[ApiError], ApiError]) -> AsyncIterator[bytes]:
    """The SSE body of a queued group: keep-alive comments while it runs, then `chunks(outputs)`; an
    error as one error chunk (its field renamed by `rename`). The group is aborted if the stream ends
    before it finished (the client went away)."""
    wrapped = asyncio.wrap_future(fut)
    try:
        while True:
            done, _ = await asyncio.wait({wrapped}, timeout=KEEPALIVE_S)
            if done:
                break
            yield KEEPALIVE  # a closed connection fails this write: the finally below aborts the group
        try:
            outs = wrapped.result()
        except RankError as e:
            api = rename(rank_error_to_api(e))
            yield sse({"error": {"message": api.message, "type": api.type, "param": api.field, "code": api.code,
                                 "field": api.field, "rank": api.rank}})
            yield DONE
            return
        for chunk in chunks(outs):
            yield chunk
    finally:
        if not fut.done():
            driver.abort(fut)


def sse(chunk: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(chunk, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def text_pieces(c: CompletionOutput, tokenizer: Any) -> list[str]:
    """Each token's piece of c.text (empty for a token that adds none); joined they are c.text."""
    text = c.text or ""
    if tokenizer is None or not c.token_ids:
        return [""] * (len(c.token_ids) - 1) + [text] if c.token_ids else []
    offsets = [*text_offsets(c, tokenizer), len(text)]
    return [text[offsets[i]:offsets[i + 1]] for i in range(len(c.token_ids))]


def _interleaved(choices: list[tuple[int, CompletionOutput]]) -> Iterator[tuple[int, CompletionOutput, int]]:
    """(choice index, completion, token position): position-major, as choices would stream side by side."""
    longest = max((len(c.token_ids) for _, c in choices), default=0)
    for pos in range(longest):
        for index, c in choices:
            if pos < len(c.token_ids):
                yield index, c, pos


def completion_chunks(outs: list[RequestOutput], model: str, logprobs: int | None, tokenizer: Any,
                      response_id: str, include_usage: bool, echo: bool) -> Iterator[bytes]:
    created = int(time.time())
    extra = {"usage": None} if include_usage else {}

    def chunk(index: int, text: str, lp: dict[str, Any] | None, finish: str | None,
              token_ids: list[int]) -> bytes:
        return sse({"id": response_id, "object": "text_completion", "created": created, "model": model,
                    "choices": [{"index": index, "text": text, "logprobs": lp, "finish_reason": finish,
                                 "token_ids": token_ids}], **extra})

    choices = [(i * len(out.outputs) + c.index, c) for i, out in enumerate(outs) for c in out.outputs]
    if echo:
        for i, out in enumerate(outs):
            for c in out.outputs:
                yield chunk(i * len(out.outputs) + c.index, echo_text(out, tokenizer), None, None, [])
    pieces = {index: text_pieces(c, tokenizer) for index, c in choices}
    offsets = {index: text_offsets(c, tokenizer) for index, c in choices} if logprobs is not None else {}
    for index, c, pos in _interleaved(choices):
        lp = None
        if logprobs is not None:
            top = c.top_logprobs[pos] if c.top_logprobs is not None else None
            lp = {"tokens": [token_text(tokenizer, c.token_ids[pos])], "token_logprobs": [c.logprobs[pos]],
                  "top_logprobs": [{token_text(tokenizer, t): v for t, v in top.items()}] if top is not None else None,
                  "text_offset": [offsets[index][pos]]}
        last = pos == len(c.token_ids) - 1
        yield chunk(index, pieces[index][pos], lp, finish_reason(c) if last else None, [c.token_ids[pos]])
    for index, c in choices:
        if not c.token_ids:  # nothing generated (aborted): its finish still comes
            yield chunk(index, c.text or "", None, finish_reason(c), [])
    if include_usage:
        yield sse({"id": response_id, "object": "text_completion", "created": created, "model": model,
                   "choices": [], "usage": usage(outs),
                   "weight_version": min((o.weight_version for o in outs), default=0)})
    yield DONE


def chat_chunks(out: RequestOutput, model: str, logprobs: bool, tokenizer: Any, response_id: str,
                include_usage: bool) -> Iterator[bytes]:
    created = int(time.time())
    extra = {"usage": None} if include_usage else {}

    def chunk(index: int, delta: dict[str, Any], lp: list[dict[str, Any]] | None, finish: str | None,
              token_ids: list[int]) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": {"content": lp} if lp is not None else None,
                  "finish_reason": finish, "token_ids": token_ids}
        return sse({"id": response_id, "object": "chat.completion.chunk", "created": created, "model": model,
                    "system_fingerprint": None, "choices": [choice], **extra})

    choices = [(c.index, c) for c in out.outputs]
    for index, _ in choices:
        yield chunk(index, {"role": "assistant", "content": ""}, None, None, [])
    pieces = {index: text_pieces(c, tokenizer) for index, c in choices}
    entries = {index: chat_logprobs(c, tokenizer) for index, c in choices} if logprobs else {}
    for index, c, pos in _interleaved(choices):
        yield chunk(index, {"content": pieces[index][pos]}, [entries[index][pos]] if logprobs else None, None,
                    [c.token_ids[pos]])
    for index, c in choices:
        yield chunk(index, {}, None, finish_reason(c), [])
    if include_usage:
        yield sse({"id": response_id, "object": "chat.completion.chunk", "created": created, "model": model,
                   "system_fingerprint": None, "choices": [], "usage": usage([out]),
                   "prompt_token_ids": list(out.prompt_token_ids), "weight_version": out.weight_version})
    yield DONE
