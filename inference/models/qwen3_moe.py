"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3's attention, and sparse MLPs routed softmax-then-top-k.

The router's softmax runs over all experts; the top-k weights are renormalised to sum to 1 when
`norm_topk_prob`. `mlp_only_layers` and `decoder_sparse_step` say which layers keep a dense MLP
(of width `intermediate_size`); the experts are `moe_intermediate_size` wide. No shared expert.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from inference.models.moe_family import MoEFamily
from inference.models.qwen3 import Qwen3


class Qwen3Moe(MoEFamily, Qwen3):
    name = "qwen3_moe"
    architectures = ("Qwen3MoeForCausalLM",)
    model_type = "qwen3_moe"
    tie_word_embeddings_default = False

    @classmethod
    def moe_fields(cls, hf: Mapping[str, Any]) -> dict[str, Any]:
        layers, step = hf["num_hidden_layers"], int(hf.get("decoder_sparse_step", 1) or 1)
        only = set(hf.get("mlp_only_layers") or ())
        dense = tuple(i for i in range(layers) if i in only or (i + 1) % step)
        # The hub's config.json says num_experts; transformers 5 writes num_local_experts.
        experts = hf["num_experts"] if "num_experts" in hf else hf["num_local_experts"]
        return {"num_experts": int(experts), "num_experts_per_tok": int(hf["num_experts_per_tok"]),
                "moe_intermediate_size": int(hf["moe_intermediate_size"]),
                "norm_topk_prob": bool(hf.get("norm_topk_prob", False)), "dense_layers": dense}

    @classmethod
    def hf_config_fields(cls, num_layers: int) -> dict[str, Any]:
        # The tiny model's experts: 8 experts of 64, 2 per token (Qwen3-30B-A3B routes 8 of 128).
        return {**super().hf_config_fields(num_layers), "num_experts": 8, "num_experts_per_tok": 2,
                "moe_intermediate_size": 64, "norm_topk_prob": True, "decoder_sparse_step": 1,
                "mlp_only_layers": [], "router_aux_loss_coef": 0.001, "output_router_logits": False}
