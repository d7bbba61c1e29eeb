"""Gated activations on fused gate_up outputs."""

from __future__ import annotations

import torch
from torch import nn

from inference.core import InvalidRequestError
from inference.layers.fused import silu_and_mul
from inference.layers.invariant import silu_and_mul_invariant
from inference.layers.kernel_device import use_triton


class SiluAndMul(nn.Module):
    """[..., 2 * I] laid out as [gate; up] -> silu(gate) * up, shape [..., I].

    invariant (the batch-invariant mode): off the Triton path, SiLU as x / (1 + exp(-x)) (F.silu's SIMD
    and scalar paths round differently, so its bits follow the size of the call; layers/invariant.py).
    The Triton kernel computes every element alike already."""

    def __init__(self, invariant: bool = False) -> None:
        super().__init__()
        self.invariant = invariant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.invariant and not use_triton(x):
            return silu_and_mul_invariant(x)
        return silu_and_mul(x)


def get_activation(name: str, invariant: bool = False) -> nn.Module:
    """The gated activation for an HF `hidden_act` name."""
    if name != "silu":
        raise InvalidRequestError("config.hidden_act", f"activation {name!r} is not supported (only 'silu')")
    return SiluAndMul(invariant)
