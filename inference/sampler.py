"""The sampler: logits of the sampling rows in, next tokens and their logprobs out.

Stateless and small. Greedy rows take an argmax of the raw logits. Other rows divide by their
temperature, apply top-k, top-p and min-p, and draw with the exponential race
(argmax of p / E with E ~ Exp(1)), which needs no host sync and no torch.multinomial. A seeded row
draws its noise from a generator seeded by (sequence seed, output position), so its sample does
not depend on what else runs in the batch, nor on preemption. Reported logprobs come from the raw
logits ("raw") or from the processed distribution ("processed"), per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MIX = 0x9E3779B97F4A7C15
_MASK63 = (1 << 63) - 1


def position_seed(seed: int, position: int) -> int:
    """The generator seed of a seeded sequence's token at output `position` (stable, documented)."""
    return ((seed * 1_000_003) ^ ((position + 1) * _MIX)) & _MASK63


@dataclass
class SamplingBatch:
    """Per-row sampling settings of one step, built by the runner. Host flags skip unused work."""

    # per-row tensors, None when every row is greedy
    temperatures: torch.Tensor | None  # [B] float32; 0 marks a greedy row
    top_ks: torch.Tensor | None  # [B] int64; vocab size where disabled
    top_ps: torch.Tensor | None  # [B] float32
    min_ps: torch.Tensor | None  # [B] float32
    processed_logprobs: torch.Tensor | None  # [B] bool: report logprobs of the processed distribution
    row_seeds: list[int | None]  # per-row generator seed (position_seed) or None
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    any_processed: bool
    num_top_logprobs: int  # max over rows; 0 for none

    @classmethod
    def build(cls, params: list, seeds: list[int | None], positions: list[int], vocab_size: int,
              device: torch.device) -> SamplingBatch:
        """params: SamplingParams per row; seeds: the sequences' seeds; positions: output positions."""
        temps = [p.temperature for p in params]
        top_ks = [p.top_k if p.top_k > 0 else vocab_size for p in params]
        top_ps = [p.top_p for p in params]
        min_ps = [p.min_p for p in params]
        processed = [p.logprobs_mode == "processed" for p in params]
        row_seeds = [None if s is None or p.greedy else position_seed(s, pos)
                     for p, s, pos in zip(params, seeds, positions)]

        all_greedy = all(x == 0.0 for x in temps)

        def t(x: list, dtype: torch.dtype) -> torch.Tensor | None:
            # an all-greedy step (the common RL-eval case) needs no per-row tensors at all
            return None if all_greedy else torch.tensor(x, dtype=dtype).to(device, non_blocking=True)

        return cls(
            temperatures=t(temps, torch.float32),
            top_ks=t(top_ks, torch.int64),
            top_ps=t(top_ps, torch.float32),
            min_ps=t(min_ps, torch.float32),
            processed_logprobs=t(processed, torch.bool),
            row_seeds=row_seeds,
            all_greedy=all_greedy,
            any_top_k=any(k < vocab_size for k in top_ks),
            any_top_p=any(p < 1.0 for p in top_ps),
            any_min_p=any(m > 0.0 for m in min_ps),
            any_processed=any(processed),
            num_top_logprobs=max((p.logprobs for p in params), default=0),
        )


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor  # [B] float32, of the sampled tokens
    top_ids: torch.Tensor | None  # [B, K] int64
    top_logprobs: torch.Tensor | None  # [B, K] float32


def sample(logits: torch.Tensor, sb: SamplingBatch, generator: torch.Generator | None = None) -> SamplerOutput:
    """Sample one token per row of `logits` [B, V] (any float dtype; computed in fp32)."""
    logits = logits.float()
    raw_logprobs = torch.log_softmax(logits, dim=-1)
    if sb.all_greedy:
        tokens = logits.argmax(dim=-1)
        dist = raw_logprobs
    else:
        processed = process_logits(logits, sb)
        dist_processed = torch.log_softmax(processed, dim=-1)
        sampled = _exponential_race(dist_processed, sb, generator)
        greedy = logits.argmax(dim=-1)
        tokens = torch.where(sb.temperatures == 0.0, greedy, sampled)
        dist = (torch.where(sb.processed_logprobs[:, None], dist_processed, raw_logprobs)
                if sb.any_processed else raw_logprobs)
    token_logprobs = dist.gather(-1, tokens[:, None]).squeeze(-1)
    top_ids = top_lp = None
    if sb.num_top_logprobs > 0:
        top_lp, top_ids = dist.topk(sb.num_top_logprobs, dim=-1)
    return SamplerOutput(tokens, token_logprobs, top_ids, top_lp)


def process_logits(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p as -inf masks. Greedy rows pass through unscaled."""
    temps = torch.where(sb.temperatures == 0.0, torch.ones_like(sb.temperatures), sb.temperatures)
    x = logits / temps[:, None]
    if sb.any_top_k or sb.any_top_p:
        sorted_x, order = x.sort(dim=-1, descending=True)
        drop = torch.zeros_like(sorted_x, dtype=torch.bool)
        if sb.any_top_k:
            ranks = torch.arange(x.shape[-1], device=x.device)
            drop |= ranks[None, :] >= sb.top_ks[:, None]
        if sb.any_top_p:
            probs = torch.softmax(sorted_x.masked_fill(drop, float("-inf")), dim=-1)
            mass_before = probs.cumsum(dim=-1) - probs
            drop |= mass_before >= sb.top_ps[:, None]  # the top token always stays
        drop_unsorted = torch.zeros_like(drop).scatter_(-1, order, drop)
        x = x.masked_fill(drop_unsorted, float("-inf"))
    if sb.any_min_p:
        probs = torch.softmax(x, dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * sb.min_ps[:, None]
        x = x.masked_fill(probs < threshold, float("-inf"))
    return x


def _exponential_race(logprobs: torch.Tensor, sb: SamplingBatch,
                      generator: torch.Generator | None) -> torch.Tensor:
    """argmax(log p - log E), E ~ Exp(1): an exact draw from softmax without a host sync."""
    noise = torch.empty_like(logprobs).exponential_(generator=generator)
    for row, seed in enumerate(sb.row_seeds):
        if seed is not None:
            g = torch.Generator(device=logprobs.device)
            g.manual_seed(seed)
            noise[row].exponential_(generator=g)
    return (logprobs - noise.log()).argmax(dim=-1)
