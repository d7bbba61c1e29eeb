"""The linear layers' product in the batch-invariant mode (EngineConfig.batch_invariant; docs/invariance.md).

`invariant_linear(x, weight, bias)` computes every row of x @ weight^T (+ bias) in an order that depends
on the weight's shape only, never on the number of rows, so a token's projections have the same bits in
a prefill of 8192 tokens, a decode batch of 128, a batch of 1 and a spec-decode verify:

- Triton (CUDA bf16/fp16, or CPU tensors in Triton's interpreter when gemv.FORCE_ON_CPU): the GEMV
  kernel of gemv_kernels.py as a GEMM, its "dot" kind over row blocks of a fixed BLOCK_M (grid axis 2),
  with the tiles and split-K that `pick_config` gives several rows of this weight shape (fixed per
  shape and device, never per row count). Each output element is summed over K in BLOCK_K steps in
  order, split-K partials merged in split order. Every row block runs the same instructions on the
  same tile shape, so a row's bits do not depend on its block or its neighbours.
- Elsewhere (CPU, fp32 on CUDA, Triton missing or SIDECAR_GEMV=0): `invariant.tiled_linear`, products
  of a fixed number of rows per call (the facts it rests on: inference/layers/invariant.py).

The fused prologues of the GEMV (norm_gemv, silu_mul_gemv) are not used in the mode: their one-row
configurations differ from the several-row one, so the layers run add_rms_norm and silu_and_mul (one
program per row, or elementwise) in their own launches.
"""

from __future__ import annotations

import torch

from inference import envs
from inference.layers import gemv as gemv_mod
from inference.layers.gemv import GemvConfig, pick_config
from inference.layers.invariant import tiled_linear

try:
    import triton
except ImportError:  # the torch path serves without Triton
    triton = None

BLOCK_M = 16  # rows of x per program: tl.dot's minimum, so a decode batch of 1 pads the least
_DTYPES = (torch.bfloat16, torch.float16)


def use_invariant_gemm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether invariant_gemm takes x [M, K] @ weight [N, K]^T (the GEMV's conditions, any M)."""
    if triton is None or not gemv_mod.ENABLED:
        return False
    if not (x.is_cuda or (gemv_mod.FORCE_ON_CPU and envs.TRITON_INTERPRET.get())):
        return False
    return (x.dim() == 2 and weight.dim() == 2 and x.shape[0] > 0 and x.dtype in _DTYPES
            and weight.dtype == x.dtype and weight.is_contiguous() and x.stride(-1) == 1
            and x.device == weight.device)


def invariant_config(n: int, k: int, device: torch.device) -> GemvConfig:
    """The launch shape of weight [n, k] on `device`: pick_config's several-row ("dot") shape, which
    depends on (n, k) and the device's SM count only."""
    cfg = pick_config(2, n, k, gemv_mod._num_sms(device))
    assert cfg.kind == "dot" and cfg.block_n >= 16, cfg
    return cfg


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) with each row's bits independent of the other rows (see the module note)."""
    if use_invariant_gemm(x, weight):
        return invariant_gemm(x, weight, bias)
    return tiled_linear(x, weight, bias)


def invariant_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   config: GemvConfig | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias) in one launch (two with split-K and without the fused merge),
    fp32 accumulation; `config` (tests) overrides invariant_config."""
    cfg = config or invariant_config(weight.shape[0], x.shape[1], x.device)
    return gemv_mod._launch(x, weight, bias, x.shape[1], False, cfg, row_block=BLOCK_M)
