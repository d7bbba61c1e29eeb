"""The batch-invariant mode on every path that ships (docs/invariance.md, "What the mode covers"), on CPU.

For each feature (the dense families beside qwen2: llama, qwen3's q/k norms, mistral's sliding window; FP8
weights; a LoRA adapter served unmerged, on the draft too; the two MoE families; penalties; stop strings,
stop token ids and end-of-sequence; n samples with a max_tokens each; min-p and processed logprobs),
greedy and seeded rows give the same tokens, logprobs, top logprobs and finish reasons, bit for bit,
alone and: in one batch and in calls of other sizes, shuffled, after a prefix-cache hit, preempted with
chunked prefill, with async scheduling, beside a draft model (a row with penalties decodes a token a step
while the others speculate), and with the mode's own draft (the target on the default kernels).
tests/helpers_invariance.py holds the cases; syncs in flight and TP 2 have their own files
(test_batch_invariant_sync.py, test_batch_invariant_tp.py). A `cuda` test runs every feature's cases on
the GPU paths.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from inference.core import FinishReason, SamplingParams
from inference.engine.llm import LLM
from inference.models.tiny import first_layers, make_tiny_model
from inference.text.tokenizer import Tokenizer
from tests.helpers_invariance import (
    CPU,
    MODES,
    NEW,
    SELF_DRAFT,
    Result,
    alone,
    base_params,
    batched,
    drafted,
    make_prompts,
    preempted,
    prefix_cached,
    run,
    self_drafted,
    shuffled,
    tight_options,
)

pytestmark = pytest.mark.slow
DIMS = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)
LORA_TARGETS = ("q_proj", "v_proj", "o_proj", "gate_proj", "down_proj")


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread: None) -> None:
    """the conftest fixture, for every test of this module (the mode's promise is per thread count)"""


def write_adapter(model_dir: Path, out: Path, rank: int = 4) -> Path:
    """A PEFT LoRA adapter directory for the tiny model at model_dir, with B nonzero (PEFT starts it
    at zero, which would make the adapter a no-op)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    hidden, inter, heads, kv, hd = (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"],
                                    cfg["num_key_value_heads"], cfg["head_dim"])
    dims = {"q_proj": (hidden, heads * hd), "v_proj": (hidden, kv * hd), "o_proj": (heads * hd, hidden),
            "gate_proj": (hidden, inter), "down_proj": (inter, hidden)}
    g = torch.Generator().manual_seed(7)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for module, (fan_in, fan_out) in dims.items():
            where = "mlp" if module in ("gate_proj", "down_proj") else "self_attn"
            name = f"base_model.model.model.layers.{layer}.{where}.{module}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) / fan_in ** 0.5
            tensors[f"{name}.lora_B.weight"] = 0.05 * torch.randn(fan_out, rank, generator=g)
    out.mkdir()
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                         "target_modules": list(LORA_TARGETS), "bias": "none"}))
    return out


@dataclass(frozen=True)
class Feature:
    """One path of the engine: the model family it runs on, its engine options (`draft_options` too
    where a draft joins), what it adds to each prompt's params (`extra(mode, i, stops)`)."""

    name: str
    family: str = "qwen2"
    options: Callable[[dict[str, Path]], dict[str, Any]] = lambda dirs: {}
    draft_options: Callable[[dict[str, Path]], dict[str, Any]] = lambda dirs: {}
    extra: Callable[[str, int, dict], dict[str, Any]] = lambda mode, i, stops: {}
    samples: int = 1
    # a draft model's proposals are kept in some rows (False: too few rows speculate to count on one)
    draft_kept: bool = True


def _penalties(mode: str, i: int, stops: dict) -> dict[str, Any]:
    """Three kinds of rows in one batch: every penalty, repetition alone, none."""
    return [{"repetition_penalty": 1.3, "frequency_penalty": 0.4, "presence_penalty": 0.3},
            {"repetition_penalty": 0.8}, {}][i % 3]


def _stops(mode: str, i: int, stops: dict) -> dict[str, Any]:
    """The module's stop strings and stop token ids, with the end-of-sequence tokens live too."""
    return {**stops[mode][i], "ignore_eos": False}


def _samples(mode: str, i: int, stops: dict) -> dict[str, Any]:
    """Three samples of each prompt, each with a max_tokens of its own (the group's order varies)."""
    return {"n": 3, "sample_max_tokens": [(NEW, 5, 9), (4, NEW, 1), (7, 7, NEW)][i % 3]}


def _filters(mode: str, i: int, stops: dict) -> dict[str, Any]:
    """min-p on the sampled rows, and the logprobs of the distribution sampled from."""
    return {"logprobs_mode": "processed", **({"min_p": 0.05} if mode == "seeded" else {})}


FEATURES = [
    Feature("llama", family="llama"),
    Feature("qwen3", family="qwen3"),  # q/k norms
    Feature("mistral_window", family="mistral"),  # a sliding window shorter than the prompts
    Feature("fp8", options=lambda dirs: {"quantization": "fp8"}),  # the draft follows: fp8 too
    Feature("lora", options=lambda dirs: {"lora": str(dirs["adapter"])},
            draft_options=lambda dirs: {"draft_lora": str(dirs["draft-adapter"])}),
    Feature("qwen3_moe", family="qwen3_moe"),
    Feature("mixtral", family="mixtral"),
    Feature("moe_routing", family="qwen3_moe", extra=lambda mode, i, stops: {"return_routing": True}),
    # rows with penalties decode one token a step: 2 of 8 speculate, and the 1-layer draft may miss them all
    Feature("penalties", extra=_penalties, draft_kept=False),
    Feature("stop_strings", extra=_stops),
    Feature("sample_max_tokens", extra=_samples, samples=3),
    Feature("filters", extra=_filters),
]
WINDOW = 8


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("invariant-paths")
    out = {}
    for family in ("qwen2", "llama", "qwen3", "mistral", "qwen3_moe", "mixtral"):
        target = make_tiny_model(root / family, family=family, seed=3, **DIMS)
        if family == "mistral":
            cfg = json.loads((target / "config.json").read_text())
            (target / "config.json").write_text(json.dumps({**cfg, "sliding_window": WINDOW}))
        out[family], out[f"{family}-draft"] = target, first_layers(target, root / f"{family}-draft", 1)
    out["adapter"] = write_adapter(out["qwen2"], root / "adapter")
    out["draft-adapter"] = write_adapter(out["qwen2-draft"], root / "draft-adapter")
    return out


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts()


@pytest.fixture(scope="module")
def plain(dirs: dict[str, Path], prompts: list[list[int]]) -> dict[str, dict[int, Result]]:
    """Per mode, each prompt alone on the qwen2 model with no feature on."""
    llm = LLM(dirs["qwen2"], batch_invariant=True, **CPU)
    return {mode: alone(llm, prompts, base_params, mode) for mode in MODES}


@pytest.fixture(scope="module")
def stops(dirs: dict[str, Path], plain: dict[str, dict[int, Result]]) -> dict[str, list[dict[str, Any]]]:
    """Per mode and prompt: a stop string cut from the middle of the prompt's plain completion (so it
    fires), a stop token id from it, both, or none."""
    tokenizer = Tokenizer.from_dir(str(dirs["qwen2"]))
    assert tokenizer is not None
    out: dict[str, list[dict[str, Any]]] = {}
    for mode, results in plain.items():
        out[mode] = []
        for i, ((tokens, *_),) in sorted(results.items()):
            text, kind = tokenizer.decode(tokens[4:6]), i % 4
            out[mode].append({"stop": [text] if kind in (0, 2) and text.strip() else [],
                              "stop_token_ids": [tokens[8]] if kind in (1, 2) else []})
    return out


class Subject:
    """A feature's engines (main, tight, beside a draft), built when first asked for, and its alone results."""

    def __init__(self, feature: Feature, dirs: dict[str, Path], prompts: list[list[int]], stops: dict,
                 where: dict[str, Any] = CPU) -> None:
        self.feature, self.dirs, self.prompts, self.stops = feature, dirs, prompts, stops
        self.options = {**where, **feature.options(dirs)}
        self._engines: dict[str, LLM] = {}
        self._alone: dict[str, dict[int, Result]] = {}

    def params(self, mode: str, i: int) -> SamplingParams:
        return base_params(mode, i, **self.feature.extra(mode, i, self.stops))

    def engine(self, kind: str = "main") -> LLM:
        if kind not in self._engines:
            options = dict(self.options)
            if kind == "tight":
                options.update(tight_options(self.engine(), self.prompts, self.feature.samples))
            elif kind == "spec":
                options.update(draft_model=str(self.dirs[f"{self.feature.family}-draft"]), num_speculative_tokens=3,
                               **self.feature.draft_options(self.dirs))
            elif kind == "async":
                options.update(async_scheduling=True)
            elif kind == "self":
                options.update(SELF_DRAFT)
            self._engines[kind] = LLM(self.dirs[self.feature.family], batch_invariant=True, **options)
        return self._engines[kind]

    def alone(self, mode: str) -> dict[int, Result]:
        if mode not in self._alone:
            self._alone[mode] = alone(self.engine(), self.prompts, self.params, mode)
        return self._alone[mode]


@pytest.fixture(scope="module", params=FEATURES, ids=lambda f: f.name)
def subject(request: pytest.FixtureRequest, dirs: dict[str, Path], prompts: list[list[int]],
            stops: dict) -> Subject:
    return Subject(request.param, dirs, prompts, stops)


@pytest.mark.parametrize("mode", MODES)
def test_the_feature_is_on(subject: Subject, plain: dict[str, dict[int, Result]], mode: str) -> None:
    """What each feature does shows in the alone results, so the cases below hold something."""
    got, base, name = subject.alone(mode), plain[mode], subject.feature.name
    if name in ("fp8", "lora") or (name, mode) == ("filters", "seeded"):  # other weights; processed logprobs
        assert all(got[i] != base[i] for i in got)
    elif name == "penalties":  # rows without a penalty are never touched
        assert [got[i] != base[i] for i in got] == [i % 3 != 2 for i in got]
    elif name == "stop_strings":
        reasons = [(c[3], type(c[4])) for r in got.values() for c in r]
        assert {(FinishReason.STOP, str), (FinishReason.STOP, int)} <= set(reasons), reasons
    elif name == "mistral_window":
        assert subject.engine().model_config.sliding_window == WINDOW < max(map(len, subject.prompts))
    elif name == "moe_routing":  # a row per computed token (prompt and completion but the last), 2 layers, k=2
        assert all(c[5] is not None and c[5].startswith(repr((len(subject.prompts[i]) + len(c[0]) - 1, 2, 2)).encode())
                   for i in got for c in got[i]), [c[5][:16] for i in got for c in got[i] if c[5]]
    elif name == "sample_max_tokens":
        assert all([len(c[0]) for c in got[i]] == list(subject.params(mode, i).sample_max_tokens) for i in got)


@pytest.mark.parametrize("mode", MODES)
def test_batches_of_every_size_change_no_bit(subject: Subject, mode: str) -> None:
    for got in batched(subject.engine(), subject.prompts, subject.params, mode):
        assert got == subject.alone(mode)


@pytest.mark.parametrize("mode", MODES)
def test_a_shuffled_batch_changes_no_bit(subject: Subject, mode: str) -> None:
    assert shuffled(subject.engine(), subject.prompts, subject.params, mode) == subject.alone(mode)


@pytest.mark.parametrize("mode", MODES)
def test_prefix_cache_hits_change_no_bit(subject: Subject, mode: str) -> None:
    got = prefix_cached(subject.engine(), subject.prompts, subject.params, mode)
    assert got == {i: subject.alone(mode)[i] for i in got}


@pytest.mark.parametrize("mode", MODES)
def test_preemption_and_chunked_prefill_change_no_bit(subject: Subject, mode: str) -> None:
    assert preempted(subject.engine("tight"), subject.prompts, subject.params, mode) == subject.alone(mode)


@pytest.mark.parametrize("mode", MODES)
def test_async_scheduling_changes_no_bit(subject: Subject, mode: str) -> None:
    """The GPU's default: admissions and the batch's shrinking come a step later."""
    got = run(subject.engine("async"), subject.prompts, subject.params, mode, [list(range(len(subject.prompts)))])
    assert got == subject.alone(mode)


@pytest.mark.parametrize("mode", MODES)
def test_a_draft_model_changes_no_bit(subject: Subject, mode: str) -> None:
    got = drafted(subject.engine("spec"), subject.prompts, subject.params, mode, subject.feature.draft_kept)
    assert got == subject.alone(mode)


@pytest.mark.parametrize("mode", MODES)
def test_the_modes_own_draft_changes_no_bit(subject: Subject, mode: str) -> None:
    """The target on the default kernels proposes, the mode's forward verifies: the mode's bits."""
    assert self_drafted(subject.engine("self"), subject.prompts, subject.params, mode) == subject.alone(mode)


@pytest.mark.cuda
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("feature", FEATURES, ids=lambda f: f.name)
def test_on_the_gpu_every_feature_keeps_a_prompts_bits(feature: Feature, dirs: dict[str, Path],
                                                      prompts: list[list[int]], stops: dict, mode: str) -> None:
    """The mode's GPU paths (Triton GEMM, attention and grouped GEMMs, CUDA graphs, async scheduling, bf16)
    with each feature on: calls of every size, shuffled, prefix-cache hits, preemption, a draft model and the
    mode's own draft."""
    subject = Subject(feature, dirs, prompts, stops, where={**CPU, "device": "cuda", "dtype": "bfloat16",
                                                            "kv_cache_bytes": 64 << 20})
    lone = subject.alone(mode)
    for got in batched(subject.engine(), prompts, subject.params, mode):
        assert got == lone
    assert shuffled(subject.engine(), prompts, subject.params, mode) == lone
    hits = prefix_cached(subject.engine(), prompts, subject.params, mode)
    assert hits == {i: lone[i] for i in hits}
    assert preempted(subject.engine("tight"), prompts, subject.params, mode) == lone
    assert drafted(subject.engine("spec"), prompts, subject.params, mode, feature.draft_kept) == lone
    assert self_drafted(subject.engine("self"), prompts, subject.params, mode) == lone
