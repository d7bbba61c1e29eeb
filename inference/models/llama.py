"""Llama (LlamaForCausalLM): the generic decoder as ModelFamily declares it.

`attention_bias` biases q, k, v and o; rope may carry llama3 scaling (read by inference/models/hf_config.py).
"""

from __future__ import annotations

from typing import Any

from inference.models.family import ModelFamily


class Llama(ModelFamily):
    name = "llama"
    architectures = ("LlamaForCausalLM",)
    model_type = "llama"
    tokenizer_adds_bos = True

    @classmethod
    def hf_config_fields(cls, num_layers: int) -> dict[str, Any]:
        return {"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1}
