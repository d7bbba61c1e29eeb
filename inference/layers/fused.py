"""Fused elementwise kernels (Triton) with plain-torch twins that define their exact math.

Each kernel rounds where the eager torch code rounds (a bf16 add, a bf16 cast after the fp32
normalisation, a bf16 multiply), so the fused path and the eager path agree bit for bit in every
dtype (up to the last bit of exp/rsqrt); tests hold them equal. Rotary launches with FP contraction off:
with it, LLVM fuses one rounded product into the add and ~8% of elements differ by one rounding (H200).
The Triton path is taken where kernel_device.use_triton says (CUDA tensors; CPU tensors in Triton's
interpreter inside interpreted_on_cpu(), which is how CI checks the kernels).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from inference.layers.kernel_device import use_triton
from inference.layers.pdl import launch_kwargs

try:
    import triton
    import triton.language as tl

    from inference.layers.pdl import launch_dependents, wait
except ImportError:  # the engine runs without Triton, on the torch path
    triton = None


# ---- residual add + RMSNorm -----------------------------------------------------------------------
def add_rms_norm_torch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * rmsnorm(x + residual), x + residual); without residual the second output is x."""
    if residual is not None:
        x = x + residual
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight * normed, x


if triton is not None:

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, eps,
                             HAS_RES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        launch_dependents(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        wait(PDL)
        x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
        if HAS_RES:
            r = tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # the eager add rounds to the dtype
            tl.store(res_out_ptr + row * n_cols + cols, x, mask=mask)
        x32 = x.to(tl.float32)
        var = tl.sum(x32 * x32, axis=0) / n_cols
        normed = (x32 * tl.math.rsqrt(var + eps)).to(x.dtype)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        tl.store(out_ptr + row * n_cols + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype), mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if not use_triton(x) or x.dtype != weight.dtype:
        return add_rms_norm_torch(x, residual, weight, eps)
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).contiguous()
    out = torch.empty_like(x2)
    if residual is None:
        res_out, res_in = x2, x2
    else:
        res_in = residual.reshape(-1, shape[-1]).contiguous()
        res_out = torch.empty_like(x2)
    if x2.shape[0]:
        _add_rms_norm_kernel[(x2.shape[0],)](x2, res_in, weight, out, res_out, shape[-1], eps,
                                             HAS_RES=residual is not None,
                                             BLOCK=triton.next_power_of_2(shape[-1]), **launch_kwargs(x2))
    return out.view(shape), res_out.view(shape)


# ---- SiLU and multiply ------------------------------------------------------------------------
def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


if triton is not None:

    @triton.jit
    def _silu_and_mul_kernel(x_ptr, out_ptr, n_cols, BLOCK: tl.constexpr, PDL: tl.constexpr):
        launch_dependents(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        wait(PDL)
        gate = tl.load(x_ptr + row * 2 * n_cols + cols, mask=mask, other=0.0)
        up = tl.load(x_ptr + row * 2 * n_cols + n_cols + cols, mask=mask, other=0.0)
        g32 = gate.to(tl.float32)
        act = (g32 / (1.0 + tl.exp(-g32))).to(gate.dtype)  # F.silu rounds to the dtype
        tl.store(out_ptr + row * n_cols + cols, (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if not use_triton(x):
        return silu_and_mul_torch(x)
    n = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * n).contiguous()
    out = torch.empty(x2.shape[0], n, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(n))
    if x2.shape[0]:
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(n, block))](x2, out, n, BLOCK=block, **launch_kwargs(x2))
    return out.view(*x.shape[:-1], n)


# ---- rotary (neox style, rotate_half) ---------------------------------------------------------
def rotary_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] with cos/sin [T, 1, D] (both halves repeated), as HF applies it."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


if triton is not None:

    @triton.jit
    def _rotate_heads(x_ptr, out_ptr, t, stride_t, stride_h, n_heads, cos, sin,
                      HALF: tl.constexpr, BLOCK_H: tl.constexpr):
        heads = tl.arange(0, BLOCK_H)
        d = tl.arange(0, HALF)
        hmask = heads[:, None] < n_heads
        base = t * stride_t + heads[:, None] * stride_h + d[None, :]
        x1 = tl.load(x_ptr + base, mask=hmask, other=0.0)
        x2 = tl.load(x_ptr + base + HALF, mask=hmask, other=0.0)
        dt = x1.dtype
        # out = x * cos + rotate_half(x) * sin, rounding each product and the sum like eager torch. The launch
        # turns FP contraction off: with it, LLVM fuses one rounded product into the add (fma.rn.bf16).
        lo = ((x1.to(tl.float32) * cos).to(dt).to(tl.float32) + (-x2.to(tl.float32) * sin).to(dt).to(tl.float32))
        hi = ((x2.to(tl.float32) * cos).to(dt).to(tl.float32) + (x1.to(tl.float32) * sin).to(dt).to(tl.float32))
        out = t * n_heads * 2 * HALF + heads[:, None] * 2 * HALF + d[None, :]
        tl.store(out_ptr + out, lo.to(dt), mask=hmask)
        tl.store(out_ptr + out + HALF, hi.to(dt), mask=hmask)

    @triton.jit
    def _rotary_qk_kernel(q_ptr, k_ptr, q_out, k_out, cs_ptr, pos_ptr, q_stride_t, q_stride_h, k_stride_t,
                          k_stride_h, n_q, n_k, HALF: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
                          HAS_K: tl.constexpr, PDL: tl.constexpr):
        launch_dependents(PDL)
        t = tl.program_id(0).to(tl.int64)
        wait(PDL)
        pos = tl.load(pos_ptr + t).to(tl.int64)
        d = tl.arange(0, HALF)
        dt = q_ptr.dtype.element_ty
        cos = tl.load(cs_ptr + pos * 2 * HALF + d).to(dt).to(tl.float32)[None, :]
        sin = tl.load(cs_ptr + pos * 2 * HALF + HALF + d).to(dt).to(tl.float32)[None, :]
        _rotate_heads(q_ptr, q_out, t, q_stride_t, q_stride_h, n_q, cos, sin, HALF, BLOCK_Q)
        if HAS_K:
            _rotate_heads(k_ptr, k_out, t, k_stride_t, k_stride_h, n_k, cos, sin, HALF, BLOCK_K)


def rotary(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] (any strides in T and H, unit stride in D) at `positions` [T]."""
    if not use_triton(x):
        cos, sin = cos_sin_cache[positions].to(x.dtype).unsqueeze(1).chunk(2, dim=-1)
        return rotary_torch(x, torch.cat((cos, cos), -1), torch.cat((sin, sin), -1))
    return _rotary_launch(x, None, positions, cos_sin_cache)[0]


def rotary_qk(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
              cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hk, D] in one launch (the decode path's hot spot)."""
    if not use_triton(q):
        return rotary(q, positions, cos_sin_cache), rotary(k, positions, cos_sin_cache)
    q_out, k_out = _rotary_launch(q, k, positions, cos_sin_cache)
    assert k_out is not None
    return q_out, k_out


def _rotary_launch(q: torch.Tensor, k: torch.Tensor | None, positions: torch.Tensor,
                   cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    t, hq, d = q.shape
    assert q.stride(2) == 1 and d % 2 == 0 and d & (d - 1) == 0, (q.stride(), d)
    q_out = torch.empty(t, hq, d, dtype=q.dtype, device=q.device)
    k_out = None if k is None else torch.empty(k.shape, dtype=k.dtype, device=k.device)
    kk = q if k is None else k
    assert kk.stride(2) == 1 and kk.dtype == q.dtype
    if t:
        _rotary_qk_kernel[(t,)](q, kk, q_out, q_out if k_out is None else k_out, cache, positions,
                                q.stride(0), q.stride(1), kk.stride(0), kk.stride(1), hq, kk.shape[1],
                                HALF=d // 2, BLOCK_Q=triton.next_power_of_2(hq),
                                BLOCK_K=triton.next_power_of_2(kk.shape[1]), HAS_K=k is not None,
                                enable_fp_fusion=False, **launch_kwargs(q))
    return q_out, k_out
