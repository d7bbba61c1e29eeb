"""What a mixture-of-experts family adds to ModelFamily: its config keys, and its experts' names.

A checkpoint holds each expert's projections as tensors of their own (`<block>.experts.E.<part>.weight`)
and the router as `<block>.gate.weight`; we hold every MoE layer's experts fused, as transformers 5
does in memory (inference/layers/moe.py):
    mlp.gate.weight              [E, H]       <- <block>.gate.weight
    mlp.experts.gate_up_proj     [E, 2I, H]   <- experts.E.<gate> (shard id (E, 0)), experts.E.<up> ((E, 1))
    mlp.experts.down_proj        [E, H, I]    <- experts.E.<down> (shard id E)
A family names its block and its three parts (Qwen3-MoE: mlp, gate_proj/up_proj/down_proj; Mixtral:
block_sparse_moe, w1/w3/w2). At TP=1 the fused parameter flattened to 2-D is its HF parts stacked along
dim 0 in shard order, as for the dense fused modules (the weight receiver copies straight into them).
Dense layers of an MoE model (ModelConfig.dense_layers) keep the dense names of ModelFamily.
A trainer's transformers 5 model holds the experts fused under our names: a weight sync takes that layout
too (in_memory_hf_tensors), each fused tensor filling its parameter whole (shard id None).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

from inference.config import ModelConfig
from inference.models.family import ModelFamily, ShardId, WeightSlot

ROUTER, GATE_UP, DOWN = "mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"


class MoEFamily(ModelFamily):
    """Mixed in before a dense family: `class Qwen3Moe(MoEFamily, Qwen3)`."""

    moe_block: ClassVar[str] = "mlp"  # the checkpoint's module holding the router and the experts
    expert_parts: ClassVar[tuple[str, str, str]] = ("gate_proj", "up_proj", "down_proj")

    # ---- config.json ------------------------------------------------------------------------
    @classmethod
    def moe_fields(cls, hf: Mapping[str, Any]) -> dict[str, Any]:
        """num_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob, dense_layers."""
        raise NotImplementedError

    @classmethod
    def config_fields(cls, hf: Mapping[str, Any]) -> dict[str, Any]:
        return {**super().config_fields(hf), **cls.moe_fields(hf)}

    # ---- weight layout and names ------------------------------------------------------------
    @classmethod
    def layout(cls, config: ModelConfig) -> Iterator[WeightSlot]:
        """The dense layout, each MoE layer's MLP replaced by its router and experts (expert-major)."""
        h, inter, e = config.hidden_size, config.moe_intermediate_size, config.num_experts
        for slot in super().layout(config):
            layer = _layer_of(slot.param)
            if layer is None or not config.is_moe_layer(layer) or ".mlp." not in slot.param:
                yield slot
                continue
            if slot.param.endswith("mlp.down_proj.weight"):  # the dense MLP's last tensor: the MoE's place
                p = f"model.layers.{layer}."
                yield WeightSlot(p + ROUTER, None, (e, h))
                for expert in range(e):
                    yield WeightSlot(p + GATE_UP, (expert, 0), (inter, h))
                    yield WeightSlot(p + GATE_UP, (expert, 1), (inter, h))
                    yield WeightSlot(p + DOWN, expert, (h, inter))

    @classmethod
    def in_memory_hf_tensors(cls, config: ModelConfig) -> dict[str, tuple[int, ...]] | None:
        """transformers 5's in-memory layout: each MoE layer's experts fused under our names (so the
        trainer's tensors fill our parameters whole), the rest as the checkpoint names it."""
        out: dict[str, tuple[int, ...]] = {}
        h, inter, e = config.hidden_size, config.moe_intermediate_size, config.num_experts
        for slot in cls.layout(config):
            prefix, ours = _split_moe(slot.param)
            if ours is None:
                out[cls.hf_name(slot)] = slot.shape
            elif ours == ROUTER:
                out[slot.param] = (e, h)
                out[prefix + GATE_UP] = (e, 2 * inter, h)
                out[prefix + DOWN] = (e, h, inter)
        return out

    @classmethod
    def hf_name(cls, slot: WeightSlot) -> str:
        prefix, ours = _split_moe(slot.param)
        if ours is None:
            return super().hf_name(slot)
        gate, up, down = cls.expert_parts
        if ours == ROUTER:
            return f"{prefix}{cls.moe_block}.gate.weight"
        if ours == DOWN:
            return f"{prefix}{cls.moe_block}.experts.{slot.shard_id}.{down}.weight"
        assert isinstance(slot.shard_id, tuple), slot
        expert, part = slot.shard_id
        return f"{prefix}{cls.moe_block}.experts.{expert}.{(gate, up)[part]}.weight"

    @classmethod
    def hf_to_param(cls, hf_name: str) -> tuple[str, ShardId]:
        parts = hf_name.split(".")
        block = f".{cls.moe_block}."
        if block not in hf_name or len(parts) < 5 or parts[:2] != ["model", "layers"]:
            return super().hf_to_param(hf_name)
        prefix = ".".join(parts[:3]) + "."
        rest = parts[3:]
        if rest == [cls.moe_block, "gate", "weight"]:
            return prefix + ROUTER, None
        gate, up, down = cls.expert_parts
        if len(rest) == 5 and rest[0] == cls.moe_block and rest[1] == "experts" and rest[2].isdigit() \
                and rest[4] == "weight":
            expert = int(rest[2])
            if rest[3] == down:
                return prefix + DOWN, expert
            if rest[3] in (gate, up):
                return prefix + GATE_UP, (expert, (gate, up).index(rest[3]))
        return super().hf_to_param(hf_name)

    @classmethod
    def param_to_hf(cls, param_name: str, config: ModelConfig | None = None) -> list[tuple[str, ShardId]]:
        ours = _split_moe(param_name)[1]
        if ours is None:
            return super().param_to_hf(param_name, config)
        if ours == ROUTER:
            return [(cls.hf_name(WeightSlot(param_name, None, ())), None)]
        assert config is not None, f"{param_name}: the expert count comes from the config"
        shard_ids: list[ShardId] = (list(range(config.num_experts)) if ours == DOWN else
                                    [(e, j) for e in range(config.num_experts) for j in (0, 1)])
        return [(cls.hf_name(WeightSlot(param_name, sid, ())), sid) for sid in shard_ids]


def _layer_of(param: str) -> int | None:
    parts = param.split(".")
    return int(parts[2]) if len(parts) > 3 and parts[:2] == ["model", "layers"] else None


def _split_moe(param: str) -> tuple[str, str | None]:
    """("model.layers.N.", our MoE suffix) for a router or expert parameter, else (param, None)."""
    for ours in (ROUTER, GATE_UP, DOWN):
        if param.endswith("." + ours) and _layer_of(param) is not None:
            return param[: -len(ours)], ours
    return param, None
