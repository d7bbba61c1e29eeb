"""The sampler: logits of the sampling rows in, next tokens and their logprobs out.

Stateless and small. Greedy rows (temperature 0) take the first argmax of the raw logits. Other rows
scale by their temperature, keep what passes top-k, top-p and min-p, and draw with the exponential
race (argmax of x - log E, E ~ Exp(1)): no host sync, no torch.multinomial. A row's noise is keyed by
(row seed, output position, vocabulary index) (inference/sample/kernels.py), so its token depends only
on its seed, its position and its logits: never on the batch, the order of its rows or preemption.
A seeded sequence's row seed is its own; the runner gives an unseeded row `unseeded_seed(runner seed,
list-of-rows count, row)`, equal on every TP rank; rows built with no seed at all (tests, spec
decoding's batches) draw one per call from the generator given to `sample`. Reported logprobs come
from the raw logits or the processed distribution, per row, for the few ids reported (no [B, V]
log_softmax). On CUDA a step is a few Triton launches over all rows (row statistics, thresholds when a
row has top-k or top-p, the race); elsewhere the torch twins run. In the batch-invariant mode
(SamplingBatch.invariant) every row's statistics are chunked as a lone row's (`row_stats_triton`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from inference.layers.invariant import row_sum
from inference.sample.batch import SamplingBatch
from inference.sample.kernels import (
    RaceRows,
    log_exponential_torch,
    race_torch,
    race_triton,
    scaled_logits,
    thresholds_torch,
    thresholds_triton,
    uniforms_torch,
)

try:
    import triton
    import triton.language as tl
except ImportError:  # the engine samples with torch ops where Triton is missing
    triton = None

LOG2E = 1.4426950408889634
_LOG2E = tl.constexpr(LOG2E) if triton is not None else LOG2E


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor  # [B] float32, of the sampled tokens
    top_ids: torch.Tensor | None  # [B, K] int64
    top_logprobs: torch.Tensor | None  # [B, K] float32


def sample(logits: torch.Tensor, sb: SamplingBatch, generator: torch.Generator | None = None,
           use_triton: bool | None = None) -> SamplerOutput:
    """Sample one token per row of `logits` [B, V] (any float dtype; computed in fp32). use_triton: the
    kernels (also on CPU tensors under TRITON_INTERPRET=1) or the torch twins; None: Triton on CUDA."""
    use_triton = _triton_for(logits) if use_triton is None else use_triton
    raw = _row_stats(logits, use_triton, sb.invariant)
    thr = None
    if sb.all_greedy:
        tokens = raw.argmax
        logprobs = raw.logprobs(logits.gather(-1, tokens[:, None])).squeeze(-1)
    else:
        thr = _thresholds(logits, raw.max, sb, use_triton)
        tokens, logprobs = _draw(logits, raw, sb, thr, _noise_seeds(sb, generator), use_triton)
    top_ids = top_lp = None
    if sb.num_top_logprobs > 0:
        src, stats = logits, raw
        if sb.any_processed:
            assert sb.processed_logprobs is not None
            x = masked_logits(logits, raw.max, sb, thr)
            rows = sb.processed_logprobs
            src = torch.where(rows[:, None], x, logits.float())
            stats = raw.where(rows, _row_stats(x, use_triton, sb.invariant))
        top_x, top_ids = src.topk(sb.num_top_logprobs, dim=-1)
        top_lp = stats.logprobs(top_x)
    return SamplerOutput(tokens, logprobs, top_ids, top_lp)


def sample_pairs(logits: torch.Tensor, sb: SamplingBatch, out: torch.Tensor, generator: torch.Generator | None = None,
                 use_triton: bool | None = None) -> torch.Tensor:
    """`sample` without top logprobs, written into out [B, 2] float64 as (token id, logprob) per row
    (float64 holds every token id exactly): a form a CUDA graph can capture and the host reads with
    one transfer. A graph needs rows that all have seeds (`unseeded` draws from the generator)."""
    assert sb.num_top_logprobs == 0, "top logprobs go through sample"
    if sb.all_greedy:
        return greedy_rows(logits, out, sb.invariant)
    use_triton = _triton_for(logits) if use_triton is None else use_triton
    raw = _row_stats(logits, use_triton, sb.invariant)
    thr = _thresholds(logits, raw.max, sb, use_triton)
    _draw(logits, raw, sb, thr, _noise_seeds(sb, generator), use_triton, out)
    return out


def greedy_rows(logits: torch.Tensor, out: torch.Tensor, invariant: bool = False) -> torch.Tensor:
    """The all-greedy case of `sample` without top logprobs, written into out [B, 2] float64 as
    (token id, its raw logprob) per row: the same math as `sample`, in a form a CUDA graph can
    capture and the host reads with one transfer. invariant: see row_stats."""
    stats = row_stats(logits, invariant)
    token_logprobs = stats.logprobs(logits.gather(-1, stats.argmax[:, None])).squeeze(-1)
    out[:, 0].copy_(stats.argmax)
    out[:, 1].copy_(token_logprobs)
    return out


def sample_reference(logits: torch.Tensor, sb: SamplingBatch,
                     generator: torch.Generator | None = None) -> SamplerOutput:
    """The definition `sample` keeps, materialized: thresholds by a sort, the race over a full [B, V]
    noise tensor, full fp32 log_softmax of the raw and the processed logits, gathered. Tests and
    benchmarks compare against it."""
    lg = logits.float()
    raw_logprobs = torch.log_softmax(lg, dim=-1)
    dist = raw_logprobs
    if sb.all_greedy:
        tokens = lg.argmax(dim=-1)
    else:
        assert sb.greedy is not None and sb.processed_logprobs is not None
        row_max = lg.amax(dim=-1)
        thr = _thresholds(lg, row_max, sb, use_triton=False)
        x = masked_logits(lg, row_max, sb, thr)
        noise = log_exponential_torch(uniforms_torch(_noise_seeds(sb, generator), sb.positions, lg.shape[-1]))
        tokens = torch.where(sb.greedy, lg.argmax(dim=-1), (x - noise).argmax(dim=-1))
        if sb.any_processed:
            dist = torch.where(sb.processed_logprobs[:, None], torch.log_softmax(x, dim=-1), raw_logprobs)
    top_lp = top_ids = None
    if sb.num_top_logprobs > 0:
        top_lp, top_ids = dist.topk(sb.num_top_logprobs, dim=-1)
    return SamplerOutput(tokens, dist.gather(-1, tokens[:, None]).squeeze(-1), top_ids, top_lp)


def process_logits(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """The processed logits of a batch with sampled rows: x = (logit - row max) / T, -inf where top-k,
    top-p or min-p drop it; softmax(x) is the distribution the sampler draws from. Greedy rows pass
    through unscaled (their filters still apply)."""
    row_max = logits.float().amax(dim=-1)
    return masked_logits(logits, row_max, sb, _thresholds(logits, row_max, sb, _triton_for(logits)))


def masked_logits(logits: torch.Tensor, row_max: torch.Tensor, sb: SamplingBatch,
                  thr: torch.Tensor | None) -> torch.Tensor:
    assert sb.inv_temps is not None and sb.log_min_ps is not None
    x, keep = scaled_logits(logits, row_max, sb.inv_temps, thr, sb.log_min_ps)
    return x.masked_fill(~keep, float("-inf"))


def _triton_for(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda


def _row_stats(x: torch.Tensor, use_triton: bool, invariant: bool = False) -> RowStats:
    return row_stats_triton(x, invariant) if use_triton else row_stats_torch(x)


def _thresholds(logits: torch.Tensor, row_max: torch.Tensor, sb: SamplingBatch,
                use_triton: bool) -> torch.Tensor | None:
    """Per-row keep threshold on the raw logits (-inf: keep all), None when no row has top-k or top-p."""
    if not (sb.any_top_k or sb.any_top_p):
        return None
    assert sb.inv_temps is not None and sb.top_ks is not None and sb.top_ps is not None
    if use_triton:
        return thresholds_triton(_unit_stride(logits), row_max, sb.inv_temps, sb.top_ks, sb.top_ps)
    return thresholds_torch(logits, row_max, sb.inv_temps, sb.top_ks, sb.top_ps)


def _noise_seeds(sb: SamplingBatch, generator: torch.Generator | None) -> torch.Tensor:
    """The rows' noise seeds; unseeded rows get base + row for a base drawn on the device (no sync)."""
    assert sb.seeds is not None
    if not sb.any_unseeded:
        return sb.seeds
    assert sb.unseeded is not None
    base = torch.randint(0, 1 << 62, (1,), generator=generator, device=sb.seeds.device)
    return torch.where(sb.unseeded, base + torch.arange(sb.size, device=sb.seeds.device), sb.seeds)


def _draw(logits: torch.Tensor, raw: RowStats, sb: SamplingBatch, thr: torch.Tensor | None, seeds: torch.Tensor,
          use_triton: bool, pairs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and their logprobs of a batch with sampled rows (greedy rows take the raw argmax)."""
    assert sb.greedy is not None and sb.inv_temps is not None and sb.log_min_ps is not None
    assert sb.processed_logprobs is not None and sb.positions is not None
    if use_triton:
        rows = RaceRows(sb.inv_temps, sb.log_min_ps, seeds, sb.positions, sb.greedy, sb.processed_logprobs)
        return race_triton(_unit_stride(logits), (raw.max, raw.argmax, raw.log_sum), rows, thr, sb.any_processed,
                           pairs)
    x, keep = scaled_logits(logits, raw.max, sb.inv_temps, thr, sb.log_min_ps)
    raced, mass = race_torch(x, keep, seeds, sb.positions)
    tokens = torch.where(sb.greedy, raw.argmax, raced)
    logprobs = raw.logprobs(logits.gather(-1, tokens[:, None])).squeeze(-1)
    if sb.any_processed:
        processed = x.gather(-1, tokens[:, None]).squeeze(-1) - mass.log()
        logprobs = torch.where(sb.processed_logprobs, processed, logprobs)
    if pairs is not None:
        pairs[:, 0].copy_(tokens)
        pairs[:, 1].copy_(logprobs)
    return tokens, logprobs


def _unit_stride(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


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


def row_stats(x: torch.Tensor, invariant: bool = False) -> RowStats:
    """Max, first argmax and log-sum-exp offset per row; the Triton kernels on CUDA, torch elsewhere.
    invariant: each row's bits independent of the number of rows (the torch twin's always are)."""
    if triton is not None and x.is_cuda:
        return row_stats_triton(x, invariant)
    return row_stats_torch(x)


def row_stats_torch(x: torch.Tensor) -> RowStats:
    """Each row reduced alone (row_sum), whatever the number of rows."""
    x = x.float()
    m = x.amax(dim=-1)
    m_safe = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    return RowStats(m, x.argmax(dim=-1), row_sum((x - m_safe[:, None]).exp()).log())


_ROW_BLOCK = 2048


@lru_cache(maxsize=8)
def target_programs(device: torch.device) -> int:
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 16


def row_chunks(rows: int, cols: int, target: int, block: int = _ROW_BLOCK) -> tuple[int, int]:
    """(chunks per row, columns per chunk, a multiple of block): about `target` programs in all."""
    want = max(1, min(triton.cdiv(cols, block), triton.cdiv(target, max(rows, 1))))
    span = triton.cdiv(triton.cdiv(cols, want), block) * block
    return triton.cdiv(cols, span), span


def row_stats_triton(x: torch.Tensor, invariant: bool = False) -> RowStats:
    """Stage 1: each (row, chunk) program reduces its columns to (max, first argmax, sum exp(x - max));
    stage 2: one program per row merges its chunks (a single 152k-column row would otherwise be one
    CTA's work). Reads x in its own dtype, once. The chunking follows the batch size (fewer chunks per
    row when more rows fill the device); invariant: every row is chunked as a lone row is (the chunking
    depends on the vocabulary and the device only). The thresholds and the race chunk a row by the
    vocabulary alone already, and the torch twins reduce each row alone in every mode (row_sum)."""
    assert x.dim() == 2, x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    rows, cols = x.shape
    chunks, span = row_chunks(1 if invariant else rows, cols, target_programs(x.device))
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
