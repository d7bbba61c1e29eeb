"""Batch-invariant building blocks of the torch path (EngineConfig.batch_invariant; docs/invariance.md).

In the mode, every value a row of the forward computes depends only on that row's own inputs, never on
how many rows share the call or where the row sits in it. Elementwise IEEE operations (+, -, *, /,
sqrt, casts) and max/argmax are exact and never break it; sums and matrix products do, through the
order their kernels choose. What torch 2.13 (CPU, MKL, AVX-512, 2 threads) was found to do, by
probing row results alone against the same rows inside batches of 1 to 1024 (scripts/probe_invariance.py
repeats the probes):

- F.linear / torch.mm, float32: a 1-row product takes MKL's GEMV, several rows a GEMM whose blocking
  follows the row count; a row's bits differ between every pair of batch sizes tried, at every shape.
  The same product computed in calls of a FIXED row count (zero-padded) gives every row the same bits
  whatever its tile position, neighbours or the memory alignment of the tile: `tiled_linear`.
  torch.bmm over stacked tiles does not (its threading follows the number of tiles). bfloat16 (oneDNN)
  keeps 1-row and many-row results equal but not every position in a large batch; in fixed tiles it
  held at every position tried.
- Row sums over the last dimension: one row's sum is split across threads when it alone is reduced
  and the row is at least torch's grain (32768 elements); several rows are reduced one per thread, in
  the serial order. Shorter rows are always reduced serially. `row_sum` cuts long rows into fixed
  chunks first, so its order never depends on the batch.
- Elementwise functions: a contiguous loop runs 32 elements at a time through the SIMD version of a
  function and the remainder through the scalar one; which elements fall in the remainder follows the
  tensor's size and where threads split it. exp, log, sqrt, rsqrt and division gave the same bits on
  both paths for 2^20 inputs; F.silu and sigmoid (and exp2) did not (6% of inputs), so a row of a
  SiLU could change with the batch (seen: the row where two threads split a [333, 100] gate).
  `silu_and_mul_invariant` writes SiLU as x / (1 + exp(-x)) in float32, the Triton kernel's formula.
- RMSNorm as add_rms_norm_torch computes it (mean of squares per row, rsqrt, products) is invariant
  for rows under 32768 elements, so the mode keeps it as it is.

These facts hold for one torch build, machine and thread count: a replay on another machine or with
another number of threads may differ (as TP 1 and TP 2 may), and the tests hold the engine to them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Rows per product call of `tiled_linear`: every call multiplies exactly this many rows. 16 keeps the
# padding of a one-row decode small and the number of calls of a long prefill moderate.
ROW_TILE = 16
# torch's reduction grain (at::internal::GRAIN_SIZE): rows shorter than it are summed serially.
_GRAIN = 32768
SUM_CHUNK = _GRAIN // 2


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [M, K], computed ROW_TILE rows per call (the last tile zero-padded)
    into one fresh buffer, so a row's bits depend on its own values only. The bias is added after the
    product (elementwise, exact), never inside the GEMM."""
    assert x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1], (x.shape, weight.shape)
    m, k = x.shape
    tiles = -(-m // ROW_TILE)
    # One fresh (aligned) buffer: every tile starts at a multiple of ROW_TILE * K elements of it.
    padded = x.new_zeros(tiles * ROW_TILE, k)
    padded[:m] = x
    out = x.new_empty(tiles * ROW_TILE, weight.shape[0])
    wt = weight.t()
    for i in range(0, tiles * ROW_TILE, ROW_TILE):
        torch.mm(padded[i:i + ROW_TILE], wt, out=out[i:i + ROW_TILE])
    y = out[:m]
    return y if bias is None else y + bias


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """x.sum(-1) in an order fixed by the row length: rows under torch's grain as torch sums them (the
    serial order, whatever the batch), longer ones in SUM_CHUNK-element chunks (zero-padded), then the
    chunk sums. Identical to x.sum(-1) for rows under the grain."""
    n = x.shape[-1]
    if n < _GRAIN:
        return x.sum(-1)
    chunks = -(-n // SUM_CHUNK)
    padded = F.pad(x, (0, chunks * SUM_CHUNK - n))
    return padded.view(*x.shape[:-1], chunks, SUM_CHUNK).sum(-1).sum(-1)


def silu_and_mul_invariant(x: torch.Tensor) -> torch.Tensor:
    """[..., 2I] as [gate; up] -> silu(gate) * up with SiLU as gate / (1 + exp(-gate)) in float32, rounded
    to the dtype (as the Triton kernel computes it): every element takes the same bits whatever the
    size of the call (F.silu's SIMD and scalar paths differ)."""
    gate, up = x.chunk(2, dim=-1)
    g32 = gate.float()
    act = (g32 / (1.0 + torch.exp(-g32))).to(x.dtype)
    return act * up
