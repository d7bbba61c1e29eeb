"""Mixtral (MixtralForCausalLM): Mistral's attention, and every MLP a sparse mixture of experts.

The router takes the top-k logits and softmaxes them (the same weights as softmax, top-k, renormalise);
the experts are `intermediate_size` wide, held under `block_sparse_moe` as w1 (gate), w3 (up), w2 (down).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from inference.models.mistral import Mistral
from inference.models.moe_family import MoEFamily


class Mixtral(MoEFamily, Mistral):
    name = "mixtral"
    architectures = ("MixtralForCausalLM",)
    model_type = "mixtral"
    moe_block = "block_sparse_moe"
    expert_parts = ("w1", "w3", "w2")

    @classmethod
    def moe_fields(cls, hf: Mapping[str, Any]) -> dict[str, Any]:
        return {"num_experts": int(hf["num_local_experts"]), "num_experts_per_tok": int(hf["num_experts_per_tok"]),
                "moe_intermediate_size": int(hf["intermediate_size"]), "norm_topk_prob": True,
                "dense_layers": ()}

    @classmethod
    def hf_config_fields(cls, num_layers: int) -> dict[str, Any]:
        return {**super().hf_config_fields(num_layers), "num_local_experts": 8, "num_experts_per_tok": 2,
                "router_jitter_noise": 0.0, "router_aux_loss_coef": 0.001, "output_router_logits": False}
