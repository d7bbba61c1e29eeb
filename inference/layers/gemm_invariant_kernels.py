"""Triton kernel of the batch-invariant GEMM; inference/layers/gemm_invariant.py explains it and launches it.

One program computes a [BLOCK_M, BLOCK_N] output tile over its K range (all of K, or one split of it) with
tl.dot on one fixed tile shape; what a row's bits depend on: the tile shape, the K order and the weight,
never M (the kernel is not specialized on M either: one binary serves every row count). The optional
prologues form x in registers exactly as the eager kernels round it (gemv_kernels._x_tile): SiLU * up, or
residual add + RMSNorm (the variance from _block_rstd).
"""

from __future__ import annotations

import triton
import triton.language as tl

from inference.layers.gemv_kernels import _merge_splits, _x_tile
from inference.layers.pdl import launch_dependents, wait


@triton.jit
def _tile_of_program(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row block, column block, column blocks) of program_id(0). Groups of GROUP_M row blocks walk the
    column blocks with the row block varying fastest, so the programs that read one weight tile run side
    by side (the tile comes from HBM once, the others hit L2) and a group's rows stay in L2 meanwhile."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group
    pid_n = (pid % per_group) // group
    return pid_m, pid_n, num_n


@triton.jit
def _block_rstd(x_rows, r_rows, res_rows, m_mask, K, eps, write_res, HAS_RES: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_M] fp32 rsqrt(mean((x + r)^2) + eps) of this block's rows, each row's squares summed over
    [BLOCK_M, BLOCK_K] chunks from column 0 in order, one tl.sum per chunk: a row's bits follow the tile
    shape only (not add_rms_norm's one-block sum). With write_res, also stores x + r (rounded to the dtype)."""
    ks = tl.arange(0, BLOCK_K)
    squares = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        mask = m_mask[:, None] & (k < K)[None, :]
        x = tl.load(x_rows + k[None, :], mask=mask, other=0.0)
        if HAS_RES:
            r = tl.load(r_rows + k[None, :], mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # the eager add rounds to the dtype
            if write_res:
                tl.store(res_rows + k[None, :], x, mask=mask)
        x32 = x.to(tl.float32)
        squares += tl.sum(x32 * x32, axis=1)
    return tl.math.rsqrt(squares / K + eps)


@triton.jit(do_not_specialize=["M"])
def _invariant_gemm_kernel(x_ptr, w_ptr, b_ptr, out_ptr, part_ptr, counter_ptr, r_ptr, nw_ptr, res_out_ptr,
                           M, N, K, stride_xm, stride_rm, k_per_split, eps, HAS_BIAS: tl.constexpr,
                           SILU_MUL: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr,
                           PARTIAL: tl.constexpr, MERGE: tl.constexpr, SPLIT: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           GROUP_M: tl.constexpr, PDL: tl.constexpr):
    launch_dependents(PDL)
    pid_m, pid_n, num_n = _tile_of_program(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    pid_k = tl.program_id(1)
    ms = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    m_mask = ms < M
    n_mask = cols < N
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * K
    x_rows = x_ptr + ms[:, None] * stride_xm
    r_rows = r_ptr + ms[:, None] * stride_rm
    wait(PDL)
    if NORM:  # every program needs its rows' variance over all of K; split 0 of column block 0 writes x + r
        first = (pid_n == 0) & (pid_k == 0)
        rstd = _block_rstd(x_rows, r_rows, res_out_ptr + ms[:, None] * K, m_mask, K, eps, first, HAS_RES,
                           BLOCK_M, BLOCK_K)
    else:
        rstd = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + ks
        k_mask = k < k_end
        w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        xk = _x_tile(x_rows, r_rows, nw_ptr, rstd, k, k_mask, m_mask[:, None] & k_mask[None, :], K,
                     SILU_MUL, NORM, HAS_RES)
        acc = tl.dot(xk, tl.trans(w), acc)
    offs = ms[:, None] * N + cols[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    if PARTIAL:
        mn = M.to(tl.int64) * N
        tl.store(part_ptr + pid_k * mn + offs, acc, mask=out_mask)
        if MERGE:  # the last split of this tile to finish sums all of them, in split order
            tl.debug_barrier()  # every thread's partial is stored before the release
            count = counter_ptr + pid_m * num_n + pid_n
            ticket = tl.atomic_add(count, 1, sem="acq_rel", scope="gpu")
            if ticket == SPLIT - 1:
                _merge_splits(part_ptr, b_ptr, out_ptr, offs, cols, n_mask, out_mask, mn, SPLIT, HAS_BIAS,
                              BLOCK_M, BLOCK_N)
                tl.store(count, 0)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
