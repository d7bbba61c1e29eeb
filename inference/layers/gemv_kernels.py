"""Triton kernels of the small-M GEMV; inference/layers/gemv.py explains them and launches them.

W_SCALE: the weight is float8_e4m3fn (inference/quant/fp8.py), widened in registers, and each output row's
product is multiplied by its fp32 scale before the split partials, the bias and the rounding.

Every kernel takes the PDL constexpr of inference/layers/pdl.py: nothing reads x, the residual or the
partials, and nothing is written, before `wait` (weights may be read earlier: no kernel of a step writes them).
"""

from __future__ import annotations

import triton
import triton.language as tl

from inference.layers.pdl import launch_dependents, wait


@triton.jit
def _x_tile(x_rows, r_rows, nw_ptr, rstd, k, k_mask, x_mask, K, SILU_MUL: tl.constexpr,
            NORM: tl.constexpr, HAS_RES: tl.constexpr):
    """Rows of x at columns k in x's dtype; with SILU_MUL, silu(gate) * up rounded like eager torch;
    with NORM, nw * normed(x + r) rounded like add_rms_norm (rstd from _rows_rstd)."""
    if SILU_MUL:
        gate = tl.load(x_rows + k[None, :], mask=x_mask, other=0.0)
        up = tl.load(x_rows + K + k[None, :], mask=x_mask, other=0.0)
        g32 = gate.to(tl.float32)
        act = (g32 / (1.0 + tl.exp(-g32))).to(gate.dtype)
        return (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
    x = tl.load(x_rows + k[None, :], mask=x_mask, other=0.0)
    if NORM:
        if HAS_RES:
            r = tl.load(r_rows + k[None, :], mask=x_mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        normed = (x.to(tl.float32) * rstd[:, None]).to(x.dtype)
        nw = tl.load(nw_ptr + k, mask=k_mask, other=0.0)
        x = (nw.to(tl.float32)[None, :] * normed.to(tl.float32)).to(normed.dtype)
    return x


@triton.jit
def _rows_rstd(x_ptr, r_ptr, res_out_ptr, stride_xm, stride_rm, M, K, eps, write_res,
               HAS_RES: tl.constexpr, BLOCK_M: tl.constexpr, NORM_ROWS: tl.constexpr,
               NORM_BLOCK: tl.constexpr):
    """[BLOCK_M] fp32 rsqrt(mean((x + r)^2) + eps) per row, each row summed as one NORM_BLOCK-wide
    1-D block exactly as _add_rms_norm_kernel sums it (the same bits); with write_res, also stores
    x + r (rounded to the dtype) to res_out [M, K]. The NORM_ROWS >= M rows are unrolled so that
    their loads are all in flight at once."""
    ms = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, NORM_BLOCK)
    rstd = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for m in tl.static_range(NORM_ROWS):
        mask = (cols < K) & (m * K + cols < M * K)  # (m < M) as a tensor: rows past M load nothing
        x = tl.load(x_ptr + m * stride_xm + cols, mask=mask, other=0.0)
        if HAS_RES:
            r = tl.load(r_ptr + m * stride_rm + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
            if write_res:
                tl.store(res_out_ptr + m * K + cols, x, mask=mask)
        x32 = x.to(tl.float32)
        var = tl.sum(x32 * x32, axis=0) / K
        rstd = tl.where(ms == m, tl.math.rsqrt(var + eps), rstd)
    return rstd


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, part_ptr, r_ptr, nw_ptr, res_out_ptr, s_ptr, M, N, K,
                 stride_xm, stride_rm, k_per_split, eps, W_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
                 SILU_MUL: tl.constexpr,
                 NORM: tl.constexpr, HAS_RES: tl.constexpr, PARTIAL: tl.constexpr, KIND: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM_ROWS: tl.constexpr,
                 NORM_BLOCK: tl.constexpr, PDL: tl.constexpr):
    launch_dependents(PDL)
    pid_k = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rows < N
    ms = tl.arange(0, BLOCK_M)  # every row of x in one block (NORM's _rows_rstd reads rows from 0)
    ks = tl.arange(0, BLOCK_K)
    m_mask = ms < M
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * K
    x_rows = x_ptr + ms.to(tl.int64)[:, None] * stride_xm
    r_rows = r_ptr + ms.to(tl.int64)[:, None] * stride_rm
    # The first weight tile before wait: no kernel of a step writes weights, so under PDL its latency hides
    # behind the previous kernel's tail. Each K step then loads the next tile ahead.
    k = k_start + ks
    w_next = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & (k < k_end)[None, :], other=0.0)
    wait(PDL)
    if NORM:  # every program needs its rows' variance over all of K; program (0, 0) writes x + r
        first = (tl.program_id(0) == 0) & (pid_k == 0)
        rstd = _rows_rstd(x_ptr, r_ptr, res_out_ptr, stride_xm, stride_rm, M, K, eps, first,
                          HAS_RES, BLOCK_M, NORM_ROWS, NORM_BLOCK)
    else:
        rstd = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if KIND == 0:  # "lanes": fp32 products per lane, one reduction at the end
        acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + ks
        k_mask = k < k_end
        w = w_next
        w_next = tl.load(w_rows + (k + BLOCK_K)[None, :],
                         mask=n_mask[:, None] & (k + BLOCK_K < k_end)[None, :], other=0.0)
        xk = _x_tile(x_rows, r_rows, nw_ptr, rstd, k, k_mask, m_mask[:, None] & k_mask[None, :], K,
                     SILU_MUL, NORM, HAS_RES)
        if KIND == 0:
            acc += xk.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        elif KIND == 1:  # "reduce": a reduction per K step keeps the accumulator small
            acc += tl.sum(xk.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
        else:  # "dot": tensor cores on x padded to 16 rows
            acc = tl.dot(xk, tl.trans(w.to(xk.dtype)), acc)  # e4m3 -> bf16/fp16 is exact
    if KIND == 0:
        y = tl.sum(acc, axis=2)
    else:
        y = acc
    if W_SCALE:  # FP8 weights: each output row's fp32 scale, once, after its dot products
        y = y * tl.load(s_ptr + rows, mask=n_mask, other=0.0)[None, :]
    offs = ms[:, None] * N + rows[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    if PARTIAL:  # _split_sum_kernel sums the splits in split order
        tl.store(part_ptr + pid_k * M * N + offs, y, mask=out_mask)
    else:
        if HAS_BIAS:
            y += tl.load(b_ptr + rows, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _split_sum_kernel(p_ptr, b_ptr, out_ptr, MN, N, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                      BLOCK: tl.constexpr, PDL: tl.constexpr):
    launch_dependents(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    y = tl.zeros((BLOCK,), dtype=tl.float32)
    wait(PDL)
    for s in tl.static_range(SPLIT):
        y += tl.load(p_ptr + s * MN + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)
