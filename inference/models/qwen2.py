"""Qwen2 (Qwen2ForCausalLM): q, k and v always carry a bias, o_proj never; embeddings tied by default.

config.json's `sliding_window` applies only with `use_sliding_window` (Qwen writes a window it does not use).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from inference.config import ModelConfig
from inference.models.family import ModelFamily


class Qwen2(ModelFamily):
    name = "qwen2"
    architectures = ("Qwen2ForCausalLM",)
    model_type = "qwen2"
    tie_word_embeddings_default = True

    @classmethod
    def config_fields(cls, hf: Mapping[str, Any]) -> dict[str, Any]:
        window = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
        return {"qkv_bias": True, "qk_norm": False, "sliding_window": window}

    @classmethod
    def o_proj_bias(cls, config: ModelConfig) -> bool:
        return False

    @classmethod
    def hf_config_fields(cls, num_layers: int) -> dict[str, Any]:
        return {"use_sliding_window": False, "sliding_window": None, "max_window_layers": num_layers,
                "layer_types": ["full_attention"] * num_layers}
