"""Small-M matmul (GEMV) in Triton: y = x W^T (+ b) for x with at most MAX_M rows.

At decode batch sizes cuBLAS spends several microseconds per projection on weights that the H200
streams in one or two; this kernel streams each weight element exactly once. A program owns
BLOCK_N output rows, walks its K range in BLOCK_K chunks and multiplies each weight tile with all
(<= 8) rows of x, keeping fp32 products per lane and reducing once at the end. When the output has
too few row blocks to fill the SMs, K is split: every split writes fp32 partials and a second launch
sums them in a fixed order (deterministic, so a graph replay equals eager bit for bit), adds the bias
and rounds to the output dtype. Nothing reads the host, so every path can be captured in a CUDA graph.

`silu_mul_gemv` is the MLP down projection of a fused [gate; up] activation: silu(gate) * up is formed
tile by tile in registers (rounded where the eager silu_and_mul rounds) and never written out.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # the engine runs without Triton, on cuBLAS
    triton = None

MAX_M = 8
SILU_MUL_MAX_M = 1
SILU_MUL_MAX_WEIGHT = 1 << 23  # elements of the down projection (Qwen2-0.5B: 4.4M; 7B: 68M)
# SIDECAR_GEMV=0 keeps every linear on cuBLAS (benchmarks compare both paths).
ENABLED = os.environ.get("SIDECAR_GEMV", "1") != "0"
# Tests set this (with TRITON_INTERPRET=1 before Triton is imported) to run the kernels on CPU tensors.
FORCE_ON_CPU = False
_DTYPES = (torch.bfloat16, torch.float16)
_CPU_SMS = 8  # what the heuristic assumes in the interpreter (small, so tiny shapes take split-K)
_KINDS = {"lanes": 0, "reduce": 1, "dot": 2}


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
    """Whether gemv/silu_mul_gemv take x [M, K] @ weight [N, K]^T (else use F.linear)."""
    if triton is None or not ENABLED:
        return False
    if not (x.is_cuda or (FORCE_ON_CPU and os.environ.get("TRITON_INTERPRET") == "1")):
        return False
    return (x.dim() == 2 and weight.dim() == 2 and 0 < x.shape[0] <= MAX_M and x.dtype in _DTYPES
            and weight.dtype == x.dtype and weight.is_contiguous() and x.stride(-1) == 1
            and x.device == weight.device)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through gemv when use_gemv holds."""
    return gemv(x, weight, bias) if use_gemv(x, weight) else F.linear(x, weight, bias)


@functools.lru_cache(maxsize=16)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return _CPU_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def pick_config(m: int, n: int, k: int, num_sms: int) -> GemvConfig:
    """Block sizes for [m, k] x [n, k]^T, fitted to a sweep on the H200 (scripts/bench_gemv.py --sweep).

    One row of x: "lanes" with long K blocks and 2-4 output rows per program, except for wide outputs
    (gate_up, LM head), where tensor cores on a 32-row block read the weight faster. Several rows: "dot".
    Where the row blocks give too few programs ("idle"), K is split (into at most 4, each split keeping two
    K blocks) until they give twice that many.
    """
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


def use_silu_mul_gemv(gate_up: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the MLP should call silu_mul_gemv rather than silu_and_mul + gemv.

    Every program recomputes the activation of all rows over its K range, so the work grows with
    rows x weight size. On the H200 the saved launch wins at one row of Qwen2-0.5B (7.3 us against 9.2)
    and loses at one row of 7B (47 against 39) and at 2-8 rows of either.
    """
    return (gate_up.dim() == 2 and gate_up.shape[0] <= SILU_MUL_MAX_M
            and weight.numel() <= SILU_MUL_MAX_WEIGHT and use_gemv(gate_up, weight))


if triton is not None:

    @triton.jit
    def _x_tile(x_rows, k, x_mask, K, SILU_MUL: tl.constexpr):
        """Rows of x at columns k in x's dtype; with SILU_MUL, silu(gate) * up rounded like eager torch."""
        if SILU_MUL:
            gate = tl.load(x_rows + k[None, :], mask=x_mask, other=0.0)
            up = tl.load(x_rows + K + k[None, :], mask=x_mask, other=0.0)
            g32 = gate.to(tl.float32)
            act = (g32 / (1.0 + tl.exp(-g32))).to(gate.dtype)
            return (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
        return tl.load(x_rows + k[None, :], mask=x_mask, other=0.0)

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, k_per_split,
                     HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, PARTIAL: tl.constexpr, KIND: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_k = tl.program_id(1)
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        ms = tl.arange(0, BLOCK_M)
        ks = tl.arange(0, BLOCK_K)
        n_mask = rows < N
        m_mask = ms < M
        k_start = pid_k * k_per_split
        k_end = tl.minimum(k_start + k_per_split, K)
        w_rows = w_ptr + rows.to(tl.int64)[:, None] * K
        x_rows = x_ptr + ms.to(tl.int64)[:, None] * stride_xm
        if KIND == 0:  # "lanes": fp32 products per lane, one reduction at the end
            acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            k = k0 + ks
            k_mask = k < k_end
            w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            xk = _x_tile(x_rows, k, m_mask[:, None] & k_mask[None, :], K, SILU_MUL)
            if KIND == 0:
                acc += xk.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
            elif KIND == 1:  # "reduce": a reduction per K step keeps the accumulator small
                acc += tl.sum(xk.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
            else:  # "dot": tensor cores on x padded to 16 rows
                acc = tl.dot(xk, tl.trans(w), acc)
        if KIND == 0:
            y = tl.sum(acc, axis=2)
        else:
            y = acc
        offs = ms[:, None] * N + rows[None, :]
        out_mask = m_mask[:, None] & n_mask[None, :]
        if PARTIAL:
            tl.store(out_ptr + pid_k * M * N + offs, y, mask=out_mask)
        else:
            if HAS_BIAS:
                y += tl.load(b_ptr + rows, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=out_mask)

    @triton.jit
    def _split_sum_kernel(p_ptr, b_ptr, out_ptr, MN, N, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                          BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < MN
        y = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in tl.static_range(SPLIT):
            y += tl.load(p_ptr + s * MN + offs, mask=mask, other=0.0)
        if HAS_BIAS:
            y += tl.load(b_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, k: int, silu_mul: bool,
            config: GemvConfig | None) -> torch.Tensor:
    m, n = x.shape[0], weight.shape[0]
    assert weight.shape[1] == k and x.stride(-1) == 1 and weight.is_contiguous(), (x.shape, weight.shape)
    assert bias is None or (bias.shape == (n,) and bias.is_contiguous()), None if bias is None else bias.shape
    cfg = config or pick_config(m, n, k, _num_sms(x.device))
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_k = cfg.block_k
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), block_k) * block_k
    split = triton.cdiv(k, k_per_split)
    partial = split > 1
    dest = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if partial else out
    b = bias if bias is not None else out
    assert cfg.kind != "dot" or cfg.block_n >= 16, cfg
    _gemv_kernel[(triton.cdiv(n, cfg.block_n), split)](
        x, weight, b, dest, m, n, k, x.stride(0), k_per_split,
        HAS_BIAS=bias is not None, SILU_MUL=silu_mul, PARTIAL=partial, KIND=_KINDS[cfg.kind],
        BLOCK_M=cfg.block_m(m), BLOCK_N=cfg.block_n, BLOCK_K=block_k, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    if partial:
        mn = m * n
        _split_sum_kernel[(triton.cdiv(mn, 1024),)](dest, b, out, mn, n, SPLIT=split,
                                                   HAS_BIAS=bias is not None, BLOCK=1024)
    return out


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: GemvConfig | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [M <= 8, K], weight [N, K] contiguous, fp32 accumulation."""
    return _launch(x, weight, bias, x.shape[1], False, config)


def silu_mul_gemv(gate_up: torch.Tensor, weight: torch.Tensor, config: GemvConfig | None = None) -> torch.Tensor:
    """F.linear(silu_and_mul(gate_up), weight) for gate_up [M, 2I] = [gate; up], weight [N, I]."""
    assert gate_up.shape[1] == 2 * weight.shape[1], (gate_up.shape, weight.shape)
    return _launch(gate_up, weight, None, weight.shape[1], True, config)
