"""The linear layers' product in the batch-invariant mode (EngineConfig.batch_invariant; docs/invariance.md).

`invariant_linear(x, weight, bias)` computes every row of x @ weight^T (+ bias) in an order that depends
on the weight's shape only, never on the number of rows, so a token's projections have the same bits in
a prefill of 8192 tokens, a decode batch of 128, a batch of 1 and a spec-decode verify:

- Triton (CUDA bf16/fp16, or CPU tensors as kernel_device.use_triton allows): the GEMM of
  gemm_invariant_kernels.py. Its tiles (`InvariantTiles`: BLOCK_M x BLOCK_N x BLOCK_K, split-K) are a
  function of the weight shape and the device's SM count only (`pick_tiles`), so the tl.dot instruction
  shape, the K order (BLOCK_K steps in order, split-K partials merged in split order) and hence a row's
  bits are the same in any row block at any M; the kernel is not even specialized on M. BLOCK_M = 64
  (one Hopper warpgroup's wgmma): a decode batch of 1 pads 63 rows, which costs tensor-core work only
  (no bytes), and a batch of 128 is two row blocks. Programs are ordered so that the row blocks that
  read one weight tile run side by side (groups of 8 row blocks, row block fastest): the weight comes
  from HBM about once per step, not once per row block.
- Elsewhere (CPU, fp32 on CUDA, Triton missing): `invariant.tiled_linear`, products
  of a fixed number of rows per call (the facts it rests on: inference/layers/invariant.py).

Fused prologues, same tiles: `invariant_norm_gemm` forms add_rms_norm's output in registers (the
residual add and the products round as add_rms_norm rounds; the variance is summed in BLOCK_K chunks
per row, so its bits differ from add_rms_norm's but not between row counts), `invariant_silu_mul_gemm`
forms silu(gate) * up (elementwise: the same bits as silu_and_mul). Whether a layer fuses depends on
dtypes, devices and layouts, never on M, so prefill, decode and verify take the same path.

Launches per decoder layer in the mode, besides attention (rotary_qk + the attention kernel): 7
(add_rms_norm, qkv, o_proj, add_rms_norm, gate_up, silu_and_mul, down). With FUSE_PROLOGUES, 4 (norm+qkv,
o_proj, norm+gate_up, silu+down), as many as the default at batch 1, but slower on the H200 (see there).

Prologue latency (issue 23): the norm's variance pass (a loop of reductions over all of K before the main
loop, which Triton does not pipeline) read 64 rows at M = 1, and the prologues' main loop was suspected of
waiting on its loads every K step. Now the prologues double-buffer their loads in registers and load the
first weight tile before PDL's wait (InvariantTiles.prefetch, to be measured against False), and the
variance pass skips the 16-row sub-blocks past M, each summed on a fixed [16, BLOCK_K] tile (NORM_SUB_M): a
row's variance bits changed from the 64-row version but are the same at every M. FUSE_PROLOGUES stays off
until measured.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inference import envs
from inference.layers import gemv as gemv_mod
from inference.layers.invariant import tiled_linear
from inference.layers.kernel_device import num_sms, use_triton
from inference.layers.pdl import launch_kwargs

try:
    import triton

    from inference.layers.gemm_invariant_kernels import _invariant_gemm_kernel
except ImportError:  # the torch path serves without Triton
    triton = None

BLOCK_M = 64  # rows of x per program, for every M (see the module note)
NORM_SUB_M = 16  # rows per sub-block of the norm's variance pass (skipped past M; fixes a row's variance bits)
# Whether the mode routes the pre-norms and SiLU*up through the fused prologues. Off: measured on the H200
# (bench_gemv --invariant, 0.5B, us at 1 / 128 rows) the prologues cost more than the launches they save:
# qkv+norm 13.3 / 16.7 against 5.4 / 6.6 plain, gate_up+norm 19.8 / 38.8 against 8.7 / 9.0, down+silu
# 46.0 / 47.2 against 11.6 / 12.4 (every program re-forms its rows over all of K, 64 rows wide).
# The prologues now double-buffer their loads (PREFETCH), unmeasured on the device: SIDECAR_INVARIANT_FUSE_PROLOGUES=1
# turns them on for an A/B.
FUSE_PROLOGUES = envs.INVARIANT_FUSE_PROLOGUES.get()
_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class InvariantTiles:
    """Launch shape of one weight: grid (row blocks x column blocks, split_k). Everything here fixes a
    row's bits except num_stages, group_m and prefetch (scheduling only); none of it may depend on M.
    prefetch: the fused prologues double-buffer their loads in registers instead of leaving them to Triton's
    pipeliner (cp.async through shared memory); the plain product always leaves them to the pipeliner."""

    block_n: int
    block_k: int
    split_k: int = 1
    block_m: int = BLOCK_M
    num_warps: int = 4
    num_stages: int = 4
    group_m: int = 8
    prefetch: bool = True


def pick_tiles(n: int, k: int, num_sms: int) -> InvariantTiles:
    """64-wide column blocks for wide outputs (gate_up, LM head, 7B projections), 32 below 4096 outputs
    so that decode has more programs; K split (into at most 4, each split at least two BLOCK_K steps)
    while the column blocks of one row block leave SMs idle: decode streams each weight once, spread over
    the SMs. The split is paid at prefill too (fp32 partials), only on the narrow projections."""
    block_n = 64 if n >= 4096 else 32
    block_k = 64
    return InvariantTiles(block_n, block_k, split_for(n, k, block_n, block_k, num_sms))


def split_for(n: int, k: int, block_n: int, block_k: int, num_sms: int) -> int:
    """pick_tiles' K split for these blocks (also what scripts/bench_gemv.py --inv-tiles gives a tile)."""
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


def use_invariant_norm_gemm(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor,
                            residual: torch.Tensor | None) -> bool:
    """Whether invariant_norm_gemm takes (x [+ residual]) -> RMSNorm -> x W^T; nothing here reads M."""
    return (FUSE_PROLOGUES and use_invariant_gemm(x, weight) and weight.shape[1] == x.shape[1]
            and norm_weight.shape == (x.shape[1],) and norm_weight.dtype == x.dtype
            and norm_weight.is_contiguous() and norm_weight.device == x.device
            and (residual is None or (residual.shape == x.shape and residual.dtype == x.dtype
                                      and residual.stride(-1) == 1 and residual.device == x.device)))


def use_invariant_silu_mul_gemm(gate_up: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether invariant_silu_mul_gemm takes gate_up [M, 2I] = [gate; up] and weight [N, I]."""
    return (FUSE_PROLOGUES and use_invariant_gemm(gate_up, weight) and weight.dim() == 2
            and gate_up.shape[1] == 2 * weight.shape[1])


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) with each row's bits independent of the other rows (see the module note)."""
    if use_invariant_gemm(x, weight):
        return invariant_gemm(x, weight, bias)
    return tiled_linear(x, weight, bias)


def invariant_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   tiles: InvariantTiles | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias) in one launch,
    fp32 accumulation; `tiles` (tests, benchmarks) overrides invariant_tiles."""
    return _launch(x, weight, bias, x.shape[1], tiles)


def invariant_silu_mul_gemm(gate_up: torch.Tensor, weight: torch.Tensor,
                            tiles: InvariantTiles | None = None) -> torch.Tensor:
    """F.linear(silu_and_mul(gate_up), weight) for gate_up [M, 2I], weight [N, I]; the activation is formed
    per x tile (recomputed by every column block) and never written out."""
    assert gate_up.shape[1] == 2 * weight.shape[1], (gate_up.shape, weight.shape)
    return _launch(gate_up, weight, None, weight.shape[1], tiles, silu_mul=True)


def invariant_norm_gemm(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                        weight: torch.Tensor, bias: torch.Tensor | None = None,
                        tiles: InvariantTiles | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(F.linear(h, weight, bias), s) for (h, s) = add_rms_norm(x, residual, norm_weight, eps) in one launch;
    s has add_rms_norm's bits, h differs from it only through the variance's summation order (module note).

    s is a fresh [M, K] tensor (x itself when residual is None): the inputs are never written.
    """
    m, k = x.shape
    assert norm_weight.shape == (k,) and norm_weight.is_contiguous() and norm_weight.dtype == x.dtype
    if residual is None:
        res_out = x
    else:
        assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(-1) == 1
        res_out = torch.empty(m, k, dtype=x.dtype, device=x.device)
    y = _launch(x, weight, bias, k, tiles, norm=(residual, norm_weight, eps, res_out))
    return y, res_out


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, k: int, tiles: InvariantTiles | None,
            silu_mul: bool = False,
            norm: tuple[torch.Tensor | None, torch.Tensor, float, torch.Tensor] | None = None) -> torch.Tensor:
    """One launch of _invariant_gemm_kernel over row blocks x column blocks (x split-K); `norm` is
    (residual or None, RMSNorm weight, eps, res_out)."""
    m, n = x.shape[0], weight.shape[0]
    assert weight.shape[1] == k and x.stride(-1) == 1 and weight.is_contiguous(), (x.shape, weight.shape)
    assert bias is None or (bias.shape == (n,) and bias.is_contiguous()), None if bias is None else bias.shape
    t = tiles or invariant_tiles(n, k, x.device)
    assert t.block_m % NORM_SUB_M == 0, t
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    k_per_split, split = gemv_mod.split_k_plan(k, t.split_k, t.block_k)
    partial = split > 1
    dest = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if partial else out
    b = bias if bias is not None else out
    tiles_mn = triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n)
    counters = gemv_mod.merge_counters(x.device, tiles_mn) if partial else out
    residual, norm_weight, eps, res_out = norm if norm is not None else (None, x, 0.0, x)
    res = residual if residual is not None else x
    pdl = launch_kwargs(x)
    _invariant_gemm_kernel[(tiles_mn, split)](
        x, weight, b, out, dest, counters, res, norm_weight, res_out, m, n, k, x.stride(0), res.stride(0),
        k_per_split, eps, HAS_BIAS=bias is not None, SILU_MUL=silu_mul, NORM=norm is not None,
        HAS_RES=residual is not None, PARTIAL=partial, SPLIT=split,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, SUB_M=NORM_SUB_M, GROUP_M=t.group_m,
        PREFETCH=t.prefetch and (silu_mul or norm is not None),
        num_warps=t.num_warps, num_stages=t.num_stages, **pdl)
    return out
