"""What a model family knows, declared on one class: HF module names, fused modules, weight layout,
and how its config.json reads and is written.

A family is a subclass of ModelFamily in inference/models/<family>.py, listed in
inference/models/registry.py. Nothing else names a family: config.json reading
(inference/models/hf_config.py) and the tiny model writer ask the registry; the loader, the weight
receiver and the checksums ask inference/models/naming.py, which asks the config's family class.

The base class is the generic decoder (inference/models/decoder.py) with the HF Llama names; a family
overrides only what differs. Our parameter names are the HF names with every module of `hf_modules`
renamed: the q/k/v projections fill qkv_proj (shard ids "q", "k", "v") and gate/up fill gate_up_proj
(0, 1), stacked in that order along dim 0.

Torch-free on purpose: config parsing and `sidecar make-model --help` read families without loading torch.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from inference.config import ModelConfig

# A fused parameter's part: "q"/"k"/"v", a gate_up index, an expert, or (expert, gate_up index).
ShardId = str | int | tuple[int, int] | None

# Our fused modules and the shard id of each part, in stacking order: what the weight_loaders of
# QKVParallelLinear and MergedColumnParallelLinear take (inference/layers/linear.py).
FUSED_SHARDS: Mapping[str, tuple[ShardId, ...]] = {"qkv_proj": ("q", "k", "v"), "gate_up_proj": (0, 1)}


@dataclass(frozen=True)
class WeightSlot:
    """One HF tensor of a checkpoint, in our terms: the parameter it fills, where, and its full shape."""

    param: str
    shard_id: ShardId
    shape: tuple[int, ...]  # unsharded, as the checkpoint holds it


def _module_maps(owner: str, hf_modules: Mapping[str, tuple[str, ...]]
                 ) -> tuple[dict[str, tuple[str, ShardId]], dict[str, tuple[tuple[str, ShardId], ...]]]:
    """(HF module -> (our module, shard id), our module -> its HF parts), or TypeError naming the
    declaration `owner` got wrong."""
    to_ours: dict[str, tuple[str, ShardId]] = {}
    to_hf: dict[str, tuple[tuple[str, ShardId], ...]] = {}
    for fused in FUSED_SHARDS:
        if fused not in hf_modules:
            raise TypeError(f"{owner}.hf_modules: no HF modules fill our fused {fused}")
    for ours, hf_names in hf_modules.items():
        shard_ids = FUSED_SHARDS.get(ours, (None,))
        if len(hf_names) != len(shard_ids):
            raise TypeError(f"{owner}.hf_modules[{ours!r}]: {len(hf_names)} HF module(s) for "
                            f"{len(shard_ids)} part(s)")
        for hf, shard_id in zip(hf_names, shard_ids):
            if hf in to_ours:
                raise TypeError(f"{owner}.hf_modules: HF module {hf!r} fills both {to_ours[hf][0]} and {ours}")
            to_ours[hf] = (ours, shard_id)
        to_hf[ours] = tuple(zip(hf_names, shard_ids))
    return to_ours, to_hf


class ModelFamily:
    """One decoder-only model family. Subclasses set the names and override what differs.

    Invariants (checked when a subclass is defined): every fused module of FUSED_SHARDS has as many
    HF parts as shard ids; a module with one HF name is a plain rename (shard id None); no HF module
    name fills two of our modules.
    """

    name: ClassVar[str] = ""  # ModelConfig.family
    architectures: ClassVar[tuple[str, ...]] = ()  # config.json `architectures`; the first is written
    model_type: ClassVar[str] = ""  # config.json `model_type`, read when no architecture matches
    # Our module -> the HF modules that fill it, in stacking order. Modules not listed keep their name.
    hf_modules: ClassVar[Mapping[str, tuple[str, ...]]] = {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    }
    tie_word_embeddings_default: ClassVar[bool] = False  # what the tiny model writer assumes
    tokenizer_adds_bos: ClassVar[bool] = False  # a tiny tokenizer of this family prepends <|startoftext|>
    # derived from hf_modules when a class is defined
    _to_ours: ClassVar[dict[str, tuple[str, ShardId]]]
    _to_hf: ClassVar[dict[str, tuple[tuple[str, ShardId], ...]]]
    _to_ours, _to_hf = _module_maps("ModelFamily", hf_modules)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._to_ours, cls._to_hf = _module_maps(cls.__name__, cls.hf_modules)

    # ---- config.json ------------------------------------------------------------------------
    @classmethod
    def config_fields(cls, hf: Mapping[str, Any]) -> dict[str, Any]:
        """The ModelConfig fields whose reading depends on the family (the rest is common)."""
        return {"qkv_bias": bool(hf.get("attention_bias", False)), "qk_norm": False,
                "sliding_window": hf.get("sliding_window")}

    @classmethod
    def hf_config_fields(cls, num_layers: int) -> dict[str, Any]:
        """The family's own keys of a config.json as transformers writes it (the tiny model writes them)."""
        return {}

    @classmethod
    def o_proj_bias(cls, config: ModelConfig) -> bool:
        """Whether o_proj has a bias: Llama-style `attention_bias` covers q, k, v and o."""
        return config.qkv_bias

    # ---- weight layout and names ------------------------------------------------------------
    @classmethod
    def layout(cls, config: ModelConfig) -> Iterator[WeightSlot]:
        """Every HF tensor of a checkpoint, in our terms, in the order the tiny model draws them (so a
        new order changes every tiny model's bytes: bump inference/models/tiny.py's _FORMAT_VERSION with it).

        Skipped names (rotary tables, a tied lm_head) are not listed.
        """
        h, d, inter = config.hidden_size, config.head_dim, config.intermediate_size
        q_out, kv_out = config.num_heads * d, config.num_kv_heads * d
        yield WeightSlot("model.embed_tokens.weight", None, (config.vocab_size, h))
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            yield WeightSlot(p + "input_layernorm.weight", None, (h,))
            for shard_id, rows in zip(FUSED_SHARDS["qkv_proj"], (q_out, kv_out, kv_out)):
                yield WeightSlot(p + "self_attn.qkv_proj.weight", shard_id, (rows, h))
                if config.qkv_bias:
                    yield WeightSlot(p + "self_attn.qkv_proj.bias", shard_id, (rows,))
            if config.qk_norm:
                yield WeightSlot(p + "self_attn.q_norm.weight", None, (d,))
                yield WeightSlot(p + "self_attn.k_norm.weight", None, (d,))
            yield WeightSlot(p + "self_attn.o_proj.weight", None, (h, q_out))
            if cls.o_proj_bias(config):
                yield WeightSlot(p + "self_attn.o_proj.bias", None, (h,))
            yield WeightSlot(p + "post_attention_layernorm.weight", None, (h,))
            for shard_id in FUSED_SHARDS["gate_up_proj"]:
                yield WeightSlot(p + "mlp.gate_up_proj.weight", shard_id, (inter, h))
            yield WeightSlot(p + "mlp.down_proj.weight", None, (h, inter))
        yield WeightSlot("model.norm.weight", None, (h,))
        if not config.tie_word_embeddings:
            yield WeightSlot("lm_head.weight", None, (config.vocab_size, h))

    @classmethod
    def expected_hf_tensors(cls, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        """HF name -> full shape of every tensor a checkpoint of this config must have (layout order)."""
        return {cls.hf_name(slot): slot.shape for slot in cls.layout(config)}

    @classmethod
    def in_memory_hf_tensors(cls, config: ModelConfig) -> dict[str, tuple[int, ...]] | None:
        """The tensors a trainer's transformers model holds in memory, where they differ from the
        checkpoint's (a weight sync accepts either layout); None where they do not."""
        return None

    @classmethod
    def hf_name(cls, slot: WeightSlot) -> str:
        """The checkpoint's name for one slot of the layout."""
        return next(hf for hf, shard_id in cls.param_to_hf(slot.param) if shard_id == slot.shard_id)

    @classmethod
    def is_skipped(cls, hf_name: str, config: ModelConfig) -> bool:
        """HF names that carry no parameter of ours: rotary tables, and lm_head when tied (some tied
        checkpoints still carry it: it IS the embedding)."""
        if "rotary_emb." in hf_name:
            return True
        return config.tie_word_embeddings and cls.hf_to_param(hf_name) == ("lm_head.weight", None)

    @classmethod
    def hf_to_param(cls, hf_name: str) -> tuple[str, ShardId]:
        """The parameter an HF tensor goes into and where in it (shard_id None: the whole tensor).
        A pure rename: whether the parameter exists is for the caller to check."""
        parts = hf_name.split(".")
        if len(parts) >= 2 and parts[-2] in cls._to_ours:
            ours, shard_id = cls._to_ours[parts[-2]]
            return ".".join([*parts[:-2], ours, parts[-1]]), shard_id
        return hf_name, None

    @classmethod
    def param_to_hf(cls, param_name: str, config: ModelConfig | None = None) -> list[tuple[str, ShardId]]:
        """The HF tensors that fill one of our parameters, in stacking order (inverse of hf_to_param).
        `config` is needed only where the count of parts depends on it (an MoE family's experts)."""
        parts = param_name.split(".")
        if len(parts) >= 2 and parts[-2] in cls._to_hf:
            prefix, leaf = parts[:-2], parts[-1]
            return [(".".join([*prefix, hf, leaf]), sid) for hf, sid in cls._to_hf[parts[-2]]]
        return [(param_name, None)]
