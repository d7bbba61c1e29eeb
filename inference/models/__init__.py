"""Decoder-only model families behind one builder; every family is the generic decoder with flags."""

from __future__ import annotations

import torch

from inference.config import ARCHITECTURES, ModelConfig
from inference.core import InvalidRequestError
from inference.layers.attention import AttentionBackend, ReferenceAttention
from inference.models.decoder import DecoderForCausalLM, KVCacheSpec
from inference.parallel import TPInfo

_FAMILIES = {"llama": DecoderForCausalLM, "qwen2": DecoderForCausalLM, "qwen3": DecoderForCausalLM,
             "mistral": DecoderForCausalLM}
assert set(_FAMILIES) == set(ARCHITECTURES.values())


def build_model(config: ModelConfig, tp: TPInfo, dtype: torch.dtype, device: torch.device | str,
                attention: AttentionBackend | None = None) -> DecoderForCausalLM:
    """Build the model for config.family with uninitialized parameters (load_weights fills them).

    `attention` defaults to ReferenceAttention. Raises InvalidRequestError when the family is unknown
    or the head counts do not divide by tp.size.
    """
    if config.family not in _FAMILIES:
        raise InvalidRequestError(
            "config.family", f"unknown family {config.family!r}; known: {sorted(_FAMILIES)}")
    cls = _FAMILIES[config.family]
    return cls(config, tp, dtype, torch.device(device), attention or ReferenceAttention())


__all__ = ["DecoderForCausalLM", "KVCacheSpec", "build_model"]
