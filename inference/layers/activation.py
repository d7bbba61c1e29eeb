"""Gated activations on fused gate_up outputs."""

from __future__ import annotations

import torch
from torch import nn

from inference.core import InvalidRequestError
from inference.layers.fused import silu_and_mul


class SiluAndMul(nn.Module):
    """[..., 2 * I] laid out as [gate; up] -> silu(gate) * up, shape [..., I]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)


def get_activation(name: str) -> nn.Module:
    """The gated activation for an HF `hidden_act` name."""
    if name != "silu":
        raise InvalidRequestError("config.hidden_act", f"activation {name!r} is not supported (only 'silu')")
    return SiluAndMul()
