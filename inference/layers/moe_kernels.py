"""Triton kernels of the fused MoE layer (inference/layers/moe.py): one grouped GEMM for gate/up with
SiLU*up in its epilogue, one for down with the routing weight in its epilogue.

Both take the (token, slot) pairs sorted by expert and padded per expert to BLOCK_M (`sorted_pairs`, the
pad value is the pair count), and `block_expert[b]`, the expert of row block b (-1: a padding block,
which returns before reading any weight, so a decode step reads only the chosen experts' weights).
A program computes BLOCK_M pairs x BLOCK_N output columns of one expert, walking K in BLOCK_K steps in
order with fp32 accumulation: a pair's bits depend on the tile sizes and the weights only, never on how
many pairs its expert got or which other pairs share its block (a row of a tl.dot depends on its own row
of the operand only). The pair count is not specialized on (one binary for every batch, as the invariant
GEMM is not specialized on M): it only masks loads of gathered rows, where a divisibility hint buys nothing.
PRECISION: "ieee" for fp32 inputs (no TF32, so an fp32 model computes what the torch loop does), None (the
default) for bf16/fp16.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_gate_up_kernel(x_ptr, w_ptr, out_ptr, pairs_ptr, block_expert_ptr, num_pairs, top_k, hidden, inter,
                        stride_xt, stride_we, stride_wn, stride_op,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        PRECISION: tl.constexpr) -> None:
    """out[pair, n] = silu(x[token] . w[e, n]) * (x[token] . w[e, inter + n]) for n in this block."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    pairs = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    tokens = tl.where(valid, pairs // top_k, 0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + offs_k
        a = tl.load(x_ptr + tokens[:, None].to(tl.int64) * stride_xt + k[None, :],
                    mask=valid[:, None] & (k[None, :] < hidden), other=0.0)
        w_mask = (k[:, None] < hidden) & (offs_n[None, :] < inter)
        wg = tl.load(w_base + offs_n[None, :] * stride_wn + k[:, None], mask=w_mask, other=0.0)
        wu = tl.load(w_base + (inter + offs_n[None, :]) * stride_wn + k[:, None], mask=w_mask, other=0.0)
        acc_gate = tl.dot(a, wg, acc_gate, input_precision=PRECISION)
        acc_up = tl.dot(a, wu, acc_up, input_precision=PRECISION)
    # As the dense path: the products are rounded to the model dtype before SiLU * up.
    gate = acc_gate.to(out_ptr.dtype.element_ty).to(tl.float32)
    up = acc_up.to(out_ptr.dtype.element_ty).to(tl.float32)
    act = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + pairs[:, None].to(tl.int64) * stride_op + offs_n[None, :],
             act.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < inter))


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_down_kernel(a_ptr, w_ptr, out_ptr, pairs_ptr, block_expert_ptr, weights_ptr, num_pairs, hidden, inter,
                     stride_ap, stride_we, stride_wn, stride_op,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     PRECISION: tl.constexpr) -> None:
    """out[pair, n] = weight[pair] * (a[pair] . w[e, n]) for n in this block."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    pairs = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    rows = tl.where(valid, pairs, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k = k0 + offs_k
        a = tl.load(a_ptr + rows[:, None] * stride_ap + k[None, :], mask=valid[:, None] & (k[None, :] < inter),
                    other=0.0)
        w = tl.load(w_base + offs_n[None, :] * stride_wn + k[:, None],
                    mask=(k[:, None] < inter) & (offs_n[None, :] < hidden), other=0.0)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    y = acc.to(out_ptr.dtype.element_ty).to(tl.float32)  # the product in the model dtype, as F.linear gives
    scale = tl.load(weights_ptr + rows, mask=valid, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * stride_op + offs_n[None, :], (y * scale[:, None]).to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & (offs_n[None, :] < hidden))
