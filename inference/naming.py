"""THE one mapping between Hugging Face weight names and our parameters.

Our parameter names are the HF names with fused parts renamed:
    model.layers.N.self_attn.{q,k,v}_proj.{weight,bias} -> model.layers.N.self_attn.qkv_proj.*  ("q"/"k"/"v")
    model.layers.N.mlp.{gate,up}_proj.weight            -> model.layers.N.mlp.gate_up_proj.weight (0 / 1)
Every other name maps to itself with shard_id None. A tied lm_head is not a parameter of its own: it
IS model.embed_tokens.weight, so `lm_head.weight` is skipped when config.tie_word_embeddings (some
tied checkpoints still carry it; we ignore it). Rotary inv_freq tables are skipped everywhere.
The loader, the weight receiver and the checksum audit all go through this module.
"""

from __future__ import annotations

from inference.config import ModelConfig

ShardId = str | int | None

# HF module name -> (our fused module name, shard id inside it)
_FUSED: dict[str, tuple[str, ShardId]] = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_UNFUSED: dict[str, list[tuple[str, ShardId]]] = {}
for _hf, (_ours, _sid) in _FUSED.items():
    _UNFUSED.setdefault(_ours, []).append((_hf, _sid))


def o_proj_has_bias(config: ModelConfig) -> bool:
    """Llama and Qwen3 put `attention_bias` on o_proj too; Qwen2's qkv bias stops at v_proj."""
    return config.qkv_bias and config.family != "qwen2"


def is_skipped(hf_name: str, config: ModelConfig) -> bool:
    """HF names that carry no parameter of ours: rotary tables, and lm_head when tied."""
    if "rotary_emb." in hf_name:
        return True
    return config.tie_word_embeddings and hf_name == "lm_head.weight"


def hf_to_param(hf_name: str) -> tuple[str, ShardId]:
    """The parameter an HF tensor goes into, and where in it (shard_id; None = the whole tensor).

    A pure rename: whether the parameter exists is for the caller to check (see is_skipped too).
    """
    parts = hf_name.split(".")
    if len(parts) >= 2 and parts[-2] in _FUSED:
        fused, shard_id = _FUSED[parts[-2]]
        return ".".join([*parts[:-2], fused, parts[-1]]), shard_id
    return hf_name, None


def param_to_hf(param_name: str) -> list[tuple[str, ShardId]]:
    """The HF tensors that fill one of our parameters, in fused order (inverse of hf_to_param)."""
    parts = param_name.split(".")
    if len(parts) >= 2 and parts[-2] in _UNFUSED:
        prefix, leaf = parts[:-2], parts[-1]
        return [(".".join([*prefix, hf, leaf]), sid) for hf, sid in _UNFUSED[parts[-2]]]
    return [(param_name, None)]


def expected_hf_tensors(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name a checkpoint of this config must have, with its full (unsharded) shape.

    Skipped names (rotary tables, a tied lm_head) are not listed.
    """
    h, d = config.hidden_size, config.head_dim
    q_out, kv_out = config.num_heads * d, config.num_kv_heads * d
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "post_attention_layernorm.weight"] = (h,)
        for name, n in (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)):
            out[f"{p}self_attn.{name}.weight"] = (n, h)
            if config.qkv_bias:
                out[f"{p}self_attn.{name}.bias"] = (n,)
        out[p + "self_attn.o_proj.weight"] = (h, q_out)
        if o_proj_has_bias(config):
            out[p + "self_attn.o_proj.bias"] = (h,)
        if config.qk_norm:
            out[p + "self_attn.q_norm.weight"] = (d,)
            out[p + "self_attn.k_norm.weight"] = (d,)
        out[p + "mlp.gate_proj.weight"] = (config.intermediate_size, h)
        out[p + "mlp.up_proj.weight"] = (config.intermediate_size, h)
        out[p + "mlp.down_proj.weight"] = (h, config.intermediate_size)
    out["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = (config.vocab_size, h)
    return out
