"""Mistral (MistralForCausalLM): the Llama layout; config.json's `sliding_window` applies when set."""

from __future__ import annotations

from typing import Any

from inference.models.family import ModelFamily


class Mistral(ModelFamily):
    name = "mistral"
    architectures = ("MistralForCausalLM",)
    model_type = "mistral"
    tokenizer_adds_bos = True

    @classmethod
    def hf_config_fields(cls, num_layers: int) -> dict[str, Any]:
        return {"sliding_window": None}
