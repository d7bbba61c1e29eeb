"""Triton kernel of the batch-invariant GEMM; inference/layers/gemm_invariant.py explains it and launches it.

One program computes a [BLOCK_M, BLOCK_N] output tile over its K range (all of K, or one split of it) with
tl.dot on one fixed tile shape; what a row's bits depend on: the tile shape, the K order and the weight,
never M (the kernel is not specialized on M either: one binary serves every row count). The optional
prologues form x in registers exactly as the eager kernels round it (gemv_kernels._x_tile): SiLU * up, or
residual add + RMSNorm (the variance from _block_rstd).

With PREFETCH (the prologues; InvariantTiles.prefetch) registers double-buffer the main loop: the first
weight tile is loaded before `wait` (weights are never written by a step's kernels, pdl.py), and the loads
of K step i + 1 (x or gate/up, residual, norm weight, weight) are issued before step i's arithmetic
(_x_inputs / _x_form: _x_tile split in two, the same roundings, so the same bits as without it). The norm's
variance pass reads only the 16-row sub-blocks that hold rows < M, on a fixed [16, BLOCK_K] tile, its loads
double-buffered the same way (it is a chain of reductions Triton does not pipeline).
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
def _sub_block_squares(x_rows, r_rows, res_rows, m_mask, K, write_res, HAS_RES: tl.constexpr,
                       SUB_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """[SUB_M] fp32 sums of (x + r)^2 of these rows, over [SUB_M, BLOCK_K] chunks from column 0 in order, one
    tl.sum per chunk. The loads of chunk i + 1 are issued before chunk i is summed (registers double-buffer
    them: the chain is latency-bound, not bandwidth-bound). With write_res, also stores x + r."""
    ks = tl.arange(0, BLOCK_K)
    x_next = tl.load(x_rows + ks[None, :], mask=m_mask[:, None] & (ks < K)[None, :], other=0.0)
    r_next = x_next
    if HAS_RES:
        r_next = tl.load(r_rows + ks[None, :], mask=m_mask[:, None] & (ks < K)[None, :], other=0.0)
    squares = tl.zeros((SUB_M,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        x = x_next
        r = r_next
        ahead = m_mask[:, None] & (k + BLOCK_K < K)[None, :]
        x_next = tl.load(x_rows + (k + BLOCK_K)[None, :], mask=ahead, other=0.0)
        if HAS_RES:
            r_next = tl.load(r_rows + (k + BLOCK_K)[None, :], mask=ahead, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # the eager add rounds to the dtype
            if write_res:
                tl.store(res_rows + k[None, :], x, mask=m_mask[:, None] & (k < K)[None, :])
        x32 = x.to(tl.float32)
        squares += tl.sum(x32 * x32, axis=1)
    return squares


@triton.jit
def _block_rstd(x_ptr, r_ptr, res_ptr, row0, M, K, stride_xm, stride_rm, eps, write_res, HAS_RES: tl.constexpr,
                BLOCK_M: tl.constexpr, SUB_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_M] fp32 rsqrt(mean((x + r)^2) + eps) of rows row0 .. row0 + BLOCK_M, in sub-blocks of SUB_M
    rows: a sub-block whose first row is at or past M is skipped (a batch of 1 reads one sub-block, not
    BLOCK_M rows), and every row is summed on the same [SUB_M, BLOCK_K] tile (_sub_block_squares) wherever
    it sits, so its bits follow the tile shape only, never M (nor add_rms_norm's one-block sum)."""
    subs = tl.arange(0, BLOCK_M // SUB_M)
    squares = tl.zeros((BLOCK_M // SUB_M, SUB_M), dtype=tl.float32)
    for s in tl.static_range(BLOCK_M // SUB_M):
        first = row0 + s * SUB_M
        if first < M:
            ms = first + tl.arange(0, SUB_M)
            sub = _sub_block_squares(x_ptr + ms[:, None] * stride_xm, r_ptr + ms[:, None] * stride_rm,
                                     res_ptr + ms[:, None] * K, ms < M, K, write_res, HAS_RES, SUB_M, BLOCK_K)
            squares = tl.where(subs[:, None] == s, sub[None, :], squares)
    return tl.math.rsqrt(tl.reshape(squares, (BLOCK_M,)) / K + eps)  # row-major: sub-block s holds rows s * SUB_M..


@triton.jit
def _x_inputs(x_rows, r_rows, nw_ptr, k, k_end, m_mask, K, SILU_MUL: tl.constexpr, NORM: tl.constexpr,
              HAS_RES: tl.constexpr, BLOCK_K: tl.constexpr):
    """The loads of _x_tile at columns k (< k_end), without its arithmetic: (x or gate, up or r, norm weight);
    the slots a prologue does not use hold a stand-in of the right type."""
    k_mask = k < k_end
    x_mask = m_mask[:, None] & k_mask[None, :]
    a = tl.load(x_rows + k[None, :], mask=x_mask, other=0.0)
    b = a
    nw = tl.zeros((BLOCK_K,), dtype=a.dtype)
    if SILU_MUL:
        b = tl.load(x_rows + K + k[None, :], mask=x_mask, other=0.0)
    elif NORM:
        if HAS_RES:
            b = tl.load(r_rows + k[None, :], mask=x_mask, other=0.0)
        nw = tl.load(nw_ptr + k, mask=k_mask, other=0.0)
    return a, b, nw


@triton.jit
def _x_form(a, b, nw, rstd, SILU_MUL: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr):
    """_x_tile's arithmetic on the tiles _x_inputs loaded (the same roundings, so the same bits)."""
    if SILU_MUL:
        g32 = a.to(tl.float32)
        act = (g32 / (1.0 + tl.exp(-g32))).to(a.dtype)
        return (act.to(tl.float32) * b.to(tl.float32)).to(a.dtype)
    x = a
    if NORM:
        if HAS_RES:
            x = (x.to(tl.float32) + b.to(tl.float32)).to(x.dtype)
        normed = (x.to(tl.float32) * rstd[:, None]).to(x.dtype)
        x = (nw.to(tl.float32)[None, :] * normed.to(tl.float32)).to(normed.dtype)
    return x


@triton.jit(do_not_specialize=["M"])
def _invariant_gemm_kernel(x_ptr, w_ptr, b_ptr, out_ptr, part_ptr, counter_ptr, r_ptr, nw_ptr, res_out_ptr,
                           M, N, K, stride_xm, stride_rm, k_per_split, eps, HAS_BIAS: tl.constexpr,
                           SILU_MUL: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr,
                           PARTIAL: tl.constexpr, SPLIT: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           SUB_M: tl.constexpr, GROUP_M: tl.constexpr, PREFETCH: tl.constexpr,
                           PDL: tl.constexpr):
    launch_dependents(PDL)
    pid_m, pid_n, num_n = _tile_of_program(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    pid_k = tl.program_id(1)
    row0 = pid_m.to(tl.int64) * BLOCK_M
    ms = row0 + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    m_mask = ms < M
    n_mask = cols < N
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * K
    x_rows = x_ptr + ms[:, None] * stride_xm
    r_rows = r_ptr + ms[:, None] * stride_rm
    if PREFETCH:  # the first weight tile before wait: no kernel of a step writes weights (pdl.py)
        k = k_start + ks
        w_next = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & (k < k_end)[None, :], other=0.0)
    else:
        w_next = tl.zeros((BLOCK_N, BLOCK_K), dtype=w_ptr.dtype.element_ty)
    wait(PDL)
    if NORM:  # every program needs its rows' variance over all of K; split 0 of column block 0 writes x + r
        first = (pid_n == 0) & (pid_k == 0)
        rstd = _block_rstd(x_ptr, r_ptr, res_out_ptr, row0, M, K, stride_xm, stride_rm, eps, first, HAS_RES,
                           BLOCK_M, SUB_M, BLOCK_K)
    else:
        rstd = tl.zeros((BLOCK_M,), dtype=tl.float32)
    # PREFETCH: registers double-buffer the prologue's loads (step i + 1's are issued before step i's
    # arithmetic). Without it Triton's pipeliner stages them through shared memory (cp.async, num_stages).
    if PREFETCH:
        a_next, b_next, nw_next = _x_inputs(x_rows, r_rows, nw_ptr, k_start + ks, k_end, m_mask, K, SILU_MUL,
                                            NORM, HAS_RES, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + ks
        k_mask = k < k_end
        if PREFETCH:
            w, a, b, nw = w_next, a_next, b_next, nw_next
            w_next = tl.load(w_rows + (k + BLOCK_K)[None, :],
                             mask=n_mask[:, None] & (k + BLOCK_K < k_end)[None, :], other=0.0)
            a_next, b_next, nw_next = _x_inputs(x_rows, r_rows, nw_ptr, k + BLOCK_K, k_end, m_mask, K, SILU_MUL,
                                                NORM, HAS_RES, BLOCK_K)
            xk = _x_form(a, b, nw, rstd, SILU_MUL, NORM, HAS_RES)
        else:
            w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            xk = _x_tile(x_rows, r_rows, nw_ptr, rstd, k, k_mask, m_mask[:, None] & k_mask[None, :], K,
                         SILU_MUL, NORM, HAS_RES)
        acc = tl.dot(xk, tl.trans(w), acc)
    offs = ms[:, None] * N + cols[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    if PARTIAL:
        mn = M.to(tl.int64) * N
        tl.store(part_ptr + pid_k * mn + offs, acc, mask=out_mask)
        # The last split of this tile to finish sums all of them, in split order.
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
