"""The streamed (stream=true) forms of /v1/completions and /v1/chat/completions: server-sent events,
token by token as the engine commits them.

The wire: `data: {chunk}\\n\\n` per chunk, then `data: [DONE]\\n\\n`. Rank 0 reports a streamed group's
new tokens after each step (commands.StreamDelta); each becomes one chunk of its choice (`index`),
with its `token_ids` and, when asked, its logprobs. Text is cut from the choice's incremental decode
and held back where a stop string may be starting, so no chunk shows text the final answer cuts; the
choice's last chunk (when its request finishes) carries the rest of the final text and the finish
reason. So a choice's pieces joined are its non-streamed text, and its token_ids joined its tokens
(for a model that emits invalid UTF-8, the texts may differ in replacement characters only).
Completions chunks are `text_completion` objects (legacy logprobs per chunk; an `echo` chunk first);
chat chunks `chat.completion.chunk` objects (a first delta with the role, content deltas with
logprobs.content entries, then an empty delta with the finish_reason), as OpenAI sends them. With
stream_options.include_usage every chunk has "usage": null and a last chunk with no choices carries
the usage (and `weight_version`). While no token comes, an SSE comment (": keep-alive") goes every
second. A client that goes away aborts its request in the engine; an error after the stream started
(the group refused, or a weight sync restarted a streamed sample from its prompt: its tokens sent are
void) is one `data: {"error": {...}}` chunk, as OpenAI streams one.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future
from typing import Any

from inference.core import CompletionOutput, RequestOutput
from inference.text.tokenizer import IncrementalDetokenizer
from sidecar.api.common import ApiError, rank_error_to_api
from sidecar.api.openai_format import chat_logprob_entries, finish_reason, legacy_logprobs, usage
from sidecar.ranks.commands import StreamDelta
from sidecar.ranks.driver import RankError

DONE = b"data: [DONE]\n\n"
KEEPALIVE = b": keep-alive\n\n"
KEEPALIVE_S = 1.0
Piece = tuple[list[int], list[float], list[dict[int, float]] | None, list[int], str]  # ids, lps, tops, offsets, text


def sse(chunk: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(chunk, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


class StreamVoid(Exception):
    """A streamed sample was sent back to its prompt by a weight sync: what was streamed is void."""


class _Choice:
    """One choice as streamed so far: its tokens, and the text sent (a prefix of its final text)."""

    def __init__(self, tokenizer: Any, stops: tuple[str, ...], has_tops: bool) -> None:
        self.detok = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self.stops = stops
        self.hold = max(map(len, stops), default=1) - 1  # a stop string may start in the last hold chars
        self.token_ids: list[int] = []
        self.restarts = 0
        self.sent = ""
        self.has_tops = has_tops

    def add(self, d: StreamDelta) -> Piece:
        if d.first != len(self.token_ids) or (d.restarts != self.restarts and self.token_ids):
            raise StreamVoid("a weight sync restarted this completion from its prompt (on_sync abort or "
                             "max_staleness): the tokens streamed so far are void; retry it")
        self.restarts = d.restarts
        offsets = self._take(d.token_ids)
        text = self.detok.text if self.detok is not None else ""
        end = len(text) - self.hold
        for stop in self.stops:  # a stop string already whole: the engine ends the choice there
            hit = text.find(stop, max(0, len(self.sent) - len(stop)))
            if hit >= 0:
                end = min(end, hit)
        piece = text[len(self.sent):end] if end > len(self.sent) else ""
        self.sent += piece
        tops = list(d.top_logprobs) if d.top_logprobs is not None else None
        return list(d.token_ids), list(d.logprobs), tops, offsets, piece

    def finish(self, c: CompletionOutput) -> Piece:
        """The rest of `c` (its final output) after what was streamed."""
        n = len(self.token_ids)
        if (c.restarts != self.restarts and n) or list(c.token_ids[:n]) != self.token_ids:
            raise StreamVoid("a weight sync restarted this completion from its prompt (on_sync abort or "
                             "max_staleness): the tokens streamed before are void; retry it")
        final = c.text or ""
        offsets = [min(o, len(final)) for o in self._take(c.token_ids[n:])]
        piece = final[len(self.sent):] if final.startswith(self.sent) else ""
        self.sent += piece
        tops = list(c.top_logprobs[n:]) if c.top_logprobs is not None else None
        return list(c.token_ids[n:]), list(c.logprobs[n:]), tops, offsets, piece

    def _take(self, ids: Any) -> list[int]:
        offsets = []
        for t in ids:
            offsets.append(len(self.detok.text) if self.detok is not None else 0)
            if self.detok is not None:
                self.detok.add([t])
        self.token_ids.extend(ids)
        return offsets


class _Format:
    """What one endpoint's stream says: head (before any token), a delta's chunk, the end."""

    def __init__(self, model: str, response_id: str, include_usage: bool) -> None:
        self.model, self.id, self.include_usage = model, response_id, include_usage
        self.created = int(time.time())
        self.extra = {"usage": None} if include_usage else {}

    def head(self) -> Iterator[bytes]:
        return iter(())

    def delta(self, prompt: int, d: StreamDelta) -> Iterator[bytes]:
        raise NotImplementedError

    def done(self, outs: list[RequestOutput]) -> Iterator[bytes]:
        raise NotImplementedError


class CompletionStream(_Format):
    """/v1/completions: choice i * n + j is sample j of prompt i; `echo_texts` (with echo) come first."""

    def __init__(self, model: str, response_id: str, include_usage: bool, tokenizer: Any, n: int, num_prompts: int,
                 stops: tuple[str, ...], logprobs: int | None, echo_texts: list[str] | None) -> None:
        super().__init__(model, response_id, include_usage)
        self.tokenizer, self.n, self.logprobs, self.echo_texts = tokenizer, n, logprobs, echo_texts
        self.choices = [_Choice(tokenizer, stops, bool(logprobs)) for _ in range(n * num_prompts)]

    def _chunk(self, index: int, piece: Piece, finish: str | None) -> bytes:
        ids, lps, tops, offsets, text = piece
        lp = legacy_logprobs(ids, lps, tops, offsets, self.tokenizer) if self.logprobs is not None else None
        return sse({"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                    "choices": [{"index": index, "text": text, "logprobs": lp, "finish_reason": finish,
                                 "token_ids": ids}], **self.extra})

    def head(self) -> Iterator[bytes]:
        for i, text in enumerate(self.echo_texts or []):
            for j in range(self.n):
                yield self._chunk(i * self.n + j, ([], [], None, [], text), None)

    def delta(self, prompt: int, d: StreamDelta) -> Iterator[bytes]:
        index = prompt * self.n + d.index
        yield self._chunk(index, self.choices[index].add(d), None)

    def done(self, outs: list[RequestOutput]) -> Iterator[bytes]:
        for i, out in enumerate(outs):
            for c in out.outputs:
                index = i * self.n + c.index
                yield self._chunk(index, self.choices[index].finish(c), finish_reason(c))
        if self.include_usage:
            yield sse({"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                       "choices": [], "usage": usage(outs),
                       "weight_version": min((o.weight_version for o in outs), default=0)})
        yield DONE


class ChatStream(_Format):
    """/v1/chat/completions: one prompt, choice j is sample j."""

    def __init__(self, model: str, response_id: str, include_usage: bool, tokenizer: Any, n: int,
                 stops: tuple[str, ...], logprobs: bool) -> None:
        super().__init__(model, response_id, include_usage)
        self.tokenizer, self.logprobs = tokenizer, logprobs
        self.choices = [_Choice(tokenizer, stops, logprobs) for _ in range(n)]

    def _chunk(self, index: int, delta: dict[str, Any], piece: Piece | None, finish: str | None) -> bytes:
        ids: list[int] = []
        lp = None
        if piece is not None:
            ids, lps, tops, _, text = piece
            delta = {"content": text}
            if self.logprobs:
                lp = {"content": chat_logprob_entries(ids, lps, tops, self.tokenizer)}
        choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish, "token_ids": ids}
        return sse({"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                    "system_fingerprint": None, "choices": [choice], **self.extra})

    def head(self) -> Iterator[bytes]:
        for index in range(len(self.choices)):
            yield self._chunk(index, {"role": "assistant", "content": ""}, None, None)

    def delta(self, prompt: int, d: StreamDelta) -> Iterator[bytes]:
        yield self._chunk(d.index, {}, self.choices[d.index].add(d), None)

    def done(self, outs: list[RequestOutput]) -> Iterator[bytes]:
        (out,) = outs
        for c in out.outputs:
            rest = self.choices[c.index].finish(c)
            if rest[0] or rest[4]:
                yield self._chunk(c.index, {}, rest, None)
            yield self._chunk(c.index, {}, None, finish_reason(c))
        if self.include_usage:
            yield sse({"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                       "system_fingerprint": None, "choices": [], "usage": usage(outs),
                       "prompt_token_ids": list(out.prompt_token_ids), "weight_version": out.weight_version})
        yield DONE


class StreamFeed:
    """Where the driver thread hands a streamed group's deltas (Driver.submit's on_progress) and its
    end, to the event loop of the response that streams them."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[int, StreamDelta] | None] = asyncio.Queue()

    def on_progress(self, prompt: int, delta: StreamDelta) -> None:  # the driver thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (prompt, delta))

    def watch(self, fut: Future) -> None:
        """After every delta (the driver calls on_progress before it resolves the future): None."""
        fut.add_done_callback(lambda _: self.loop.call_soon_threadsafe(self.queue.put_nowait, None))


async def stream_body(fmt: _Format, feed: StreamFeed, fut: Future, driver: Any,
                      rename: Callable[[ApiError], ApiError]) -> AsyncIterator[bytes]:
    """The SSE body of a queued, streamed group. The group is aborted if the stream ends before it
    finished (the client went away: the write failed, or Starlette cancelled the stream)."""
    feed.watch(fut)
    try:
        for chunk in fmt.head():
            yield chunk
        while True:
            try:
                item = await asyncio.wait_for(feed.queue.get(), KEEPALIVE_S)
            except asyncio.TimeoutError:
                yield KEEPALIVE  # a closed connection fails this write: the finally below aborts the group
                continue
            if item is None:
                break
            for chunk in fmt.delta(*item):
                yield chunk
        try:
            outs = fut.result()
        except RankError as e:
            yield _error(rename(rank_error_to_api(e)))
            return
        for chunk in fmt.done(outs):
            yield chunk
    except StreamVoid as e:
        yield _error(ApiError(409, "StreamVoid", str(e), "stream"))
    finally:
        if not fut.done():
            driver.abort(fut)


def _error(e: ApiError) -> bytes:
    return sse({"error": {"message": e.message, "type": e.type, "param": e.field, "code": e.code, "field": e.field,
                          "rank": e.rank}}) + DONE
