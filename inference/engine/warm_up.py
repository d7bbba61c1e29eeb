"""The start-up pass that compiles what rollouts run, so the first batch runs as fast as the second.

Triton compiles a kernel once per specialization: its constexprs (tiles our launches pick from the next
power of two of a sequence or row count, the sampler's chunks and flags) and the class of each integer
argument (1, a multiple of 16, other). Decode graphs compile their sizes at capture; everything else
compiles on first launch: prefill and mixed steps, the eager sampler (prefill rows, unseeded rows, top
logprobs), spec-decode's proposals and verification. `warm_up_engine` touches each class once:
- the engine over requests of every sequence-count class up to max_num_seqs (`batch_sizes`), each
  prefilled and decoded a few steps (past num_speculative_tokens with a draft, so it speculates);
- the sampler over every row-count class (`sampler_rows`) in every path (`SAMPLER_PATHS`).
It leaves no trace: no request, no prefix-cache entry, no count, the same unseeded noise afterwards.
The LLM runs it on CUDA only (on CPU the torch twins run: nothing compiles). Compiled kernels persist
in Triton's cache (`envs.kernel_cache_dir`), so a later start on the machine loads them instead.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import replace
from typing import Any, Protocol

import torch

from inference.config import EngineConfig, ModelConfig
from inference.core import SamplingParams
from inference.sample.batch import SamplingBatch
from inference.sample.sampler import row_chunks, sample, sample_pairs, target_programs


class LLM(Protocol):
    """What the pass uses of inference.engine.llm.LLM (which imports this module)."""

    config: EngineConfig
    model_config: ModelConfig
    worker: Any
    block_manager: Any
    spec_stats: Any
    step_log: Any
    max_model_len: int

    def add_request(self, prompt: list[int], params: SamplingParams | None = ...,
                    request_id: str | None = ...) -> str: ...

    def step(self) -> list[Any]: ...

    def has_unfinished(self) -> bool: ...

# (name, params, seeded): one per path the eager sampler takes (flags of a batch pick its kernels)
SAMPLER_PATHS: tuple[tuple[str, SamplingParams, bool], ...] = (
    ("greedy", SamplingParams(temperature=0.0), True),
    ("seeded", SamplingParams(temperature=1.0), True),
    ("unseeded", SamplingParams(temperature=1.0), False),
    ("filtered", SamplingParams(temperature=0.7, top_k=50, top_p=0.9, min_p=0.05), True),
    ("processed", SamplingParams(temperature=0.7, top_p=0.9, logprobs_mode="processed"), True),
    ("top_logprobs", SamplingParams(temperature=1.0, logprobs=5), True),
    ("top_logprobs_processed", SamplingParams(temperature=0.7, top_k=50, logprobs=5, logprobs_mode="processed"),
     True),
    ("greedy_top_logprobs", SamplingParams(temperature=0.0, logprobs=5), True),
)
WARM_PROMPT_LEN = 3  # tokens per warm-up prompt beyond one block: every prefill ends in a partial block
WARM_DECODE_STEPS = 3


def representatives(limit: int, key: Callable[[int], Hashable]) -> tuple[int, ...]:
    """The smallest n in 1..limit of each distinct key(n): one count per compile class."""
    seen: dict[Hashable, int] = {}
    for n in range(1, limit + 1):
        seen.setdefault(key(n), n)
    return tuple(sorted(seen.values()))


def int_class(n: int) -> str:
    """How Triton specializes an integer argument: 1, a multiple of 16, or neither."""
    return "1" if n == 1 else "16" if n % 16 == 0 else "-"


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def batch_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """Sequence counts of a step, one per class: the attention's sequence tile (the next power of two,
    BLOCK_B) and the count's integer class; row counts of the linear kernels follow the same classes."""
    return representatives(max_num_seqs, lambda n: (int_class(n), next_pow2(n)))


def sampler_rows(max_rows: int, vocab_size: int, target_programs: int, invariant: bool) -> tuple[int, ...]:
    """Row counts of an eager sampling launch, one per class: the rows' integer class and the per-row
    chunking of the row statistics (it follows the row count unless invariant)."""
    def key(n: int) -> Hashable:
        return int_class(n), row_chunks(1 if invariant else n, vocab_size, target_programs)
    return representatives(max_rows, key)


def warm_up_engine(llm: LLM) -> float:
    """Run the pass on `llm` (built, with its KV cache and graphs); returns the seconds it took."""
    t0 = time.perf_counter()
    with _untraced(llm):
        _sampler_pass(llm)
        _engine_pass(llm)
    return time.perf_counter() - t0


def _engine_pass(llm: LLM) -> None:
    sizes = batch_sizes(llm.worker.max_num_seqs)
    vocab = llm.model_config.vocab_size
    bs = llm.config.cache.block_size
    k = llm.worker.num_speculative_tokens
    params = SamplingParams(temperature=1.0, seed=0, ignore_eos=True)
    for n in sizes:
        steps = WARM_DECODE_STEPS + (2 * k if n <= llm.config.scheduler.spec_max_batch else 0)
        length = min(bs + WARM_PROMPT_LEN, llm.max_model_len - steps)
        if length < 1:
            return
        sp = replace(params, max_tokens=steps)
        for i in range(n):
            prompt = [(7 * i + 13 * j + 1) % vocab for j in range(length)]
            llm.add_request(prompt, sp, request_id=f"warm-up-{n}-{i}")
        while llm.has_unfinished():
            llm.step()


def _sampler_pass(llm: LLM) -> None:
    runner = llm.worker.runner
    assert runner is not None
    max_rows = llm.worker.max_num_seqs
    vocab = llm.model_config.vocab_size
    device = runner.device
    invariant = runner.batch_invariant
    rows = sampler_rows(max_rows, vocab, target_programs(device), invariant)
    logits = _logits_buffer(llm, max_rows)
    out = torch.empty(max_rows, 2, dtype=torch.float64, device=device)
    for _, params, seeded in SAMPLER_PATHS:
        for n in rows:
            seeds = list(range(n)) if seeded else [None] * n
            sb = SamplingBatch.build([params] * n, seeds, [0] * n, vocab, device, invariant)
            if sb.num_top_logprobs:
                sample(logits[:n], sb, runner.generator)
            else:
                sample_pairs(logits[:n], sb, out[:n], runner.generator)


def _logits_buffer(llm: LLM, rows: int) -> torch.Tensor:
    """Logits to sample from: the largest decode graph's (no new memory) when it holds `rows`, else new."""
    runner = llm.worker.runner
    assert runner is not None
    graphs = runner.graphs
    if graphs is not None and graphs.sizes and graphs.sizes[-1] >= rows and graphs.sizes[-1] in graphs.outputs:
        out = graphs.outputs[graphs.sizes[-1]]
        if out.shape[-1] == llm.model_config.vocab_size:
            return out
    hidden = torch.zeros(rows, llm.model_config.hidden_size, dtype=runner.dtype, device=runner.device)
    with torch.inference_mode():
        return runner.model.compute_logits(hidden)


class _untraced:
    """Leaves the engine as the pass found it: the runner's count of sampling-row lists (the unseeded
    rows' noise follows it) and generator, the prefix cache, the step and speculation statistics."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm

    def __enter__(self) -> None:
        runner = self.llm.worker.runner
        assert runner is not None
        self.sampling = runner.sampling_state()
        self.step_log = self.llm.step_log
        self.llm.step_log = None

    def __exit__(self, *exc: object) -> None:
        llm = self.llm
        runner = llm.worker.runner
        assert runner is not None
        if exc[0] is None:
            assert not llm.has_unfinished(), "the warm-up left requests behind"
        runner.restore_sampling_state(self.sampling)
        llm.block_manager.reset_prefix_cache()
        llm.spec_stats = type(llm.spec_stats)()
        llm.step_log = self.step_log
