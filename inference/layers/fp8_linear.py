"""The linear layers' product with FP8 weights: x @ (q * scale[:, None])^T (+ b), q float8_e4m3fn [N, K]
and scale fp32 [N] under the rule of inference/quant/fp8.py (EngineConfig.quantization = "fp8").

Three paths, each a function of the shapes and the device only (so a CUDA graph replays what eager ran):
- decode (at most FP8_GEMV_MAX_M rows, Triton): the GEMV of gemv.py reading the FP8 bytes (half of
  bf16's), widening them in registers and scaling each output row once after its fp32 sum;
- prefill and large batches on CUDA: torch._scaled_mm on the tensor cores, x quantized row by row by the
  same rule on the device (no host read, so it captures), rowwise scales, bf16/fp16 out, the bias after;
- elsewhere (CPU, fp32, shapes _scaled_mm refuses): dequantize_rows, then F.linear: the reference.
The batch-invariant mode dequantizes into its invariant GEMM (invariant_linear), so each row's bits stay
independent of the batch; it reads bf16-sized weights then and runs no faster than bf16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from inference.layers.gemm_invariant import invariant_linear
from inference.layers.gemv import MAX_M, gemv
from inference.layers.kernel_device import use_triton
from inference.quant.fp8 import FP8_DTYPE, dequantize_rows, quantize_activations

# Up to this many rows the FP8 GEMV runs (every weight byte read once; _scaled_mm would first quantize x
# and pad its tiles). scripts/bench/gemv.py --quantization fp8 measures the crossover.
FP8_GEMV_MAX_M = MAX_M
_ACT_DTYPES = (torch.bfloat16, torch.float16)


def use_fp8_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the Triton GEMV takes x [M, K] @ the FP8 weight [N, K]^T."""
    return (use_triton(x) and x.dim() == 2 and 0 < x.shape[0] <= FP8_GEMV_MAX_M and x.dtype in _ACT_DTYPES
            and weight.dtype == FP8_DTYPE and weight.is_contiguous() and x.stride(-1) == 1
            and x.device == weight.device)


def use_scaled_mm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether torch._scaled_mm takes the product: CUDA, bf16/fp16 x, K and N multiples of 16."""
    return (x.is_cuda and x.dim() == 2 and x.dtype in _ACT_DTYPES and weight.dtype == FP8_DTYPE
            and x.shape[1] % 16 == 0 and weight.shape[0] % 16 == 0 and weight.is_contiguous())


def scaled_mm_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                     bias: torch.Tensor | None) -> torch.Tensor:
    """x quantized per row by the rule, then one FP8 tensor-core GEMM with rowwise scales."""
    xq, x_scale = quantize_activations(x)
    y = torch._scaled_mm(xq, weight.t(), scale_a=x_scale[:, None], scale_b=scale[None, :],
                         out_dtype=x.dtype)
    return y if bias is None else y + bias


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
               invariant: bool = False) -> torch.Tensor:
    """F.linear(x, dequantize_rows(weight, scale), bias) by the path the module docstring picks."""
    if invariant:
        return invariant_linear(x, dequantize_rows(weight, scale, x.dtype), bias)
    if use_fp8_gemv(x, weight):
        return gemv(x, weight, bias, scale=scale)
    if x.shape[0] and use_scaled_mm(x, weight):
        return scaled_mm_linear(x, weight, scale, bias)
    return F.linear(x, dequantize_rows(weight, scale, x.dtype), bias)
