"""One rank of the inference worker, with the seed's lifecycle.

init_device -> load_model -> determine_available_memory -> initialize_kv_cache -> warm_up ->
execute_model* -> shutdown, with sleep/wake in between; the rules follow the seed (vLLM's GPU worker).
The engine's half of weight syncs is one component the Worker owns, `self.weights`
(inference/weights/updater.py): it alone knows each model's weight version, torn state and weights
arena, and callers run a sync through it directly.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Literal, overload

import torch

from checksum.dtypes import UnknownDtypeError, dtype_from_name
from inference.config import EngineConfig, ModelConfig
from inference.core import InvalidRequestError, StateError
from inference.layers.attention import AttentionBackend, get_attention_backend
from inference.layers.attention_invariant import batch_invariant_backend
from inference.memory.arenas import DEFAULT_ALIGN, KV_TAG, round_up
from inference.memory.sleep import MemoryManager, TransitionStats
from inference.models import build_model
from inference.models.hf_config import read_model_config
from inference.models.loader import init_dummy_weights, load_weights
from inference.models.lora_adapter import attach_adapter, load_adapter, read_adapter
from inference.parallel import TPInfo, resolve_device
from inference.runner.runner import InFlightStep, ModelRunner
from inference.sched.scheduler import ScheduledBatch, StepResult
from inference.speculative.decoder import SpecDecoder
from inference.speculative.self_draft import SelfDraft
from inference.weights.updater import WeightUpdater

log = logging.getLogger(__name__)

CPU_DEFAULT_KV_BYTES = 128 << 20
# max_num_seqs "auto": a power of two in [MIN, MAX] (see auto_max_num_seqs)
AUTO_MIN_NUM_SEQS = 256
AUTO_MAX_NUM_SEQS = 1024
AUTO_TOKENS_PER_SEQ = 2048
# decode graphs are captured up to this batch; larger decode steps run eagerly
MAX_GRAPH_BATCH = 1024


def resolve_dtype(name: str, device: torch.device, model_config: ModelConfig | None = None) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name == "model" and model_config is not None:
        name = model_config.dtype
    try:
        return dtype_from_name(name)
    except UnknownDtypeError as e:
        raise ValueError(f"dtype: unknown dtype {name!r}") from e


def auto_max_num_seqs(kv_tokens: int, max_model_len: int) -> int:
    """The largest power of two in [AUTO_MIN_NUM_SEQS, AUTO_MAX_NUM_SEQS] at which every running
    sequence could still hold min(max_model_len, max(2048, max_model_len // 4)) tokens of KV.

    Why: the cap only matters when the cache can feed it. A batch the cache holds at a long
    completion's length (2048 tokens, or a quarter of a long context) runs without preemption, so
    the cap grows with the cache (1024 for a 0.5B model on an H200, 512 for a 7B). It never goes
    below 256 (the old fixed default): a small cache already limits admission block by block, and
    a lower cap would only cut batching that worked before. 1024 bounds the graph capture (its time
    and the logits buffer of the largest graph) and the per-step host work.
    """
    per_seq = min(max_model_len, max(AUTO_TOKENS_PER_SEQ, max_model_len // 4))
    n = AUTO_MAX_NUM_SEQS
    while n > AUTO_MIN_NUM_SEQS and n * per_seq > kv_tokens:
        n //= 2
    return n


def resolve_max_num_seqs(requested: int | None, kv_tokens: int, max_model_len: int) -> int:
    """An explicit max_num_seqs (>= 1) as given; None or 0: auto_max_num_seqs."""
    if requested is not None and (not isinstance(requested, int) or isinstance(requested, bool) or requested < 0):
        raise InvalidRequestError("scheduler.max_num_seqs",
                                  f"must be an integer >= 1, or None or 0 for auto; got {requested!r}")
    return requested or auto_max_num_seqs(kv_tokens, max_model_len)


def _nccl_group(tp: TPInfo) -> bool:
    try:
        import torch.distributed as dist

        return dist.get_backend(tp.group) == "nccl"
    except (RuntimeError, ValueError):
        return False


class Worker:
    def __init__(self, config: EngineConfig, tp: TPInfo | None = None, dp_rank: int = 0, pp_rank: int = 0) -> None:
        self.config = config
        self.tp = tp or TPInfo()
        self.dp_rank = dp_rank
        self.pp_rank = pp_rank
        self.device: torch.device | None = None
        self.dtype: torch.dtype | None = None
        self.model_config: ModelConfig | None = None
        self.runner: ModelRunner | None = None
        self.spec: SpecDecoder | None = None  # num_speculative_tokens > 0 with a draft model or a SelfDraft
        self.num_blocks = 0
        self.max_num_seqs = 0  # config.scheduler.max_num_seqs resolved at initialize_kv_cache
        # "target" and, with config.draft_model, "draft": the models a weight sync can address
        self.models: dict[str, torch.nn.Module] = {}
        self.model_configs: dict[str, ModelConfig] = {}
        self.memory: MemoryManager | None = None
        self.weights = WeightUpdater(self)  # the weights' version, torn state, arenas and update sessions
        self.max_model_len = 0
        self.attention_backend = "reference"

    # ---- lifecycle ------------------------------------------------------------------------
    def init_device(self) -> None:
        self.device = resolve_device(self.config.device)
        if self.device.type == "cuda":
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            self.device = torch.device("cuda", index)
            torch.cuda.set_device(self.device)
        torch.manual_seed(self.config.seed)

    def load_model(self) -> None:
        assert self.device is not None, "init_device first"
        self.model_config = read_model_config(self.config.model)
        self.dtype = resolve_dtype(self.config.dtype, self.device, self.model_config)
        mc = self.model_config
        self.max_model_len = min(self.config.scheduler.max_model_len or mc.max_position_embeddings,
                                 mc.max_position_embeddings)
        self.attention_backend = self._pick_attention_backend()
        self.memory = MemoryManager(self.device)
        model = self._load("target", self.config.model)
        if self.config.draft_model:
            self._load("draft", self.config.draft_model)
        self.runner = ModelRunner(model, self.model_config, self.tp, self.device, self.dtype, self.config.seed,
                                  batch_invariant=self.config.batch_invariant,
                                  max_step_tokens=self.config.scheduler.max_num_batched_tokens)
        if self._speculates():
            draft = self.models["draft"] if "draft" in self.models else SelfDraft(model, self._default_backend())
            self.spec = SpecDecoder(self.runner, draft, self.config.num_speculative_tokens)
        log.debug("rank %s loaded %s (%s, %s)", self.rank_key, self.config.model, self.dtype, self.device)

    def _speculates(self) -> bool:
        """Whether this rank runs speculative decoding: k > 0 and a draft model, or the batch-invariant
        mode's SelfDraft."""
        return self.config.num_speculative_tokens > 0 and (bool(self.config.draft_model) or self._self_drafts())

    def _self_drafts(self) -> bool:
        """EngineConfig.self_draft resolved: the mode without a draft model, on CUDA unless told."""
        c = self.config
        if not c.batch_invariant or c.draft_model:
            return False
        assert self.device is not None, "init_device first"
        return c.self_draft if c.self_draft is not None else self.device.type == "cuda"

    def _default_backend(self) -> AttentionBackend:
        """The attention backend of the default mode, for SelfDraft: its launches hold one row of a
        sequence (a proposal step, or the last token before one)."""
        backend = get_attention_backend(self.attention_backend)
        return backend.for_decode_rows(1) if hasattr(backend, "for_decode_rows") else backend

    def _pick_attention_backend(self) -> str:
        name = self.config.attention_backend
        if name != "auto":
            return name
        assert self.device is not None
        return "triton" if self.device.type == "cuda" and importlib.util.find_spec("triton") else "reference"

    def _load(self, which: str, model_dir: str) -> torch.nn.Module:
        assert self.dtype is not None and self.device is not None
        config = read_model_config(model_dir)
        backend = get_attention_backend(self.attention_backend)
        if which == "target" and not self._speculates() and hasattr(backend, "for_decode_rows"):
            # Without a draft, decode launches hold one row per sequence: no row can own another's keys.
            backend = backend.for_decode_rows(1)
        if self.config.batch_invariant:  # docs/invariance.md
            backend = batch_invariant_backend(backend)
        model = build_model(config, self.tp, self.dtype, self.device, backend, self.config.batch_invariant,
                            self.config.quantization_of(which))
        # Parameters become views into a tagged arena first, so the loader writes straight into it.
        assert self.memory is not None
        tag = self.weights.arena_tag(which)
        self.memory.adopt_module(tag, model)
        if self.config.load_format == "dummy":
            init_dummy_weights(model, self.config.seed)
        else:
            load_weights(model, Path(model_dir))
        self.memory.mark_loaded(tag)
        adapter = self.config.lora if which == "target" else self.config.draft_lora
        if adapter:  # outside the arena: the adapter stays at every sleep level
            attach_adapter(model, config, read_adapter(adapter), invariant=self.config.batch_invariant)
            load_adapter(model, adapter)
        self.models[which] = model
        self.model_configs[which] = config
        return model

    def determine_available_memory(self) -> int:
        """Bytes this rank may give to the KV cache."""
        cache = self.config.cache
        if cache.kv_cache_bytes is not None:
            return cache.kv_cache_bytes
        if self.device is None or self.device.type != "cuda":
            return CPU_DEFAULT_KV_BYTES
        return self._profile_kv_budget(cache.gpu_memory_utilization)

    def _profile_kv_budget(self, utilization: float) -> int:
        """total * utilization minus what is in use now and the peak of a full-budget forward."""
        assert self.runner is not None
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info(self.device)
        allocated = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self._profile_run()
        peak_extra = torch.cuda.max_memory_allocated(self.device) - allocated
        budget = int(total * utilization) - (total - free) - peak_extra
        if budget <= 0:
            raise StateError(f"gpu_memory_utilization={utilization} leaves no room for the KV cache "
                             f"(free {free / 2**30:.1f} GiB of {total / 2**30:.1f} GiB)")
        return budget

    def _profile_run(self) -> None:
        """A forward over max_num_batched_tokens tokens with a throwaway cache, for the activation peak.

        The tokens are split into sequences no longer than the model's positions allow.
        """
        from inference.core import SamplingParams
        from inference.sched.sequence import Sequence

        assert self.runner is not None and self.model_config is not None
        bs = self.config.cache.block_size
        total = self.config.scheduler.max_num_batched_tokens
        longest = min(total, self.config.scheduler.max_model_len or self.model_config.max_position_embeddings,
                      self.model_config.max_position_embeddings)
        lengths = [min(longest, total - start) for start in range(0, total, longest)]
        blocks = sum(-(-n // bs) for n in lengths)
        kv = torch.empty(self.runner.kv_shape(blocks, bs), dtype=self.dtype, device=self.device)
        self.runner.bind_kv_cache(kv, bs)
        seqs, next_block = [], 0
        for n in lengths:
            seq = Sequence("profile", 0, [0] * n, SamplingParams(temperature=0.0))
            seq.block_table = list(range(next_block, next_block + -(-n // bs)))
            next_block += len(seq.block_table)
            seqs.append(seq)
        self.runner.execute(ScheduledBatch(seqs, lengths))
        del kv
        self.runner.kv_cache = None
        torch.cuda.synchronize()
        torch.cuda.empty_cache()

    @property
    def num_speculative_tokens(self) -> int:
        """Draft tokens proposed per decode step; 0 when speculative decoding is off."""
        return self.spec.k if self.spec is not None else 0

    def kv_bytes_per_block(self, block_size: int) -> int:
        """Bytes of one KV block: the target's, plus the draft's when speculating (the draft's cache
        uses the same block ids, so every block has both)."""
        assert self.runner is not None and self.dtype is not None
        total = round_up(self.runner.kv_bytes_per_block(block_size), DEFAULT_ALIGN)
        if self.spec is not None and not self.spec.shares_kv:
            total += round_up(self.models["draft"].kv_cache_spec().bytes_per_block(block_size, self.dtype),
                              DEFAULT_ALIGN)
        return total

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """One "kv_cache" arena holds the target's KV tensor and, when speculating, the draft's: both
        are dropped on sleep and mapped again on wake together. Resolves max_num_seqs from the
        blocks (an explicit value wins)."""
        assert self.runner is not None and self.dtype is not None
        if num_blocks < 1:
            raise StateError("the KV cache budget holds no block: raise kv_cache_bytes or gpu_memory_utilization")
        assert self.memory is not None
        bs = self.config.cache.block_size
        self.max_num_seqs = resolve_max_num_seqs(self.config.scheduler.max_num_seqs, num_blocks * bs,
                                                 self.max_model_len)
        arena = self.memory.create_arena(KV_TAG, num_blocks * self.kv_bytes_per_block(bs))
        self.runner.bind_kv_cache(arena.alloc(self.runner.kv_shape(num_blocks, bs), self.dtype), bs)
        if self.spec is not None and self.spec.shares_kv:
            self.spec.bind_draft_kv(None, bs)
        elif self.spec is not None:
            draft_shape = self.models["draft"].kv_cache_spec().shape(num_blocks, bs)
            self.spec.bind_draft_kv(arena.alloc(draft_shape, self.dtype), bs)
        self.num_blocks = num_blocks

    def warm_up(self) -> None:
        """Capture the decode CUDA graphs (unless enforce_eager, on CPU, or with an attention backend
        that reads host values), with a draft also the draft's, up to the resolved max_num_seqs
        (at most MAX_GRAPH_BATCH). The eager path needs nothing. On CUDA the weight-audit digest kernel
        is compiled first, so the first sync does not pay it (inference/weights/audit.py)."""
        assert self.runner is not None and self.device is not None
        self.weights.warm_up()
        if self.config.enforce_eager or self.device.type != "cuda" or self.attention_backend == "reference":
            return
        if self.tp.size > 1 and self.device.type == "cuda" and not _nccl_group(self.tp):
            return  # a graph can only hold NCCL collectives
        assert self.max_num_seqs > 0, "initialize_kv_cache first"
        max_batch = min(self.max_num_seqs, MAX_GRAPH_BATCH)
        if self.spec is None:
            self.runner.capture_graphs(max_batch, self.max_model_len)
            return
        # speculation verifies as decode rows (k + 1 per sequence) and steps the draft one token at a time
        # (the rows of a speculating step: the target's verify ladder, and the draft's sizes with logits)
        verify_rows = self.spec.verify_rows(max_batch, self.config.scheduler.spec_max_batch)
        self.runner.capture_graphs(max_batch, self.max_model_len, verify_rows, self.spec.k + 1)
        # plain steps followed on graphs (a draft sharing the target's KV follows nothing)
        follows = self.config.scheduler.overlaps_steps(self.device.type) and not self.spec.shares_kv
        sizes = self.spec.draft_sizes(max_batch, verify_rows, follows)
        self.spec.capture_graphs(sizes, self.max_model_len, logits_max=verify_rows,
                                 follow_batch=max_batch if follows else 0)

    @overload
    def execute_model(self, batch: ScheduledBatch, overlap: Literal[False] = False) -> list[StepResult]: ...

    @overload
    def execute_model(self, batch: ScheduledBatch, overlap: Literal[True]) -> InFlightStep: ...

    def execute_model(self, batch: ScheduledBatch, overlap: bool = False) -> list[StepResult] | InFlightStep:
        """Per scheduled sequence: its sampled result, None (mid-prefill), or with speculative
        decoding a list (the accepted run) for rows the scheduler gave a lookahead.

        overlap=True (async scheduling): launch the step and return at once; its InFlightStep.results()
        waits for it. Placeholder input ids are resolved on the device from the step launched before
        (ModelRunner.launch). With a draft such a step carries no draft tokens and the draft follows it
        (its KV of the same tokens); speculative steps run synchronously."""
        assert self.runner is not None and self.memory is not None, "load_model first"
        self.memory.check_ready()  # never touch a released arena: that is an illegal address on CUDA
        if overlap:
            assert not any(batch.num_lookahead), "speculative steps run synchronously"
            return self.runner.launch(batch, None if self.spec is None or self.spec.shares_kv else self.spec)
        if self.spec is not None:
            return self.spec.execute(batch)
        assert not any(batch.num_lookahead), "lookahead scheduled without a draft model"
        return self.runner.execute(batch)

    # ---- sleep and wake -------------------------------------------------------------------
    def sleep(self, level: int = 1) -> TransitionStats:
        """Release the KV cache and the weights (level 1 keeps a host copy, level 2 does not).

        The caller has stopped every step that could touch the arenas (LLM.sleep does).
        """
        assert self.memory is not None, "load_model first"
        self.weights.settle_digest()  # an overlapped audit digest may still read the weights
        return self.memory.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> TransitionStats:
        """Map "weights" (target and draft) and/or "kv_cache" again at the same addresses."""
        assert self.memory is not None, "load_model first"
        return self.memory.wake_up(tags)

    def check_ready(self) -> None:
        """StateError saying why no step may run: not loaded, an arena asleep or holding no valid
        weights (MemoryManager), or a model torn, reset or being written (the weights component)."""
        if self.memory is None:
            raise StateError(f"rank {self.rank_key}: model not loaded")
        self.memory.check_ready()
        self.weights.check_servable()

    def is_ready(self) -> bool:
        """Awake everywhere, holding valid weights, every model servable: a step may run."""
        try:
            self.check_ready()
        except StateError:
            return False
        return True

    def check_health(self) -> None:
        if self.runner is None:
            raise StateError(f"rank {self.rank_key}: model not loaded")

    def shutdown(self) -> None:
        self.weights.close()
        self.runner = None
        self.spec = None
        self.models.clear()
        if self.memory is not None:
            self.memory.close()
            self.memory = None
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.empty_cache()

    @property
    def rank_key(self) -> str:
        return f"dp{self.dp_rank}:pp{self.pp_rank}:tp{self.tp.rank}"
