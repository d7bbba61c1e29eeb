"""Reading a Hugging Face config.json into ModelConfig (transformers 4.x and 5.x layouts both).

The family (inference/models/registry.py) is found from `architectures`, else `model_type`, and its
class reads the fields that differ by family (biases, qk norm, sliding window); the rest is common.
A missing or malformed file is an InvalidRequestError naming "model"; an unknown family or rope type
names the config field. Torch-free: `sidecar launch` validates model directories without torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from inference.config import ModelConfig, RopeConfig
from inference.core import InvalidRequestError
from inference.models.registry import family_for_hf


def read_model_config(model_dir: str | Path) -> ModelConfig:
    """The ModelConfig of a model directory's config.json."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise InvalidRequestError("model", f"{path} not found: a model directory needs config.json")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise InvalidRequestError("model", f"{path} is not valid JSON: {e}") from e
    return model_config_from_hf(data)


def model_config_from_hf(d: dict[str, Any]) -> ModelConfig:
    """The ModelConfig of a config.json's contents."""
    family = family_for_hf(d)  # what differs by family (biases, qk norm, window) is read by its class
    num_heads = d["num_attention_heads"]
    head_dim = d.get("head_dim") or d["hidden_size"] // num_heads
    eos = d.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    return ModelConfig(
        family=family.name,
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"],
        num_layers=d["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=d.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rms_norm_eps=d.get("rms_norm_eps", 1e-6),
        rope=_rope_from_hf(d),
        max_position_embeddings=d.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        **family.config_fields(d),
        eos_token_ids=eos_ids,
        bos_token_id=d.get("bos_token_id"),
        dtype=str(d.get("torch_dtype") or d.get("dtype") or "bfloat16"),
        hidden_act=d.get("hidden_act", "silu"),
    )


def _rope_from_hf(d: dict[str, Any]) -> RopeConfig:
    # transformers 5 writes `rope_parameters` (theta inside); 4.x writes rope_theta + rope_scaling.
    params = dict(d.get("rope_parameters") or {})
    scaling = dict(d.get("rope_scaling") or {})
    params = {**scaling, **params}
    theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind not in ("default", "llama3"):
        raise InvalidRequestError("config.rope_scaling", f"rope type {kind!r} is not supported")
    if kind == "default":
        return RopeConfig(theta=float(theta))
    return RopeConfig(
        theta=float(theta),
        kind="llama3",
        factor=float(params["factor"]),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )
