"""The OpenAI response shapes, built from RequestOutputs: /v1/completions and /v1/chat/completions.

Completions: choices are numbered prompt-major: choice i * n + j is sample j of prompt i; with `echo`
its text starts with the prompt's (the text sent, or the prompt's ids decoded). `logprobs`
follows the legacy completions format (tokens, token_logprobs, top_logprobs, text_offset);
`text_offset` is where each token's text starts in the completion text, which is decoded without
special tokens: a sampled special token adds nothing to it (its `tokens` entry still names it).
Chat: one prompt, its n samples as choices; `logprobs.content` holds {token, logprob, bytes,
top_logprobs} per token. Both add `weight_version` (the oldest version that produced any token of
the call) for RL callers, and every choice `token_ids` (the sampled ids: no re-tokenizing); a
completions choice also its `prompt_token_ids`, a chat response one `prompt_token_ids`.
The streamed forms of the same objects: sidecar/api/openai_stream.py.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from inference.core import CompletionOutput, RequestOutput
from inference.text.tokenizer import IncrementalDetokenizer


def completion_response(outs: list[RequestOutput], model: str, logprobs: int | None, tokenizer: Any,
                        response_id: str, echo: bool = False) -> dict[str, Any]:
    choices = []
    for i, out in enumerate(outs):
        n = len(out.outputs)
        head = echo_text(out, tokenizer) if echo else ""
        for c in out.outputs:
            choices.append({
                "index": i * n + c.index,
                "text": head + (c.text if c.text is not None else ""),
                "finish_reason": finish_reason(c),
                "logprobs": _logprobs(c, tokenizer) if logprobs is not None else None,
                "token_ids": list(c.token_ids), "prompt_token_ids": list(out.prompt_token_ids),
            })
    return {
        "id": response_id, "object": "text_completion", "created": int(time.time()), "model": model,
        "choices": choices, "usage": usage(outs), "weight_version": min((o.weight_version for o in outs), default=0),
    }


def usage(outs: list[RequestOutput]) -> dict[str, int]:
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    completion_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def finish_reason(c: CompletionOutput) -> str | None:
    return c.finish_reason.value if c.finish_reason is not None else None


def echo_text(out: RequestOutput, tokenizer: Any) -> str:
    """The prompt as echo repeats it: the text sent, or its token ids decoded (special tokens kept)."""
    return echo_prompt(out.prompt if out.prompt is not None else out.prompt_token_ids, tokenizer)


def echo_prompt(prompt: str | Sequence[int], tokenizer: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    if tokenizer is None:
        return "".join(f"<{t}>" for t in prompt)
    return str(tokenizer.decode(list(prompt), skip_special_tokens=False))


def token_text(tokenizer: Any, token_id: int) -> str:
    if tokenizer is None:
        return f"<{token_id}>"  # a model without tokenizer.json: ids only
    return str(tokenizer.decode([token_id], skip_special_tokens=False))


def text_offsets(c: CompletionOutput, tokenizer: Any) -> list[int]:
    """Where each token's text starts in c.text. The engine decodes the completion alone, skipping
    special tokens, so the offsets come from the same decode run token by token: a special token (and
    a token whose bytes complete a character only later) adds nothing; past a stop string that cut
    the text, offsets stop at its end."""
    if tokenizer is None:  # ids only: each token is shown as "<id>"
        offsets, pos = [], 0
        for t in c.token_ids:
            offsets.append(pos)
            pos += len(f"<{t}>")
        return offsets
    detok = IncrementalDetokenizer(tokenizer)
    end = len(c.text) if c.text is not None else None
    offsets = []
    for t in c.token_ids:
        offsets.append(len(detok.text) if end is None else min(len(detok.text), end))
        detok.add([t])
    return offsets


def _logprobs(c: CompletionOutput, tokenizer: Any) -> dict[str, Any]:
    """The legacy completions logprobs object of a whole choice."""
    return legacy_logprobs(c.token_ids, c.logprobs, c.top_logprobs, text_offsets(c, tokenizer), tokenizer)


def legacy_logprobs(token_ids: Sequence[int], logprobs: Sequence[float], top: Sequence[dict[int, float]] | None,
                    offsets: Sequence[int], tokenizer: Any) -> dict[str, Any]:
    """The legacy completions logprobs object of some tokens (a choice, or a streamed chunk's)."""
    return {"tokens": [token_text(tokenizer, t) for t in token_ids], "token_logprobs": list(logprobs),
            "top_logprobs": [{token_text(tokenizer, tid): lp for tid, lp in d.items()} for d in top]
            if top is not None else None, "text_offset": list(offsets)}


def chat_response(out: RequestOutput, model: str, logprobs: bool, tokenizer: Any,
                  response_id: str) -> dict[str, Any]:
    """The chat.completion object of one prompt's completions (choice j is sample j)."""
    choices = [{
        "index": c.index,
        "message": {"role": "assistant", "content": c.text if c.text is not None else ""},
        "finish_reason": finish_reason(c),
        "logprobs": {"content": chat_logprobs(c, tokenizer)} if logprobs else None,
        "token_ids": list(c.token_ids),
    } for c in out.outputs]
    return {
        "id": response_id, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": choices, "system_fingerprint": None, "usage": usage([out]),
        "prompt_token_ids": list(out.prompt_token_ids), "weight_version": out.weight_version,
    }


def chat_logprobs(c: CompletionOutput, tokenizer: Any) -> list[dict[str, Any]]:
    """logprobs.content of a chat choice: one entry per token, its top_logprobs ranked."""
    return chat_logprob_entries(c.token_ids, c.logprobs, c.top_logprobs, tokenizer)


def chat_logprob_entries(token_ids: Sequence[int], logprobs: Sequence[float],
                         tops: Sequence[dict[int, float]] | None, tokenizer: Any) -> list[dict[str, Any]]:
    """logprobs.content entries of some tokens (a choice, or a streamed chunk's)."""
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = []
    for i, (token_id, logprob) in enumerate(zip(token_ids, logprobs)):
        top = tops[i] if tops is not None else {}
        ranked = sorted(top.items(), key=lambda kv: kv[1], reverse=True)
        content.append({**entry(token_id, logprob), "top_logprobs": [entry(t, lp) for t, lp in ranked]})
    return content
