"""Qwen3 (Qwen3ForCausalLM): Qwen2's config, plus an RMSNorm per head on q and k before rotary
(q_norm, k_norm); biases follow `attention_bias` as in Llama (q, k, v and o)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from inference.config import ModelConfig
from inference.models.qwen2 import Qwen2


class Qwen3(Qwen2):
    name = "qwen3"
    architectures = ("Qwen3ForCausalLM",)
    model_type = "qwen3"

    @classmethod
    def config_fields(cls, hf: Mapping[str, Any]) -> dict[str, Any]:
        return {**super().config_fields(hf), "qkv_bias": bool(hf.get("attention_bias", False)), "qk_norm": True}

    @classmethod
    def o_proj_bias(cls, config: ModelConfig) -> bool:
        return config.qkv_bias  # as in Llama: `attention_bias` covers o_proj too, unlike Qwen2

    @classmethod
    def hf_config_fields(cls, num_layers: int) -> dict[str, Any]:
        return {**super().hf_config_fields(num_layers), "attention_bias": False}
