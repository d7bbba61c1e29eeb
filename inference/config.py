"""Configuration: frozen dataclasses built once at the edge and passed down.

ModelConfig is read from a Hugging Face config.json (transformers 4.x and 5.x layouts both);
EngineConfig says how the engine runs. Values found at run time (KV blocks, graph batch sizes,
sleep state) live in state objects, never here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from inference.core import InvalidRequestError
from inference.models.registry import family_for_hf


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # "default" or "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    sliding_window: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    dtype: str = "bfloat16"  # the checkpoint's torch_dtype
    hidden_act: str = "silu"

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise InvalidRequestError("model", f"{path} not found: a model directory needs config.json")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise InvalidRequestError("model", f"{path} is not valid JSON: {e}") from e
        return cls.from_hf_dict(data)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        family = family_for_hf(d)  # what differs by family (biases, qk norm, window) is read by its class
        num_heads = d["num_attention_heads"]
        head_dim = d.get("head_dim") or d["hidden_size"] // num_heads
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
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


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # Exactly one sizing rule applies: an explicit byte budget, else a fraction of free device memory
    # (on CPU, kv_cache_bytes defaults to 256 MiB when neither is given).
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float = 0.85
    enable_prefix_caching: bool = True


@dataclass(frozen=True)
class SchedulerConfig:
    # None or 0: auto, chosen from the KV cache at sizing (inference/engine/worker.py resolve_max_num_seqs);
    # the resolved value is run-time state (Worker.max_num_seqs), never written back here.
    max_num_seqs: int | None = None
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    # Overlap each step's host work (schedule, input staging, commit) with the previous step on the
    # device (docs/architecture.md, Decisions). None: on for CUDA; True: also on CPU (tests); False: off.
    # With a draft model too: its plain steps overlap, the draft follows them; the speculative ones run
    # synchronously (docs/architecture.md, "Speculation on the tail").
    async_scheduling: bool | None = None
    # Speculative decoding on the tail only (issue 24): decodes get draft tokens while at most this many
    # decodes run; a fuller batch decodes plainly (the draft only mirrors its tokens into its cache),
    # because verifying k + 1 rows per sequence pays off while a step is bound by reading the weights,
    # not once the batch fills the device. 0: speculate at every batch size. 16: the H200's 7B rollout
    # with a draft ran 11.9-13.1k tok/s at 16 against 10.3-11.3k at 64 (docs/benchmarks.md, session 14).
    spec_max_batch: int = 16

    def overlaps_steps(self, device_type: str) -> bool:
        """async_scheduling decided for a device type (see the field): every TP rank decides the same."""
        return self.async_scheduling if self.async_scheduling is not None else device_type == "cuda"


LOAD_FORMATS = ("auto", "dummy")  # EngineConfig.load_format


@dataclass(frozen=True)
class EngineConfig:
    model: str
    tokenizer: str | None = None  # None: the model directory
    dtype: str = "auto"  # "auto": bfloat16 on CUDA, float32 on CPU
    device: str = "auto"  # "auto": cuda when available
    tp_size: int = 1
    seed: int = 0
    enforce_eager: bool = False
    attention_backend: str = "auto"  # "reference" or a fast backend name; "auto" picks per device
    load_format: str = "auto"  # "auto": safetensors from the model dir; "dummy": random (benchmarks)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    draft_model: str | None = None
    num_speculative_tokens: int = 4
    # Batch-invariant mode (docs/invariance.md): a request's tokens and logprobs have the same bits
    # whatever runs beside it (batch, prefill or decode, prefix hits, chunking, preemption, a draft).
    # Off by default until the H200 shows its cost under 5% (issue 23; scripts/bench_invariance.py).
    batch_invariant: bool = False


ENGINE_SECTIONS = {"cache": CacheConfig, "scheduler": SchedulerConfig}


def engine_option_names() -> dict[str, str]:
    """Every flat engine option -> its section ("" for EngineConfig itself, "cache", "scheduler").

    The flat names are unique across the sections (asserted), which is what lets `LLM(model, **options)`
    and `sidecar launch` name them without their section."""
    out = {f.name: "" for f in fields(EngineConfig) if f.name not in ENGINE_SECTIONS}
    for section, cls in ENGINE_SECTIONS.items():
        for f in fields(cls):
            assert f.name not in out, f"engine option {f.name} is declared twice"
            out[f.name] = section
    return out


def build_engine_config(model: str, **options: Any) -> EngineConfig:
    """EngineConfig from flat keyword options (cache and scheduler fields go to their sections);
    an unknown option is an InvalidRequestError naming it."""
    where = engine_option_names()
    unknown = sorted(set(options) - set(where))
    if unknown:
        raise InvalidRequestError(unknown[0], f"unknown engine option (known: {', '.join(sorted(where))})")
    parts: dict[str, dict[str, Any]] = {"": {}, **{section: {} for section in ENGINE_SECTIONS}}
    for name, value in options.items():
        parts[where[name]][name] = value
    sections = {section: cls(**parts[section]) for section, cls in ENGINE_SECTIONS.items()}
    return EngineConfig(model=model, **sections, **parts[""])
