"""THE one mapping between Hugging Face weight names and our parameters, answered by the model's family.

Each family class (inference/models/<family>.py; the defaults in inference/models/family.py) declares
its HF module names and its weight layout; this module finds a config's family and asks it. The loader,
the weight receiver and the checksum audit all go through here, never through a family directly.

For the shipped families our names are the HF names with fused parts renamed:
    model.layers.N.self_attn.{q,k,v}_proj.{weight,bias} -> model.layers.N.self_attn.qkv_proj.*  ("q"/"k"/"v")
    model.layers.N.mlp.{gate,up}_proj.weight            -> model.layers.N.mlp.gate_up_proj.weight (0 / 1)
MoE families (inference/models/moe_family.py) fill fused expert parameters [E, ...] from one HF tensor
per expert and projection (shard ids: expert, or (expert, gate/up index)).
Every other name maps to itself with shard_id None. A tied lm_head is not a parameter of its own: it
IS model.embed_tokens.weight, so `lm_head.weight` is skipped when config.tie_word_embeddings (some
tied checkpoints still carry it; we ignore it). Rotary inv_freq tables are skipped everywhere.
LoRA adapter tensors travel under their base module's HF name: `<module>.lora_A.weight` [r, in] and
`<module>.lora_B.weight` [out, r] (PEFT's names without "base_model.model." and the adapter name).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

from inference.models.family import ModelFamily, ShardId
from inference.models.registry import family_names, get_family

if TYPE_CHECKING:
    from inference.config import ModelConfig

__all__ = [
    "LORA_KINDS",
    "ShardId",
    "expected_hf_tensors",
    "expected_wire_tensors",
    "family_of",
    "hf_layout_of",
    "hf_to_param",
    "is_skipped",
    "lora_base_name",
    "lora_name",
    "o_proj_has_bias",
    "param_to_hf",
    "peft_to_hf",
]


def family_of(config: ModelConfig) -> type[ModelFamily]:
    """The family class of `config` (its module map and weight layout)."""
    return get_family(config.family)


def o_proj_has_bias(config: ModelConfig) -> bool:
    """Llama and Qwen3 put `attention_bias` on o_proj too; Qwen2's qkv bias stops at v_proj."""
    return family_of(config).o_proj_bias(config)


def is_skipped(hf_name: str, config: ModelConfig) -> bool:
    """HF names that carry no parameter of ours: rotary tables, and lm_head when tied."""
    return family_of(config).is_skipped(hf_name, config)


def hf_to_param(hf_name: str, config: ModelConfig) -> tuple[str, ShardId]:
    """The parameter an HF tensor goes into, and where in it (shard_id; None = the whole tensor).

    A pure rename: whether the parameter exists is for the caller to check (see is_skipped too).
    """
    return family_of(config).hf_to_param(hf_name)


def param_to_hf(param_name: str, config: ModelConfig) -> list[tuple[str, ShardId]]:
    """The HF tensors that fill one of our parameters, in fused order (inverse of hf_to_param)."""
    return family_of(config).param_to_hf(param_name, config)


def expected_hf_tensors(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name a checkpoint of this config must have, with its full (unsharded) shape,
    in the family's layout order. Skipped names (rotary tables, a tied lm_head) are not listed."""
    return family_of(config).expected_hf_tensors(config)


def expected_wire_tensors(config: ModelConfig, names: Collection[str]) -> dict[str, tuple[int, ...]]:
    """The tensors a weight sync must carry, in the layout `names` (its manifest's) are in: the checkpoint's
    (expected_hf_tensors), or the family's in-memory transformers layout when a name is only in that one
    (an MoE trainer's fused experts)."""
    family = family_of(config)
    checkpoint = family.expected_hf_tensors(config)
    in_memory = family.in_memory_hf_tensors(config)
    if in_memory is not None and any(n in in_memory and n not in checkpoint for n in names):
        return in_memory
    return checkpoint


def hf_layout_of(hf_names: Collection[str], param_names: Collection[str]) -> str | None:
    """The family under which `hf_names` (a checkpoint's or a trainer's tensors) are the HF layout of
    `param_names` (a rank's parameters): the names differ, and renaming the first gives the second, a tied
    lm_head and rotary tables aside. None when no family does (they are not one model in two layouts)."""
    ours, theirs = set(param_names) - {"lm_head.weight"}, set(hf_names)
    if not ours or theirs == set(param_names):
        return None
    for name in family_names():
        family = get_family(name)
        renamed = {family.hf_to_param(n)[0] for n in theirs if "rotary_emb." not in n} - {"lm_head.weight"}
        if renamed == ours:
            return name
    return None


LORA_KINDS = ("lora_A", "lora_B")
_PEFT_PREFIX = "base_model.model."


def lora_base_name(hf_name: str) -> tuple[str, str] | None:
    """`<module>.lora_A.weight` -> (`<module>.weight`, "lora_A"); None for any other name."""
    parts = hf_name.split(".")
    if len(parts) >= 3 and parts[-2] in LORA_KINDS and parts[-1] == "weight":
        return ".".join([*parts[:-2], "weight"]), parts[-2]
    return None


def lora_name(base_hf_name: str, kind: str) -> str:
    """The wire (and checkpoint-free) name of one adapter tensor of the module whose weight is `base_hf_name`."""
    assert kind in LORA_KINDS and base_hf_name.endswith(".weight"), (base_hf_name, kind)
    return f"{base_hf_name[:-len('.weight')]}.{kind}.weight"


def peft_to_hf(peft_name: str) -> str:
    """A PEFT adapter file's tensor name (adapter_model.safetensors: `base_model.model.<module>.lora_A.weight`)
    -> our wire name `<module>.lora_A.weight`."""
    return peft_name[len(_PEFT_PREFIX):] if peft_name.startswith(_PEFT_PREFIX) else peft_name
