"""Presence, frequency and repetition penalties: a row's logits changed in place before sampling.

Semantics (vLLM's, which follow OpenAI's and HF's):
- repetition r (HF): every token id that occurs in the prompt or the completion so far has its logit
  divided by r when positive, multiplied by r otherwise; applied first.
- frequency f and presence p (OpenAI): over the completion's tokens only, logit -= f * count + p * (count > 0).
Only rows that ask for a penalty are read and written (`penalized_rows` empty: nothing runs), so the
default path, its CUDA graphs (their logits buffer is changed in place before the sampling graph
reads it) and the batch-invariant mode are untouched by a batch without penalties; a penalty is
elementwise per row, so a penalized row's result does not depend on its batch either.
The counts are rebuilt each step from the sequences' token ids, so no state can go stale (a preemption,
a restart from the prompt). Under async scheduling a sequence's last token may be a placeholder for
what the step in flight samples: `resolve` writes those tokens in on the device, in stream order after
that step's sampling (inference/runner/pending_tokens.py), and every copy here is queued without
waiting, so penalties add no host sync and the engine keeps overlapping steps.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any

import torch

from inference.batch import to_device


def penalized_rows(seqs: Seq[Any]) -> list[int]:
    """The rows whose sequence's params set a penalty."""
    return [i for i, s in enumerate(seqs) if s.params.has_penalties]


def apply_penalties(logits: torch.Tensor, rows: list[int], seqs: Seq[Any],
                    resolve: Callable[[torch.Tensor], object] | None = None) -> None:
    """Penalize logits [B, V] in place on `rows`; seqs[row] has token_ids (prompt then completion),
    num_prompt_tokens and params. Computed in float32, written back in the logits' dtype. `resolve`:
    replaces the placeholder ids (negative) of an int64 device vector with their tokens, in place
    (needed when a sequence has one; see the module docstring)."""
    if not rows:
        return
    device, vocab, k = logits.device, logits.shape[-1], len(rows)
    gen_r: list[int] = []
    all_r: list[int] = []
    gen_t: list[int] = []
    all_t: list[int] = []
    for i, row in enumerate(rows):
        s = seqs[row]
        ids = s.token_ids
        completion = ids[s.num_prompt_tokens:]
        gen_r += [i] * len(completion)
        gen_t += completion
        all_r += [i] * len(ids)
        all_t += ids
    # one int64 copy: the rows, the (row, token) pairs of the completions and of the whole sequences;
    # the token ids last and together, so placeholders among them are resolved in one call
    n_gen, n_all = len(gen_t), len(all_t)
    packed = to_device(rows + gen_r + all_r + gen_t + all_t, device)
    tokens = packed[k + n_gen + n_all:]
    if min(all_t) < 0:  # a placeholder is a completion's last token, so all_t holds every one
        assert resolve is not None, "placeholder token ids without the step in flight's sampled tokens"
        resolve(tokens)
    index, gen_rows, all_rows = packed[:k], packed[k:k + n_gen], packed[k + n_gen:k + n_gen + n_all]
    gen_tokens, all_tokens = tokens[:n_gen], tokens[n_gen:]
    params = [seqs[r].params for r in rows]
    scales = to_device([[p.repetition_penalty for p in params], [p.frequency_penalty for p in params],
                        [p.presence_penalty for p in params]], device, torch.float32)
    rep, freq, pres = (scales[j][:, None] for j in range(3))
    counts = torch.zeros(k, vocab, dtype=torch.float32, device=device)
    if n_gen:
        counts.index_put_((gen_rows, gen_tokens), torch.ones(n_gen, dtype=torch.float32, device=device),
                          accumulate=True)
    seen = torch.zeros(k, vocab, dtype=torch.bool, device=device)
    seen.index_put_((all_rows, all_tokens), torch.ones((), dtype=torch.bool, device=device))
    x = logits.index_select(0, index).float()
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x = x - freq * counts - pres * (counts > 0).float()
    logits.index_copy_(0, index, x.to(logits.dtype))
