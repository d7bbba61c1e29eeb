"""The linear layers' product in the batch-invariant mode (EngineConfig.batch_invariant; docs/invariance.md).

`invariant_linear(x, weight, bias)` computes every row of x @ weight^T (+ bias) in an order that depends
on the weight's shape only, never on the number of rows, so a token's projections have the same bits in
a prefill of 8192 tokens, a decode batch of 128, a batch of 1 and a spec-decode verify:

- Triton (CUDA bf16/fp16, or CPU tensors as kernel_device.use_triton allows): the GEMM of
  gemm_invariant_kernels.py. Its tiles (`InvariantTiles`: BLOCK_M x BLOCK_N x BLOCK_K, split-K) are a
  function of the weight shape and the device's SM count only (`pick_tiles`), so the tl.dot instruction
  shape, the K order (BLOCK_K steps in order, split-K partials summed in split order) and hence a row's
  bits are the same in any row block at any M; the kernel is not even specialized on M.
- Elsewhere (CPU, fp32 on CUDA, Triton missing): `invariant.tiled_linear`, a fixed row count per call.

The mode's norms and SiLU*up run in their own launches, never in this GEMM's prologue (measured slower:
docs/dev/benchmark-log.md, "Experiments decided").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inference.layers import gemv as gemv_mod
from inference.layers.invariant import tiled_linear
from inference.layers.kernel_device import num_sms, use_triton
from inference.layers.pdl import launch_kwargs

try:
    import triton

    from inference.layers.gemm_invariant_kernels import _invariant_gemm_kernel
except ImportError:  # the torch path serves without Triton
    triton = None

BLOCK_M = 64  # rows of x per program, for every M (see InvariantTiles)
_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class InvariantTiles:
    """Launch shape of one weight: grid (row blocks x column blocks, split_k). Everything here fixes a
    row's bits except num_stages and group_m (scheduling only); none of it may depend on M.
    block_m = 64 (one Hopper warpgroup's wgmma): a decode batch of 1 pads 63 rows, which costs
    tensor-core work only (no bytes), and a batch of 128 is two row blocks. Programs are ordered so
    that the group_m row blocks reading one weight tile run side by side (row block fastest): the
    weight comes from HBM about once per step, not once per row block."""

    block_n: int
    block_k: int
    split_k: int = 1
    block_m: int = BLOCK_M
    num_warps: int = 4
    num_stages: int = 4
    group_m: int = 8


def pick_tiles(n: int, k: int, num_sms: int) -> InvariantTiles:
    """64-wide column blocks for wide outputs (gate_up, LM head, 7B projections), 32 below 4096 outputs
    so that decode has more programs; K split (into at most 4, each split at least two BLOCK_K steps)
    while the column blocks of one row block leave SMs idle: decode streams each weight once, spread over
    the SMs. The split is paid at prefill too (fp32 partials), only on the narrow projections."""
    block_n = 64 if n >= 4096 else 32
    block_k = 64
    return InvariantTiles(block_n, block_k, split_for(n, k, block_n, block_k, num_sms))


def split_for(n: int, k: int, block_n: int, block_k: int, num_sms: int) -> int:
    """pick_tiles' K split for these blocks (also what scripts/bench/gemv.py --inv-tiles gives a tile)."""
    blocks = triton.cdiv(n, block_n)
    split = 1
    while split < 4 and blocks * split < num_sms and k >= 2 * (2 * split) * block_k:
        split *= 2
    return split


def invariant_tiles(n: int, k: int, device: torch.device) -> InvariantTiles:
    """The tiles of weight [n, k] on `device` (its SM count; kernel_device.INTERPRETER_SMS off CUDA)."""
    return pick_tiles(n, k, num_sms(device))


def use_invariant_gemm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether invariant_gemm takes x [M, K] @ weight [N, K]^T (the GEMV's conditions, any M > 0)."""
    if not use_triton(x):
        return False
    return (x.dim() == 2 and weight.dim() == 2 and x.shape[0] > 0 and x.dtype in _DTYPES
            and weight.dtype == x.dtype and weight.is_contiguous() and x.stride(-1) == 1
            and x.device == weight.device)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) with each row's bits independent of the other rows (see the module note)."""
    if use_invariant_gemm(x, weight):
        return invariant_gemm(x, weight, bias)
    return tiled_linear(x, weight, bias)


def invariant_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   tiles: InvariantTiles | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias) in one launch of _invariant_gemm_kernel (row blocks x column
    blocks x split-K; with split-K, a second launch sums the partials in split order), fp32 accumulation;
    `tiles` (tests, benchmarks) overrides invariant_tiles. The kernel lets PDL schedule the next kernel
    only after its main loop: dependents waiting earlier would hold SMs its later programs need."""
    (m, k), n = x.shape, weight.shape[0]
    assert weight.shape[1] == k and x.stride(-1) == 1 and weight.is_contiguous(), (x.shape, weight.shape)
    assert bias is None or (bias.shape == (n,) and bias.is_contiguous()), None if bias is None else bias.shape
    t = tiles or invariant_tiles(n, k, x.device)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    k_per_split, split = gemv_mod.split_k_plan(k, t.split_k, t.block_k)
    partial = split > 1
    dest = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if partial else out
    tiles_mn = triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n)
    pdl = launch_kwargs(x)
    _invariant_gemm_kernel[(tiles_mn, split)](
        x, weight, bias if bias is not None else out, out, dest, m, n, k, x.stride(0), k_per_split,
        HAS_BIAS=bias is not None, PARTIAL=partial, BLOCK_M=t.block_m, BLOCK_N=t.block_n,
        BLOCK_K=t.block_k, GROUP_M=t.group_m, num_warps=t.num_warps, num_stages=t.num_stages, **pdl)
    if partial:
        gemv_mod.sum_splits(dest, bias, out, pdl)
    return out
