"""Configuration: frozen dataclasses built once at the edge and passed down.

ModelConfig describes a model (inference/models/hf_config.py reads it from a Hugging Face config.json:
the families live there); EngineConfig says how the engine runs. Values found at run time (KV
blocks, graph batch sizes, sleep state) live in state objects, never here. Plain dataclasses: this
module imports nothing of the engine but inference.core.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from inference.core import InvalidRequestError, OnSync


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
    # Mixture of experts (docs/moe.md); num_experts 0: a dense model. Each MoE layer routes a token to
    # num_experts_per_tok of num_experts experts of width moe_intermediate_size; the layers listed in
    # dense_layers keep a dense MLP of width intermediate_size.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the chosen experts' softmax weights to sum to 1
    dense_layers: tuple[int, ...] = ()

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_layers

    @property
    def num_moe_layers(self) -> int:
        """The layers with a router: the middle dimension of a routing array (0: a dense model)."""
        return sum(map(self.is_moe_layer, range(self.num_layers)))


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
    # device (docs/dev/design.md, "Async scheduling"). None: on for CUDA; True: also on CPU (tests); False: off.
    # With a draft model too: its plain steps overlap, the draft follows them; the speculative ones run
    # synchronously (docs/dev/design.md, "Speculation on the tail").
    async_scheduling: bool | None = None
    # Speculative decoding on the tail only: decodes get draft tokens while at most this many
    # decodes run; a fuller batch decodes plainly (the draft only mirrors its tokens into its cache),
    # because verifying k + 1 rows per sequence pays off while a step is bound by reading the weights,
    # not once the batch fills the device. 0: speculate at every batch size. 16: the 7B rollout with a
    # draft ran faster at 16 than at 64 (the figures: docs/dev/benchmark-log.md).
    spec_max_batch: int = 16

    def overlaps_steps(self, device_type: str) -> bool:
        """async_scheduling decided for a device type (see the field): every TP rank decides the same."""
        return self.async_scheduling if self.async_scheduling is not None else device_type == "cuda"


LOAD_FORMATS = ("auto", "dummy")  # EngineConfig.load_format
QUANTIZATIONS = ("none", "fp8")  # EngineConfig.quantization (docs/fp8.md)


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
    lora: str | None = None  # a PEFT LoRA adapter directory, served unmerged on the target (docs/sync-modes.md)
    draft_lora: str | None = None  # the same for the draft model
    # Batch-invariant mode (docs/invariance.md): a request's tokens and logprobs have the same bits
    # whatever runs beside it (batch, prefill or decode, prefix hits, chunking, preemption, a draft).
    # Off by default: it costs more than 5% of the default's time at batch 1 (docs/invariance.md, "Cost";
    # scripts/bench/invariance.py measures it).
    batch_invariant: bool = False
    # The mode's own draft (inference/speculative/self_draft.py): without a draft_model, the target on the
    # default mode's kernels proposes num_speculative_tokens tokens and the mode's forward verifies them
    # by exact match, so small decode batches pay the mode's kernels once per k + 1 tokens. None: on CUDA
    # in the mode; True / False: on / off (True needs batch_invariant and no draft_model).
    self_draft: bool | None = None
    # What a request in flight does when a weight sync goes live, unless it says (core.SyncPolicy):
    # "recompute" (its KV recomputed under the new weights), "keep" (its KV kept) or "abort" (restarted
    # from its prompt). docs/dev/design.md, "Syncs during generation".
    on_sync: OnSync = "recompute"
    # Weights of the attention and MLP linears (docs/fp8.md): "none" (the model dtype) or "fp8" (e4m3 with
    # an fp32 scale per output row, quantized at load and as each synced tensor lands; the memory saved
    # goes to the KV cache). draft_quantization: the draft's; None follows `quantization`.
    quantization: str = "none"
    draft_quantization: str | None = None

    def __post_init__(self) -> None:
        if self.self_draft and not self.batch_invariant:
            raise InvalidRequestError("self_draft", "needs batch_invariant: outside the mode the target's own "
                                                    "kernels would only propose what the target computes")
        if self.self_draft and self.draft_model:
            raise InvalidRequestError("self_draft", f"a draft_model ({self.draft_model}) drafts already")
        for name in ("quantization", "draft_quantization"):
            value = getattr(self, name)
            if value not in QUANTIZATIONS and not (value is None and name == "draft_quantization"):
                raise InvalidRequestError(name, f"{value!r} is not one of {', '.join(QUANTIZATIONS)}")

    def quantization_of(self, which: str) -> str:
        """The quantization of the "target" or the "draft" model."""
        if which == "draft" and self.draft_quantization is not None:
            return self.draft_quantization
        return self.quantization


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
