"""RMSNorm as Llama/Qwen compute it: normalize in fp32, cast back, then scale in the input dtype."""

from __future__ import annotations

import torch
from torch import nn

from inference.layers.fused import add_rms_norm
from inference.layers.gemv import norm_gemv, use_norm_gemv
from inference.layers.linear import ColumnParallelLinear, new_param, replicated_loader, replicated_part


class RMSNorm(nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)) over the last dim; replicated on every TP rank.

    Also used per head (Qwen3 q_norm/k_norm) on [T, heads, head_dim] with size = head_dim.
    `invariant` (the batch-invariant mode): `linear` never fuses the norm into the projection (norm_gemv's
    one-row shapes differ from the mode's fixed GEMM); the norm itself reduces each row alone already
    (one Triton program per row; torch sums a row under 32768 elements serially, see layers/invariant.py).
    """

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device | str,
                 invariant: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.invariant = invariant
        self.weight = new_param((size,), dtype, device, replicated_loader, replicated_part)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The order of casts follows HF exactly so that bf16 outputs match bit for bit.
        return add_rms_norm(x, None, self.weight, self.eps)[0]

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual) in one fused pass: the pre-norm residual step."""
        return add_rms_norm(x, residual, self.weight, self.eps)

    def linear(self, x: torch.Tensor, residual: torch.Tensor | None,
               proj: ColumnParallelLinear) -> tuple[torch.Tensor, torch.Tensor]:
        """(proj(norm(x + residual)), x + residual), or (proj(norm(x)), x) without residual.

        At decode batch sizes the norm runs in the GEMV's prologue (norm_gemv: one launch fewer, same
        bits); otherwise add_rms_norm, then the projection. proj is column-parallel, so its forward is
        the bare matmul and no reduction follows.
        """
        if not self.invariant and proj.lora is None and use_norm_gemv(x, proj.weight, self.weight, residual):
            return norm_gemv(x, residual, self.weight, self.eps, proj.weight, proj.bias, scale=proj.weight_scale)
        h, residual = (self(x), x) if residual is None else self.add_forward(x, residual)
        return proj(h), residual
