"""Build the model of a ModelConfig: every registered family is the generic decoder with its flags."""

from __future__ import annotations

import torch

from inference.config import ModelConfig
from inference.layers.attention import AttentionBackend, ReferenceAttention
from inference.models.decoder import DecoderForCausalLM
from inference.models.registry import get_family
from inference.parallel import TPInfo


def build_model(config: ModelConfig, tp: TPInfo, dtype: torch.dtype, device: torch.device | str,
                attention: AttentionBackend | None = None, batch_invariant: bool = False,
                quantization: str = "none") -> DecoderForCausalLM:
    """Build the model for config.family with uninitialized parameters (load_weights fills them).

    `attention` defaults to ReferenceAttention; `batch_invariant`: the layers of the batch-invariant mode
    (the attention backend is the caller's: attention_invariant.batch_invariant_backend); `quantization`:
    "none" or "fp8" (EngineConfig.quantization: FP8 linear weights). Raises
    InvalidRequestError when the family is unknown or the head counts do not divide by tp.size.
    """
    get_family(config.family)
    return DecoderForCausalLM(config, tp, dtype, torch.device(device), attention or ReferenceAttention(),
                              batch_invariant, quantization)
