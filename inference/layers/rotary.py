"""Rotary position embedding, neox style (rotate_half), as HF Llama/Qwen/Mistral apply it.

The cos/sin table for every position below max_positions is computed once at build time in fp32 and
kept as a non-persistent buffer: it is not a weight (no checkpoint or weight sync refills it), so it
never appears in named_parameters() or state_dict(), and sleep/wake must keep it.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from inference.config import RopeConfig
from inference.layers.fused import rotary, rotary_qk, rotary_torch
from inference.layers.kernel_device import use_triton


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """[head_dim / 2] fp32 inverse frequencies, with llama3 scaling when rope.kind == "llama3".

    Computed on the CPU in the same op order as transformers so the tables match it exactly.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim
    inv_freq = 1.0 / (rope.theta ** exponents)
    if rope.kind == "default":
        return inv_freq
    assert rope.kind == "llama3", rope.kind
    old_ctx = rope.original_max_position_embeddings
    low_freq_wavelen = old_ctx / rope.low_freq_factor
    high_freq_wavelen = old_ctx / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_ctx / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Holds `cos_sin_cache` [max_positions, head_dim] fp32: [cos(p * f) | sin(p * f)], f = inv_freq."""

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig,
                 device: torch.device | str) -> None:
        super().__init__()
        assert head_dim % 2 == 0, head_dim
        self.head_dim = head_dim
        self.max_positions = max_positions
        inv_freq = rope_inv_freq(head_dim, rope)
        positions = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = torch.outer(positions, inv_freq)
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
        self.register_buffer("cos_sin_cache", cache.to(device), persistent=False)

    def prepare(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """The rotation at `positions` [T], shared by every layer of one forward."""
        return Rope(positions, self.cos_sin_cache, dtype)


class Rope:
    """Applies the rotation to [T, heads, head_dim] tensors: the fused kernel where Triton runs,
    else eager torch with cos/sin gathered once per forward."""

    def __init__(self, positions: torch.Tensor, cache: torch.Tensor, dtype: torch.dtype) -> None:
        self.positions = positions
        self.cache = cache
        dim = cache.shape[1]
        # The kernel takes power-of-two head dims (a head of 80 or 96 rotates in eager torch).
        self.fused = use_triton(cache) and dim & (dim - 1) == 0
        if not self.fused:
            cos, sin = cache[positions].to(dtype).unsqueeze(1).chunk(2, dim=-1)
            self.cos, self.sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return rotary(x, self.positions, self.cache)
        return rotary_torch(x, self.cos, self.sin)

    def apply_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fused:
            return rotary_qk(q, k, self.positions, self.cache)
        return rotary_torch(q, self.cos, self.sin), rotary_torch(k, self.cos, self.sin)
