"""Presence, frequency and repetition penalties: a row's logits changed in place before sampling.

Semantics (vLLM's, which follow OpenAI's and HF's):
- repetition r (HF): every token id that occurs in the prompt or the completion so far has its logit
  divided by r when positive, multiplied by r otherwise; applied first.
- frequency f and presence p (OpenAI): over the completion's tokens only, logit -= f * count + p * (count > 0).
Only rows that ask for a penalty are read and written (`penalized_rows` empty: nothing runs), so the
default path, its CUDA graphs (their logits buffer is changed in place before the sampling graph
reads it) and the batch-invariant mode are untouched by a batch without penalties; a penalty is
elementwise per row, so a penalized row's result does not depend on its batch either. The token ids
must be real (no async placeholders): the engine steps synchronously while a request has a penalty.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

import torch


def penalized_rows(seqs: Seq[Any]) -> list[int]:
    """The rows whose sequence's params set a penalty."""
    return [i for i, s in enumerate(seqs) if s.params.has_penalties]


def apply_penalties(logits: torch.Tensor, rows: list[int], seqs: Seq[Any]) -> None:
    """Penalize logits [B, V] in place on `rows`; seqs[row] has token_ids (prompt then completion),
    num_prompt_tokens and params. Computed in float32, written back in the logits' dtype."""
    if not rows:
        return
    device, vocab = logits.device, logits.shape[-1]
    gen_r: list[int] = []
    gen_t: list[int] = []
    all_r: list[int] = []
    all_t: list[int] = []
    for k, row in enumerate(rows):
        s = seqs[row]
        ids = s.token_ids
        assert min(ids, default=0) >= 0, "penalties need real token ids (no async placeholders)"
        completion = ids[s.num_prompt_tokens:]
        gen_r += [k] * len(completion)
        gen_t += completion
        all_r += [k] * len(ids)
        all_t += ids
    params = [seqs[r].params for r in rows]
    rep = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32, device=device)[:, None]
    freq = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32, device=device)[:, None]
    pres = torch.tensor([p.presence_penalty for p in params], dtype=torch.float32, device=device)[:, None]
    counts = torch.zeros(len(rows), vocab, dtype=torch.float32, device=device)
    if gen_t:
        counts.index_put_((torch.tensor(gen_r, device=device), torch.tensor(gen_t, device=device)),
                          torch.ones(len(gen_t), dtype=torch.float32, device=device), accumulate=True)
    seen = torch.zeros(len(rows), vocab, dtype=torch.bool, device=device)
    seen[torch.tensor(all_r, device=device), torch.tensor(all_t, device=device)] = True
    index = torch.tensor(rows, device=device)
    x = logits.index_select(0, index).float()
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x = x - freq * counts - pres * (counts > 0).float()
    logits.index_copy_(0, index, x.to(logits.dtype))
