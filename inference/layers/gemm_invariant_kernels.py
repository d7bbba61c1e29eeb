"""Triton kernel of the batch-invariant GEMM; inference/layers/gemm_invariant.py explains it and launches it.

One program computes a [BLOCK_M, BLOCK_N] output tile over its K range (all of K, or one split of it) with
tl.dot on one fixed tile shape; what a row's bits depend on: the tile shape, the K order and the weight,
never M (the kernel is not specialized on M either: one binary serves every row count). Triton's pipeliner
stages the loads through shared memory (num_stages).
"""

from __future__ import annotations

import triton
import triton.language as tl

from inference.layers.pdl import launch_dependents, wait


@triton.jit
def _tile_of_program(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row block, column block) of program_id(0). Groups of GROUP_M row blocks walk the
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
    return pid_m, pid_n


@triton.jit(do_not_specialize=["M"])
def _invariant_gemm_kernel(x_ptr, w_ptr, b_ptr, out_ptr, part_ptr, M, N, K, stride_xm, k_per_split,
                           HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           GROUP_M: tl.constexpr, PDL: tl.constexpr):
    pid_m, pid_n = _tile_of_program(M, N, BLOCK_M, BLOCK_N, GROUP_M)
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
    wait(PDL)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + ks
        k_mask = k < k_end
        w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        xk = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(xk, tl.trans(w), acc)
    # Dependents are scheduled only once every program is past its main loop: scheduled at its start, they
    # wait holding SMs that its later programs need (a split-K launch has more programs than SMs).
    launch_dependents(PDL)
    offs = ms[:, None] * N + cols[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    if PARTIAL:  # gemv's _split_sum_kernel sums the splits in split order
        tl.store(part_ptr + pid_k * M.to(tl.int64) * N + offs, acc, mask=out_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
