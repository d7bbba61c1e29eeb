"""RMSNorm as Llama/Qwen compute it: normalize in fp32, cast back, then scale in the input dtype."""

from __future__ import annotations

import torch
from torch import nn

from inference.layers.fused import add_rms_norm
from inference.layers.linear import new_param, replicated_loader


class RMSNorm(nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)) over the last dim; replicated on every TP rank.

    Also used per head (Qwen3 q_norm/k_norm) on [T, heads, head_dim] with size = head_dim.
    """

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.eps = eps
        self.weight = new_param((size,), dtype, device, replicated_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The order of casts follows HF exactly so that bf16 outputs match bit for bit.
        return add_rms_norm(x, None, self.weight, self.eps)[0]

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual) in one fused pass: the pre-norm residual step."""
        return add_rms_norm(x, residual, self.weight, self.eps)
