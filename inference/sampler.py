"""The sampler: logits of the sampling rows in, next tokens and their logprobs out.

Stateless and small. Greedy rows take an argmax of the raw logits. Other rows divide by their
temperature, apply top-k, top-p and min-p, and draw with the exponential race
(argmax of p / E with E ~ Exp(1)), which needs no host sync and no torch.multinomial. A seeded row
draws its noise from a generator seeded by (sequence seed, output position), so its sample does
not depend on what else runs in the batch, nor on preemption. Reported logprobs come from the raw
logits ("raw") or from the processed distribution ("processed"), per row.

No [B, V] log_softmax is materialized: per row, one reduction gives the max, the first argmax and
log(sum(exp(x - max))), and a reported logprob is (x[i] - max) - log_sum (log_softmax's own formula)
for the few ids reported. On CUDA that reduction is a two-stage Triton kernel that spreads each row
over many programs (a single 152k-column row is otherwise one CTA's work).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the engine samples with torch ops where Triton is missing
    triton = None

LOG2E = 1.4426950408889634
_LOG2E = tl.constexpr(LOG2E) if triton is not None else LOG2E

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
    raw = row_stats(logits)
    src, stats = logits, raw
    if sb.all_greedy:
        tokens = raw.argmax
    else:
        logits32 = logits.float()
        processed = process_logits(logits32, sb)
        sampled = _exponential_race(processed, sb, generator)
        tokens = torch.where(sb.temperatures == 0.0, raw.argmax, sampled)
        if sb.any_processed:
            rows = sb.processed_logprobs
            src = torch.where(rows[:, None], processed, logits32)
            stats = raw.where(rows, row_stats(processed))
    token_logprobs = stats.logprobs(src.gather(-1, tokens[:, None])).squeeze(-1)
    top_ids = top_lp = None
    if sb.num_top_logprobs > 0:
        top_x, top_ids = src.topk(sb.num_top_logprobs, dim=-1)
        top_lp = stats.logprobs(top_x)
    return SamplerOutput(tokens, token_logprobs, top_ids, top_lp)


def greedy_rows(logits: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The all-greedy case of `sample` without top logprobs, written into out [B, 2] float64 as
    (token id, its raw logprob) per row (float64 holds every token id exactly): the same math as
    `sample`, in a form a CUDA graph can capture and the host reads with one transfer."""
    stats = row_stats(logits)
    token_logprobs = stats.logprobs(logits.gather(-1, stats.argmax[:, None])).squeeze(-1)
    out[:, 0].copy_(stats.argmax)
    out[:, 1].copy_(token_logprobs)
    return out


def sample_reference(logits: torch.Tensor, sb: SamplingBatch,
                     generator: torch.Generator | None = None) -> SamplerOutput:
    """The definition `sample` keeps (and the sampler it replaced): full fp32 log_softmax of the raw and
    the processed logits, gathered. Tests and benchmarks compare against it."""
    logits = logits.float()
    raw_logprobs = torch.log_softmax(logits, dim=-1)
    if sb.all_greedy:
        tokens = logits.argmax(dim=-1)
        dist = raw_logprobs
    else:
        dist_processed = torch.log_softmax(process_logits(logits, sb), dim=-1)
        sampled = _exponential_race(dist_processed, sb, generator)
        tokens = torch.where(sb.temperatures == 0.0, logits.argmax(dim=-1), sampled)
        dist = (torch.where(sb.processed_logprobs[:, None], dist_processed, raw_logprobs)
                if sb.any_processed else raw_logprobs)
    top_lp = top_ids = None
    if sb.num_top_logprobs > 0:
        top_lp, top_ids = dist.topk(sb.num_top_logprobs, dim=-1)
    return SamplerOutput(tokens, dist.gather(-1, tokens[:, None]).squeeze(-1), top_ids, top_lp)


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
    """argmax(x - log E), E ~ Exp(1): an exact draw from softmax(x) without a host sync (x: logits or
    logprobs; a per-row shift does not move the argmax)."""
    noise = torch.empty_like(logprobs).exponential_(generator=generator)
    for row, seed in enumerate(sb.row_seeds):
        if seed is not None:
            g = torch.Generator(device=logprobs.device)
            g.manual_seed(seed)
            noise[row].exponential_(generator=g)
    return (logprobs - noise.log()).argmax(dim=-1)


# ---- per-row statistics -----------------------------------------------------------------------------
@dataclass
class RowStats:
    """Per row of x [B, V], in fp32: max, the first index holding it, and log(sum(exp(x - max)))."""

    max: torch.Tensor  # [B] float32
    argmax: torch.Tensor  # [B] int64
    log_sum: torch.Tensor  # [B] float32

    def logprobs(self, x: torch.Tensor) -> torch.Tensor:
        """log_softmax at the given entries x [B, K] of each row, computed as log_softmax computes it."""
        return (x.float() - self.max[:, None]) - self.log_sum[:, None]

    def where(self, rows: torch.Tensor, other: RowStats) -> RowStats:
        """`other`'s statistics on the rows marked in `rows` [B] bool, these elsewhere."""
        return RowStats(torch.where(rows, other.max, self.max), torch.where(rows, other.argmax, self.argmax),
                        torch.where(rows, other.log_sum, self.log_sum))


def row_stats(x: torch.Tensor) -> RowStats:
    """Max, first argmax and log-sum-exp offset per row; the Triton kernels on CUDA, torch elsewhere."""
    if triton is not None and x.is_cuda:
        return row_stats_triton(x)
    return row_stats_torch(x)


def row_stats_torch(x: torch.Tensor) -> RowStats:
    x = x.float()
    m = x.amax(dim=-1)
    m_safe = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    return RowStats(m, x.argmax(dim=-1), (x - m_safe[:, None]).exp().sum(dim=-1).log())


_ROW_BLOCK = 2048


@lru_cache(maxsize=8)
def _target_programs(device: torch.device) -> int:
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 16


def row_chunks(rows: int, cols: int, target: int, block: int = _ROW_BLOCK) -> tuple[int, int]:
    """(chunks per row, columns per chunk, a multiple of block): about `target` programs in all."""
    want = max(1, min(triton.cdiv(cols, block), triton.cdiv(target, max(rows, 1))))
    span = triton.cdiv(triton.cdiv(cols, want), block) * block
    return triton.cdiv(cols, span), span


def row_stats_triton(x: torch.Tensor) -> RowStats:
    """Stage 1: each (row, chunk) program reduces its columns to (max, first argmax, sum exp(x - max));
    stage 2: one program per row merges its chunks. Reads x in its own dtype, once."""
    assert x.dim() == 2, x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    rows, cols = x.shape
    chunks, span = row_chunks(rows, cols, _target_programs(x.device))
    # one float32 allocation for both partial sums and one for max and log_sum: each launch of this
    # function sits on the decode step's host path, where every allocation costs microseconds
    part_m, part_s = torch.empty((2, rows, chunks), dtype=torch.float32, device=x.device)
    part_i = torch.empty((rows, chunks), dtype=torch.int32, device=x.device)
    out_max, out_log_sum = torch.empty((2, rows), dtype=torch.float32, device=x.device)
    out = RowStats(out_max, torch.empty(rows, dtype=torch.int64, device=x.device), out_log_sum)
    if rows == 0:
        return out
    _row_chunk_kernel[(rows, chunks)](x, part_m, part_s, part_i, cols, x.stride(0), span, BLOCK=_ROW_BLOCK,
                                      num_warps=4)
    _row_merge_kernel[(rows,)](part_m, part_s, part_i, out.max, out.argmax, out.log_sum, chunks,
                               CHUNKS_PAD=triton.next_power_of_2(chunks), num_warps=1)
    return out


if triton is not None:

    @triton.jit
    def _row_chunk_kernel(x_ptr, part_m_ptr, part_s_ptr, part_i_ptr, n_cols, stride_row, span,
                          BLOCK: tl.constexpr):
        # Lane j keeps the max of its columns, the first column holding it and the sum of exp(x - max)
        # (rescaled online), so the loop has no cross-lane reduction; lanes merge once at the end.
        row = tl.program_id(0).to(tl.int64)
        chunk = tl.program_id(1)
        begin = chunk * span
        end = tl.minimum(begin + span, n_cols)
        lanes = tl.arange(0, BLOCK)
        m_vec = tl.full([BLOCK], float("-inf"), tl.float32)
        s_vec = tl.zeros([BLOCK], tl.float32)
        i_vec = tl.zeros([BLOCK], tl.int32)
        for off in range(begin, end, BLOCK):
            cols = off + lanes
            x = tl.load(x_ptr + row * stride_row + cols, mask=cols < end, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m_vec, x)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            s_vec = s_vec * tl.exp2((m_vec - m_safe) * _LOG2E) + tl.exp2((x - m_safe) * _LOG2E)
            i_vec = tl.where(x > m_vec, cols, i_vec)
            m_vec = m_new
        m = tl.max(m_vec, axis=0)
        first = tl.min(tl.where(m_vec == m, i_vec, n_cols), axis=0)
        m_ref = tl.where(m == float("-inf"), 0.0, m)
        s = tl.sum(s_vec * tl.exp2((m_vec - m_ref) * _LOG2E), axis=0)
        slot = row * tl.num_programs(1) + chunk
        tl.store(part_m_ptr + slot, m)
        tl.store(part_s_ptr + slot, s)
        tl.store(part_i_ptr + slot, tl.where(m == float("-inf"), begin, first))

    @triton.jit
    def _row_merge_kernel(part_m_ptr, part_s_ptr, part_i_ptr, max_ptr, arg_ptr, log_sum_ptr, n_chunks,
                          CHUNKS_PAD: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, CHUNKS_PAD)
        valid = c < n_chunks
        m_c = tl.load(part_m_ptr + row * n_chunks + c, mask=valid, other=float("-inf"))
        s_c = tl.load(part_s_ptr + row * n_chunks + c, mask=valid, other=0.0)
        i_c = tl.load(part_i_ptr + row * n_chunks + c, mask=valid, other=0)
        m = tl.max(m_c, axis=0)
        m_ref = tl.where(m == float("-inf"), 0.0, m)
        # chunks are in column order, so the first chunk holding the max holds the first argmax
        first_chunk = tl.min(tl.where((m_c == m) & valid, c, CHUNKS_PAD), axis=0)
        arg = tl.sum(tl.where(c == first_chunk, i_c, 0), axis=0)
        total = tl.sum(s_c * tl.exp2((m_c - m_ref) * _LOG2E), axis=0)
        tl.store(max_ptr + row, m)
        tl.store(arg_ptr + row, arg.to(tl.int64))
        tl.store(log_sum_ptr + row, tl.log(total))
