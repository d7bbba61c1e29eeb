"""Batch-invariant building blocks of the torch path (EngineConfig.batch_invariant; docs/invariance.md).

In the mode, every value a row of the forward computes depends only on that row's own inputs, never on
how many rows share the call or where the row sits in it. Elementwise IEEE operations (+, -, *, /,
sqrt, casts) and max/argmax are exact and never break it; sums and matrix products do, through the
order their kernels choose. What torch does was found by probing rows alone against the same rows in
batches of 1 to 1024 (the facts: docs/invariance.md, "What torch does on this CPU"; the probes:
scripts/tools/probe_invariance.py). The answers, one a function:
- `tiled_linear`: products in calls of a FIXED row count (MKL's blocking follows the row count);
- `row_sum`: long rows in fixed chunks (torch splits a lone long row's sum across threads);
- `silu_and_mul_invariant`: SiLU as x / (1 + exp(-x)) (F.silu's SIMD and scalar paths round differently).
RMSNorm as add_rms_norm_torch computes it is invariant for rows under 32768 elements and stays as it is.
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
