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
`norm_gemv` is a pre-norm projection (qkv, gate_up): the residual add and RMSNorm of add_rms_norm are
formed the same way, each program first computing its rows' variance over the whole K.

Every launch passes the PDL constexpr of inference/layers/pdl.py: nothing reads x, the residual or
the partials, and nothing is written, before `wait`.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from inference.layers.pdl import launch_kwargs

try:
    import triton
    import triton.language as tl

    from inference.layers.pdl import launch_dependents, wait
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
# norm_gemv loads a whole row in one block (as add_rms_norm does, for the same variance bits).
NORM_MAX_K = 8192
# SIDECAR_NORM_GEMV=0 keeps the pre-norms in their own add_rms_norm launch.
NORM_ENABLED = os.environ.get("SIDECAR_NORM_GEMV", "1") != "0"
# SIDECAR_GEMV_PREFETCH=0: load each weight tile in its own K step, after PDL's wait (A/B benchmarks).
PREFETCH = os.environ.get("SIDECAR_GEMV_PREFETCH", "1") != "0"
# SIDECAR_GEMV_FUSED_SPLIT=0: split-K partials are summed by a second launch, not by the last split.
FUSED_SPLIT = os.environ.get("SIDECAR_GEMV_FUSED_SPLIT", "1") != "0"
# SIDECAR_ROPE_GEMV=0 keeps rotary in its own launch after the qkv projection.
ROPE_ENABLED = os.environ.get("SIDECAR_ROPE_GEMV", "1") != "0"


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


def use_norm_gemv(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor,
                  residual: torch.Tensor | None = None) -> bool:
    """Whether norm_gemv takes (x [+ residual]) -> norm -> x W^T (else add_rms_norm, then the linear)."""
    return (NORM_ENABLED and use_gemv(x, weight) and x.shape[1] <= NORM_MAX_K
            and norm_weight.shape == (x.shape[1],) and norm_weight.dtype == x.dtype
            and norm_weight.is_contiguous() and norm_weight.device == x.device
            and (residual is None or (residual.shape == x.shape and residual.dtype == x.dtype
                                      and residual.stride(-1) == 1 and residual.device == x.device)))


if triton is not None:

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
    def _gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, part_ptr, counter_ptr, r_ptr, nw_ptr, res_out_ptr, pos_ptr,
                     cs_ptr, M, N, K, stride_xm, stride_rm, k_per_split, eps, rot_rows, HAS_BIAS: tl.constexpr,
                     SILU_MUL: tl.constexpr,
                     NORM: tl.constexpr, HAS_RES: tl.constexpr, PARTIAL: tl.constexpr, MERGE: tl.constexpr,
                     SPLIT: tl.constexpr, KIND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, NORM_ROWS: tl.constexpr, NORM_BLOCK: tl.constexpr,
                     ROPE: tl.constexpr, HALF: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr):
        launch_dependents(PDL)
        pid_k = tl.program_id(1)
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = rows < N
        if ROPE:  # the block's rows are pairs (j, j + HALF) of a head, interleaved: a rotation's two inputs
            pair = rows // 2
            rows = (pair // HALF) * (2 * HALF) + (rows % 2) * HALF + pair % HALF
        ms = tl.arange(0, BLOCK_M)
        ks = tl.arange(0, BLOCK_K)
        m_mask = ms < M
        k_start = pid_k * k_per_split
        k_end = tl.minimum(k_start + k_per_split, K)
        w_rows = w_ptr + rows.to(tl.int64)[:, None] * K
        x_rows = x_ptr + ms.to(tl.int64)[:, None] * stride_xm
        r_rows = r_ptr + ms.to(tl.int64)[:, None] * stride_rm
        # The first weight tile is loaded before wait: no kernel of a step writes weights, so under PDL
        # its latency hides behind the previous kernel's tail. Each step then loads the next tile ahead.
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
            if PREFETCH:
                w_next = tl.load(w_rows + (k + BLOCK_K)[None, :],
                                 mask=n_mask[:, None] & (k + BLOCK_K < k_end)[None, :], other=0.0)
            else:
                w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            xk = _x_tile(x_rows, r_rows, nw_ptr, rstd, k, k_mask, m_mask[:, None] & k_mask[None, :], K,
                         SILU_MUL, NORM, HAS_RES)
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
            tl.store(part_ptr + pid_k * M * N + offs, y, mask=out_mask)
            if MERGE:  # the last split of this row block to finish sums all of them, in split order
                tl.debug_barrier()  # every thread's partial is stored before the release
                count = counter_ptr + tl.program_id(0)
                ticket = tl.atomic_add(count, 1, sem="acq_rel", scope="gpu")
                if ticket == SPLIT - 1:
                    _merge_splits(part_ptr, b_ptr, out_ptr, offs, rows, n_mask, out_mask, M * N,
                                  SPLIT, HAS_BIAS, BLOCK_M, BLOCK_N)
                    tl.store(count, 0)
        else:
            if HAS_BIAS:
                y += tl.load(b_ptr + rows, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            if ROPE:
                y = _rotate_pairs(y, rows, ms, m_mask, pos_ptr, cs_ptr, rot_rows, out_ptr.dtype.element_ty,
                                  HALF, BLOCK_M, BLOCK_N)
            tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=out_mask)

    @triton.jit
    def _rotate_pairs(y, rows, ms, m_mask, pos_ptr, cs_ptr, rot_rows, dt: tl.constexpr, HALF: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """Rotary (neox) on [BLOCK_M, BLOCK_N] fp32 outputs whose columns are interleaved pairs (j, j + HALF)
        of one head, rows below rot_rows only (q and k; v passes through), at positions pos[m]. Rounds
        exactly as the projection's output followed by _rotary_qk_kernel does."""
        a, b = tl.split(tl.reshape(y.to(dt).to(tl.float32), (BLOCK_M, BLOCK_N // 2, 2)))
        row_a, _ = tl.split(tl.reshape(rows, (BLOCK_N // 2, 2)))
        j = row_a % (2 * HALF)
        pos = tl.load(pos_ptr + ms, mask=m_mask, other=0).to(tl.int64)[:, None] * (2 * HALF)
        cos = tl.load(cs_ptr + pos + j[None, :]).to(dt).to(tl.float32)
        sin = tl.load(cs_ptr + pos + HALF + j[None, :]).to(dt).to(tl.float32)
        lo = (a * cos).to(dt).to(tl.float32) + (-b * sin).to(dt).to(tl.float32)
        hi = (b * cos).to(dt).to(tl.float32) + (a * sin).to(dt).to(tl.float32)
        rot = (row_a < rot_rows)[None, :]
        return tl.reshape(tl.join(tl.where(rot, lo, a), tl.where(rot, hi, b)), (BLOCK_M, BLOCK_N))

    @triton.jit
    def _merge_splits(part_ptr, b_ptr, out_ptr, offs, rows, n_mask, out_mask, MN, SPLIT: tl.constexpr,
                      HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """out = sum of the SPLIT fp32 partials (in split order, as _split_sum_kernel adds them) + bias."""
        y = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for s in tl.static_range(SPLIT):
            y += tl.load(part_ptr + s * MN + offs, mask=out_mask, other=0.0)
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


def merge_counters(device: torch.device, size: int) -> torch.Tensor:
    """An int32 buffer of at least `size` zeros shared by every split launch on `device` (the merging
    program of each row block resets its counter, so the buffer is all zeros between launches; launches
    on one device run on one stream at a time). Outgrown buffers stay alive: captured graphs hold them."""
    buffers = _COUNTERS.setdefault(device, [])
    if not buffers or buffers[-1].numel() < size:
        if device.type == "cuda":
            assert not torch.cuda.is_current_stream_capturing(), "run the projection once before capturing"
        buffers.append(torch.zeros(max(size, 4096, 2 * buffers[-1].numel() if buffers else 0),
                                   dtype=torch.int32, device=device))
    return buffers[-1]


_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}


@dataclass(frozen=True)
class _Norm:
    """norm_gemv's prologue operands: residual (or None), the RMSNorm weight and eps, and res_out."""

    residual: torch.Tensor | None
    weight: torch.Tensor
    eps: float
    res_out: torch.Tensor


@dataclass(frozen=True)
class RopeOperands:
    """A qkv projection's rotary (neox style), applied in its epilogue: positions [M], the fp32
    [max_positions, head_dim] cos|sin table, and how many leading output rows rotate (q and k heads)."""

    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    rotated_rows: int

    @property
    def head_dim(self) -> int:
        return self.cos_sin_cache.shape[1]


def use_rope_gemv(x: torch.Tensor, weight: torch.Tensor, rope: RopeOperands) -> bool:
    """Whether the projection x W^T can rotate its own output (no split-K: the rotation needs the sums)."""
    d, (m, n) = rope.head_dim, (x.shape[0], weight.shape[0])
    if not (ROPE_ENABLED and use_gemv(x, weight) and d >= 2 and d & (d - 1) == 0 and n % d == 0):
        return False
    cfg = pick_config(m, n, weight.shape[1], _num_sms(x.device))
    return (cfg.split_k == 1 and cfg.block_n % 2 == 0 and rope.positions.shape == (m,)
            and rope.cos_sin_cache.dtype == torch.float32 and rope.cos_sin_cache.is_contiguous()
            and rope.positions.device == x.device == rope.cos_sin_cache.device and rope.rotated_rows <= n)


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, k: int, silu_mul: bool,
            config: GemvConfig | None, norm: _Norm | None = None, rope: RopeOperands | None = None) -> torch.Tensor:
    m, n = x.shape[0], weight.shape[0]
    assert weight.shape[1] == k and x.stride(-1) == 1 and weight.is_contiguous(), (x.shape, weight.shape)
    assert bias is None or (bias.shape == (n,) and bias.is_contiguous()), None if bias is None else bias.shape
    cfg = config or pick_config(m, n, k, _num_sms(x.device))
    assert rope is None or (cfg.split_k == 1 and cfg.block_n % 2 == 0 and n % rope.head_dim == 0), (cfg, n)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_k = cfg.block_k
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), block_k) * block_k
    split = triton.cdiv(k, k_per_split)
    partial = split > 1
    dest = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if partial else out
    b = bias if bias is not None else out
    assert cfg.kind != "dot" or cfg.block_n >= 16, cfg
    res = norm.residual if norm is not None and norm.residual is not None else x
    pdl = launch_kwargs(x)
    blocks = triton.cdiv(n, cfg.block_n)
    merge = partial and FUSED_SPLIT
    counters = merge_counters(x.device, blocks) if merge else out
    pos, table = (rope.positions, rope.cos_sin_cache) if rope is not None else (x, x)
    _gemv_kernel[(blocks, split)](
        x, weight, b, out, dest, counters, res, x if norm is None else norm.weight, x if norm is None else norm.res_out,
        pos, table, m, n, k, x.stride(0), res.stride(0), k_per_split, 0.0 if norm is None else norm.eps,
        0 if rope is None else rope.rotated_rows,
        HAS_BIAS=bias is not None, SILU_MUL=silu_mul, NORM=norm is not None,
        HAS_RES=norm is not None and norm.residual is not None, PARTIAL=partial, MERGE=merge,
        SPLIT=split if merge else 1, KIND=_KINDS[cfg.kind],
        BLOCK_M=cfg.block_m(m), BLOCK_N=cfg.block_n, BLOCK_K=block_k,
        NORM_ROWS=triton.next_power_of_2(m) if norm is not None else 1,
        NORM_BLOCK=triton.next_power_of_2(k) if norm is not None else 1,
        ROPE=rope is not None, HALF=1 if rope is None else rope.head_dim // 2, PREFETCH=PREFETCH,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl)
    if partial and not merge:
        mn = m * n
        _split_sum_kernel[(triton.cdiv(mn, 1024),)](dest, b, out, mn, n, SPLIT=split,
                                                   HAS_BIAS=bias is not None, BLOCK=1024, **pdl)
    return out


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: GemvConfig | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [M <= 8, K], weight [N, K] contiguous, fp32 accumulation."""
    return _launch(x, weight, bias, x.shape[1], False, config)


def silu_mul_gemv(gate_up: torch.Tensor, weight: torch.Tensor, config: GemvConfig | None = None) -> torch.Tensor:
    """F.linear(silu_and_mul(gate_up), weight) for gate_up [M, 2I] = [gate; up], weight [N, I]."""
    assert gate_up.shape[1] == 2 * weight.shape[1], (gate_up.shape, weight.shape)
    return _launch(gate_up, weight, None, weight.shape[1], True, config)


def norm_gemv(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
              weight: torch.Tensor, bias: torch.Tensor | None = None, config: GemvConfig | None = None,
              rope: RopeOperands | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(F.linear(h, weight, bias), s) for (h, s) = add_rms_norm(x, residual, norm_weight, eps), in one launch
    (two with split-K and without the fused merge), with the same bits as add_rms_norm followed by gemv
    with the same config. With rope (use_rope_gemv must hold), the first rope.rotated_rows outputs come
    out rotated, with the same bits as rotary_qk on the projection's output.

    s is a fresh [M, K] tensor (x itself when residual is None): the inputs are never written.
    """
    m, k = x.shape
    assert norm_weight.shape == (k,) and norm_weight.is_contiguous() and norm_weight.dtype == x.dtype
    assert k <= NORM_MAX_K, k
    if residual is None:
        res_out = x
    else:
        assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(-1) == 1
        res_out = torch.empty(m, k, dtype=x.dtype, device=x.device)
    y = _launch(x, weight, bias, k, False, config, _Norm(residual, norm_weight, eps, res_out), rope)
    return y, res_out
