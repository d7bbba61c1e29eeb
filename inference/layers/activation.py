"""Gated activations on fused gate_up outputs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from inference.core import InvalidRequestError


class SiluAndMul(nn.Module):
    """[..., 2 * I] laid out as [gate; up] -> silu(gate) * up, shape [..., I]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


def get_activation(name: str) -> nn.Module:
    """The gated activation for an HF `hidden_act` name."""
    if name != "silu":
        raise InvalidRequestError("config.hidden_act", f"activation {name!r} is not supported (only 'silu')")
    return SiluAndMul()
