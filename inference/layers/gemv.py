"""Small-M matmul (GEMV) in Triton: y = x W^T (+ b) for x with at most MAX_M rows (kernels in gemv_kernels.py).

At decode batch sizes cuBLAS spends several microseconds per projection on weights that the GPU streams
in one or two; this kernel streams each weight element exactly once. A program owns BLOCK_N output
rows, walks its K range in BLOCK_K chunks (loading the next weight tile while it multiplies this one;
the first before PDL's wait) and multiplies each weight tile with all (<= 8) rows of x, keeping fp32
products per lane and reducing once at the end. When the output has too few row blocks to fill the
SMs, K is split: every split writes fp32 partials, and a second launch sums them in split order, adds
the bias and rounds (deterministic, so a graph replay equals eager bit for bit). Nothing reads the
host, so every path can be captured in a CUDA graph. Linears route only one row here (ROUTE_MAX_M).

`silu_mul_gemv` (the MLP down projection of a fused [gate; up]) and `norm_gemv` (a pre-norm projection:
qkv, gate_up) form their input tile by tile in registers, rounded where the eager silu_and_mul and
add_rms_norm round, and never write it out; norm_gemv's programs each compute their rows' variance first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from inference.layers.kernel_device import num_sms, use_triton
from inference.layers.pdl import launch_kwargs
from inference.quant.fp8 import FP8_DTYPE

try:
    import triton

    from inference.layers.gemv_kernels import _gemv_kernel, _split_sum_kernel
except ImportError:  # the engine runs without Triton, on cuBLAS
    triton = None

MAX_M = 8  # the kernel's most rows
# The most rows a linear routes to it: at 2-8 decode rows cuBLAS ran the decode step faster (the norm
# prologue and the "dot" tiles lose there; docs/dev/benchmark-log.md, "Experiments decided").
ROUTE_MAX_M = 1
SILU_MUL_MAX_M = 1
SILU_MUL_MAX_WEIGHT = 1 << 23  # elements of the down projection (Qwen2-0.5B: 4.4M; 7B: 68M)
_DTYPES = (torch.bfloat16, torch.float16)
_KINDS = {"lanes": 0, "reduce": 1, "dot": 2}
# norm_gemv loads a whole row in one block (as add_rms_norm does, for the same variance bits).
NORM_MAX_K = 8192
# norm_gemv's one-row shapes were swept at K = 896 (Qwen2-0.5B); wider rows (7B: 3584) keep the plain ones.
NORM_SWEPT_K = 2048


@dataclass(frozen=True)
class GemvConfig:
    """Launch shape: grid (cdiv(N, block_n), split_k); split_k > 1 adds the reduction launch."""

    block_n: int
    block_k: int
    num_warps: int = 4
    split_k: int = 1
    num_stages: int = 3
    kind: str = "lanes"  # "lanes", "reduce" or "dot" (block_n >= 16); see _gemv_kernel

    def block_m(self, m: int) -> int:
        return max(16, triton.next_power_of_2(m)) if self.kind == "dot" else triton.next_power_of_2(m)


def use_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether gemv/silu_mul_gemv/norm_gemv take x [M, K] @ weight [N, K]^T (else use F.linear); an FP8
    weight (with its scale passed) too."""
    if not use_triton(x):
        return False
    return (x.dim() == 2 and weight.dim() == 2 and 0 < x.shape[0] <= ROUTE_MAX_M and x.dtype in _DTYPES
            and weight.dtype in (x.dtype, FP8_DTYPE) and weight.is_contiguous() and x.stride(-1) == 1
            and x.device == weight.device)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through gemv when use_gemv holds (FP8 weights take fp8_linear.fp8_linear instead)."""
    assert weight.dtype != FP8_DTYPE, "an FP8 weight needs its scales: fp8_linear"
    return gemv(x, weight, bias) if use_gemv(x, weight) else F.linear(x, weight, bias)


def pick_config(m: int, n: int, k: int, num_sms: int, prologue: str = "") -> GemvConfig:
    """Block sizes for [m, k] x [n, k]^T, fitted to sweeps on the H200 (scripts/bench/gemv.py --sweep).

    One row of x: "lanes" with long K blocks and 2-4 output rows per program, except for wide outputs
    (gate_up, LM head), where tensor cores on a 32-row block read the weight faster. Several rows: "dot".
    Where the row blocks give too few programs ("idle"), K is split (into at most 4, each split keeping two
    K blocks) until they give twice that many.
    `prologue` is what forms x in the kernel: "norm" (norm_gemv) or "silu" (silu_mul_gemv); at one row
    they have their own shapes (_one_row_prologue_config), the norm's only up to the K it was swept at.
    """
    if m == 1 and prologue and (prologue == "silu" or k <= NORM_SWEPT_K):
        return _one_row_prologue_config(n, k, prologue)
    if m == 1 and n < 8192:
        block_k = min(512, max(16, triton.next_power_of_2(k)))
        cfg = GemvConfig(block_n=2 if n < 2048 else 4, block_k=block_k, num_warps=4)
        idle = 4 * num_sms
    else:
        small_n = m > 1 and n <= 2048
        block_k = 256 if k >= 4096 or small_n else 128
        cfg = GemvConfig(block_n=16 if small_n else 32, block_k=block_k, num_warps=4, kind="dot")
        idle = 2 * num_sms
    programs = triton.cdiv(n, cfg.block_n)
    split_k = 1
    if programs < idle:
        while split_k < 4 and programs * split_k < 2 * idle and k >= 2 * (2 * split_k) * cfg.block_k:
            split_k *= 2
    return GemvConfig(cfg.block_n, cfg.block_k, cfg.num_warps, split_k, kind=cfg.kind)


def _one_row_prologue_config(n: int, k: int, prologue: str) -> GemvConfig:
    """One row of x formed in the kernel. Every program redoes the prologue (the norm's variance over all
    of K; the activation of its K range), which favours more output rows per program and no tensor cores
    (the sweep that chose these shapes: docs/dev/benchmark-log.md)."""
    if prologue == "silu":
        block_k = min(1024, max(16, triton.next_power_of_2(k)))
        return GemvConfig(block_n=4, block_k=block_k, num_warps=4, split_k=min(4, -(-k // (2 * block_k))))
    assert prologue == "norm", prologue
    if n < 8192:
        return GemvConfig(block_n=8, block_k=min(512, max(16, triton.next_power_of_2(k))), num_warps=4)
    return GemvConfig(block_n=16, block_k=128, num_warps=8)


def use_silu_mul_gemv(gate_up: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the MLP should call silu_mul_gemv rather than silu_and_mul + gemv.

    Every program recomputes the activation of all rows over its K range, so the work grows with
    rows x weight size: the saved launch wins at one row of a small model and loses at one row of 7B and
    at 2-8 rows of either (docs/dev/benchmark-log.md), hence SILU_MUL_MAX_M and SILU_MUL_MAX_WEIGHT.
    """
    return (gate_up.dim() == 2 and gate_up.shape[0] <= SILU_MUL_MAX_M
            and weight.numel() <= SILU_MUL_MAX_WEIGHT and use_gemv(gate_up, weight))


def use_norm_gemv(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor,
                  residual: torch.Tensor | None = None) -> bool:
    """Whether norm_gemv takes (x [+ residual]) -> norm -> x W^T (else add_rms_norm, then the linear)."""
    return (use_gemv(x, weight) and x.shape[1] <= NORM_MAX_K
            and norm_weight.shape == (x.shape[1],) and norm_weight.dtype == x.dtype
            and norm_weight.is_contiguous() and norm_weight.device == x.device
            and (residual is None or (residual.shape == x.shape and residual.dtype == x.dtype
                                      and residual.stride(-1) == 1 and residual.device == x.device)))


@dataclass(frozen=True)
class _Norm:
    """norm_gemv's prologue operands: residual (or None), the RMSNorm weight and eps, and res_out."""

    residual: torch.Tensor | None
    weight: torch.Tensor
    eps: float
    res_out: torch.Tensor


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, k: int, silu_mul: bool,
            config: GemvConfig | None, norm: _Norm | None = None,
            scale: torch.Tensor | None = None) -> torch.Tensor:
    m, n = x.shape[0], weight.shape[0]
    prologue = "silu" if silu_mul else "norm" if norm is not None else ""
    assert weight.shape[1] == k and x.stride(-1) == 1 and weight.is_contiguous(), (x.shape, weight.shape)
    assert bias is None or (bias.shape == (n,) and bias.is_contiguous()), None if bias is None else bias.shape
    assert (scale is not None) == (weight.dtype == FP8_DTYPE), weight.dtype
    assert scale is None or (scale.shape == (n,) and scale.dtype == torch.float32 and scale.is_contiguous())
    cfg = config or pick_config(m, n, k, num_sms(x.device), prologue)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_k = cfg.block_k
    k_per_split, split = split_k_plan(k, cfg.split_k, block_k)
    partial = split > 1
    dest = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if partial else out
    b = bias if bias is not None else out
    assert cfg.kind != "dot" or cfg.block_n >= 16, cfg
    res = norm.residual if norm is not None and norm.residual is not None else x
    pdl = launch_kwargs(x)
    blocks = triton.cdiv(n, cfg.block_n)
    _gemv_kernel[(blocks, split)](
        x, weight, b, out, dest, res, x if norm is None else norm.weight, x if norm is None else norm.res_out,
        out if scale is None else scale,
        m, n, k, x.stride(0), res.stride(0), k_per_split, 0.0 if norm is None else norm.eps,
        W_SCALE=scale is not None, HAS_BIAS=bias is not None, SILU_MUL=silu_mul, NORM=norm is not None,
        HAS_RES=norm is not None and norm.residual is not None, PARTIAL=partial, KIND=_KINDS[cfg.kind],
        BLOCK_M=cfg.block_m(m), BLOCK_N=cfg.block_n, BLOCK_K=block_k,
        NORM_ROWS=triton.next_power_of_2(m) if norm is not None else 1,
        NORM_BLOCK=triton.next_power_of_2(k) if norm is not None else 1,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl)
    if partial:
        sum_splits(dest, bias, out, pdl)
    return out


def split_k_plan(k: int, split_k: int, block_k: int) -> tuple[int, int]:
    """(K per split, a whole number of block_k steps; the splits that makes) for up to split_k splits."""
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    return k_per_split, triton.cdiv(k, k_per_split)


def sum_splits(dest: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, pdl: dict) -> None:
    """out = the fp32 partials dest [split, M, N] summed in split order (+ bias), in a launch of their own."""
    mn, n = out.numel(), out.shape[1]
    _split_sum_kernel[(triton.cdiv(mn, 1024),)](dest, bias if bias is not None else out, out, mn, n,
                                               SPLIT=dest.shape[0], HAS_BIAS=bias is not None, BLOCK=1024, **pdl)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: GemvConfig | None = None, scale: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [M <= 8, K], weight [N, K] contiguous, fp32 accumulation.

    `scale` [N] fp32 with a float8_e4m3fn weight: F.linear(x, weight.float() * scale[:, None], bias),
    the scale applied to each row's fp32 sum (inference/layers/fp8_linear.py routes here)."""
    return _launch(x, weight, bias, x.shape[1], False, config, scale=scale)


def silu_mul_gemv(gate_up: torch.Tensor, weight: torch.Tensor, config: GemvConfig | None = None,
                  scale: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(silu_and_mul(gate_up), weight) for gate_up [M, 2I] = [gate; up], weight [N, I] (FP8 with
    `scale`, as gemv)."""
    assert gate_up.shape[1] == 2 * weight.shape[1], (gate_up.shape, weight.shape)
    return _launch(gate_up, weight, None, weight.shape[1], True, config, scale=scale)


def norm_gemv(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
              weight: torch.Tensor, bias: torch.Tensor | None = None,
              config: GemvConfig | None = None, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(F.linear(h, weight, bias), s) for (h, s) = add_rms_norm(x, residual, norm_weight, eps), in one launch
    (two with split-K), with the same bits as add_rms_norm followed by gemv
    with the same config.

    s is a fresh [M, K] tensor (x itself when residual is None): the inputs are never written. An FP8
    weight comes with its row `scale` (as gemv).
    """
    m, k = x.shape
    assert norm_weight.shape == (k,) and norm_weight.is_contiguous() and norm_weight.dtype == x.dtype
    assert k <= NORM_MAX_K, k
    if residual is None:
        res_out = x
    else:
        assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(-1) == 1
        res_out = torch.empty(m, k, dtype=x.dtype, device=x.device)
    y = _launch(x, weight, bias, k, False, config, _Norm(residual, norm_weight, eps, res_out), scale)
    return y, res_out
