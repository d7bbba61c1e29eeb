"""The OpenAI /v1/completions response shape, built from RequestOutputs.

Choices are numbered prompt-major: choice i * n + j is sample j of prompt i. `logprobs` follows the
legacy completions format (tokens, token_logprobs, top_logprobs, text_offset); `text_offset` counts
characters from the start of the completion text. A `weight_version` field (the oldest version
that produced any token of the call) is added for RL callers.
"""

from __future__ import annotations

import time
from typing import Any

from inference.core import CompletionOutput, RequestOutput


def completion_response(outs: list[RequestOutput], model: str, logprobs: int | None, tokenizer: Any,
                        response_id: str) -> dict[str, Any]:
    choices = []
    prompt_tokens = completion_tokens = 0
    for i, out in enumerate(outs):
        prompt_tokens += len(out.prompt_token_ids)
        n = len(out.outputs)
        for c in out.outputs:
            completion_tokens += len(c.token_ids)
            choices.append({
                "index": i * n + c.index,
                "text": c.text if c.text is not None else "",
                "finish_reason": c.finish_reason.value if c.finish_reason is not None else None,
                "logprobs": _logprobs(c, tokenizer) if logprobs is not None else None,
            })
    return {
        "id": response_id, "object": "text_completion", "created": int(time.time()), "model": model,
        "choices": choices,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
        "weight_version": min((o.weight_version for o in outs), default=0),
    }


def _token_text(tokenizer: Any, token_id: int) -> str:
    if tokenizer is None:
        return f"<{token_id}>"  # a model without tokenizer.json: ids only
    return str(tokenizer.decode([token_id], skip_special_tokens=False))


def _logprobs(c: CompletionOutput, tokenizer: Any) -> dict[str, Any]:
    tokens = [_token_text(tokenizer, t) for t in c.token_ids]
    offsets, pos = [], 0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    top = None
    if c.top_logprobs is not None:
        top = [{_token_text(tokenizer, tid): lp for tid, lp in d.items()} for d in c.top_logprobs]
    return {"tokens": tokens, "token_logprobs": list(c.logprobs), "top_logprobs": top, "text_offset": offsets}
