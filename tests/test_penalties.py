"""Presence, frequency and repetition penalties: the in-place op against a plain-Python reference, rows
without a penalty untouched bit for bit, a placeholder token (async scheduling) read from the step in
flight's sampled pairs, the engine's greedy completions against a plain-torch generation loop over the
transformers model with the same penalties, and async scheduling kept on with the same outputs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import inference.runner.runner as runner_module
from inference.core import InvalidRequestError, SamplingParams
from inference.engine.llm import LLM
from inference.models.tiny import first_layers
from inference.runner.pending_tokens import resolve_pending
from inference.sample.penalties import apply_penalties, penalized_rows
from inference.sched.sequence import placeholder
from tests.helpers_models import make_hf_checkpoint, random_prompts
from tests.test_async_schedule import assert_completions_equal


@dataclass
class _Seq:
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams


def reference_penalties(logits: torch.Tensor, prompt: list[int], completion: list[int],
                        params: SamplingParams) -> torch.Tensor:
    """One row [V], the definition spelled out token by token (vLLM's order: repetition, then the rest)."""
    x = logits.double().clone()
    for t in set(prompt) | set(completion):
        x[t] = x[t] / params.repetition_penalty if x[t] > 0 else x[t] * params.repetition_penalty
    for t in set(completion):
        x[t] -= params.frequency_penalty * completion.count(t) + params.presence_penalty
    return x


def test_apply_penalties_equals_the_reference_and_leaves_other_rows_alone() -> None:
    g = torch.Generator().manual_seed(0)
    vocab = 50
    logits = torch.randn(4, vocab, generator=g) * 3
    rows = [
        _Seq([1, 2, 3, 4, 2], 3, SamplingParams(repetition_penalty=1.7)),
        _Seq([5, 6, 7, 7, 7, 8], 2, SamplingParams()),  # no penalty: untouched
        _Seq([9, 10, 10, 11, 11, 11], 3, SamplingParams(frequency_penalty=0.5, presence_penalty=-1.25)),
        _Seq([12, 13, 13, 12, 40], 1, SamplingParams(repetition_penalty=0.6, frequency_penalty=-2.0,
                                                     presence_penalty=2.0)),
    ]
    assert penalized_rows(rows) == [0, 2, 3]
    out = logits.clone()
    apply_penalties(out, penalized_rows(rows), rows)
    assert torch.equal(out[1], logits[1])
    for i in (0, 2, 3):
        s = rows[i]
        ref = reference_penalties(logits[i], s.token_ids[:s.num_prompt_tokens], s.token_ids[s.num_prompt_tokens:],
                                  s.params)
        torch.testing.assert_close(out[i].double(), ref, rtol=1e-6, atol=1e-6)
    same = logits.clone()
    apply_penalties(same, [], rows)
    assert torch.equal(same, logits)


def test_a_placeholder_token_is_read_from_the_step_in_flight() -> None:
    """Async scheduling: a completion's last token is a placeholder for row r of the previous step's
    sampled pairs; the penalty counts the token found there, as if the host had read it."""
    g = torch.Generator().manual_seed(1)
    vocab = 50
    logits = torch.randn(2, vocab, generator=g) * 3
    params = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.75, presence_penalty=0.5)
    pairs = torch.tensor([[44.0, -0.1], [7.0, -0.2], [30.0, -0.3]], dtype=torch.float64)  # rows 0..2 sampled
    known = [_Seq([1, 2, 3, 7, 9, 7], 3, params), _Seq([4, 5, 6, 30, 44], 2, params)]
    pending = [_Seq([1, 2, 3, 7, 9, placeholder(1)], 3, params), _Seq([4, 5, 6, 30, placeholder(0)], 2, params)]
    want, got = logits.clone(), logits.clone()
    apply_penalties(want, [0, 1], known)
    apply_penalties(got, [0, 1], pending, lambda ids: resolve_pending(ids, pairs))
    assert torch.equal(got, want)
    with pytest.raises(AssertionError, match="placeholder"):
        apply_penalties(logits.clone(), [0, 1], pending)  # no way to read the token: refused, not guessed


@pytest.mark.parametrize("name,value", [("presence_penalty", 2.5), ("frequency_penalty", -2.1),
                                        ("repetition_penalty", 0.0), ("repetition_penalty", 101.0),
                                        ("presence_penalty", float("nan"))])
def test_out_of_range_penalties_are_refused_naming_the_field(name: str, value: float) -> None:
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**{name: value})
    assert e.value.field == f"sampling_params.{name}"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("penalties")
    return path, make_hf_checkpoint("qwen2", path, initializer_range=0.2)


def torch_greedy(hf: torch.nn.Module, prompt: list[int], n: int, params: SamplingParams) -> list[int]:
    completion: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            logits = hf(torch.tensor([prompt + completion])).logits[0, -1].float()
            completion.append(int(reference_penalties(logits, prompt, completion, params).argmax()))
    return completion


PENALTIES = [dict(repetition_penalty=1.8), dict(frequency_penalty=1.5), dict(presence_penalty=2.0),
             dict(repetition_penalty=1.3, frequency_penalty=0.7, presence_penalty=0.4)]


@pytest.mark.parametrize("async_scheduling,draft", [(False, False), (True, False), (False, True)])
@pytest.mark.slow
def test_engine_greedy_with_penalties_equals_a_plain_torch_loop(model: tuple[Path, torch.nn.Module],
                                                                async_scheduling: bool, draft: bool,
                                                                tmp_path: Path) -> None:
    """Also beside a draft model: the penalized rows decode a token a step while the others speculate."""
    path, hf = model
    spec = {"draft_model": str(first_layers(path, tmp_path / "draft", 1)), "num_speculative_tokens": 3} if draft else {}
    llm = LLM(path, device="cpu", dtype="float32", block_size=4, kv_cache_bytes=4 << 20,
              async_scheduling=async_scheduling, **spec)
    prompts = random_prompts([7, 12], llm.model_config.vocab_size, seed=3)
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    unpenalized = [o.outputs[0].token_ids for o in llm.generate(prompts, plain)]
    for kw in PENALTIES:
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, **kw)
        # mixed with rows that have none: theirs must not change
        outs = llm.generate(prompts + prompts, [params, params, plain, plain])
        for prompt, out in zip(prompts, outs[:2]):
            assert out.outputs[0].token_ids == torch_greedy(hf, prompt, 24, params), kw
        assert [o.outputs[0].token_ids for o in outs[:2]] != unpenalized, kw  # the penalty did something
        assert [o.outputs[0].token_ids for o in outs[2:]] == unpenalized
    if draft:
        assert llm.spec_stats.proposed > 0  # the unpenalized rows speculated


def test_penalties_keep_async_scheduling_on_with_the_same_outputs(model: tuple[Path, torch.nn.Module],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Penalized rows (greedy and seeded, with top logprobs, n > 1, beside rows without a penalty) give
    the same completions with async scheduling on and off, and with it on the steps do overlap: the
    penalty reads the token the step in flight sampled on the device (counted here)."""
    path, _ = model
    resolved = []

    def counted(ids: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
        resolved.append(int((ids < 0).sum()))
        return resolve_pending(ids, pairs)

    monkeypatch.setattr(runner_module, "resolve_pending", counted)
    prompts = random_prompts([7, 12, 5, 9], 300, seed=5)
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, **PENALTIES[0]),
              SamplingParams(temperature=0.9, seed=3, max_tokens=16, n=3, logprobs=2, ignore_eos=True,
                             **PENALTIES[3]),
              SamplingParams(temperature=1.0, seed=8, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=18, ignore_eos=True, **PENALTIES[1])]
    outs = {}
    for async_on in (False, True):
        llm = LLM(path, device="cpu", dtype="float32", block_size=4, kv_cache_bytes=4 << 20,
                  async_scheduling=async_on)
        resolved.clear()
        outs[async_on] = llm.generate(prompts, params)
        assert (sum(resolved) > 0) == async_on  # on: placeholders were read on the device, steps overlapped
    assert_completions_equal(outs[True], outs[False])


@pytest.mark.cuda
@pytest.mark.parametrize("invariant", [False, True])
def test_penalties_on_cuda_graphs_equal_eager_and_leave_other_rows_alone(model: tuple[Path, torch.nn.Module],
                                                                          invariant: bool) -> None:
    """On the GPU a decode step's logits are the graph's buffer, changed in place before the sampling
    graph reads them: the same tokens as eager steps; rows without a penalty keep their tokens."""
    path, _ = model
    prompts = random_prompts([7, 12, 5], 300, seed=4)
    seeded = SamplingParams(temperature=0.8, seed=11, max_tokens=32, ignore_eos=True)
    penalized = [SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, **kw) for kw in PENALTIES[:3]]
    penalized.append(SamplingParams(temperature=0.8, seed=5, max_tokens=32, ignore_eos=True, **PENALTIES[3]))
    outs = {}
    for eager in (False, True):
        llm = LLM(path, device="cuda", dtype="float32", enforce_eager=eager, batch_invariant=invariant)
        plain = [o.outputs[0].token_ids for o in llm.generate(prompts, seeded)]
        mixed = llm.generate(prompts * 2, [seeded] * 3 + penalized[:3])
        assert [o.outputs[0].token_ids for o in mixed[:3]] == plain
        outs[eager] = [o.outputs[0].token_ids for o in mixed[3:]]
        outs[eager].append(llm.generate(prompts[:1], penalized[3])[0].outputs[0].token_ids)
        del llm
        torch.cuda.empty_cache()
    assert outs[False] == outs[True]


@pytest.mark.cuda
def test_penalties_with_a_placeholder_queue_no_host_sync() -> None:
    """What lets the engine keep overlapping steps: the penalty's copies and its placeholder resolution
    are queued on the stream; none waits for the step in flight (sync debug mode raises on one)."""
    pairs = torch.tensor([[44.0, -0.1], [7.0, -0.2]], dtype=torch.float64, device="cuda")
    params = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.75, presence_penalty=0.5)
    seqs = [_Seq([1, 2, 3, 7, placeholder(1)], 3, params), _Seq([4, 5, 6, 30, placeholder(0)], 2, params)]
    logits = torch.randn(2, 50, device="cuda")
    want = logits.clone()
    apply_penalties(want, [0, 1], [_Seq([1, 2, 3, 7, 7], 3, params), _Seq([4, 5, 6, 30, 44], 2, params)])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        apply_penalties(logits, [0, 1], seqs, lambda ids: resolve_pending(ids, pairs))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(logits, want)


@pytest.mark.cuda
def test_penalties_async_equals_sync_on_cuda_graphs(model: tuple[Path, torch.nn.Module]) -> None:
    """On the GPU (decode graphs, the sampling graph reading the penalized logits buffer) async
    scheduling stays on with penalized rows, with the tokens of synchronous steps."""
    path, _ = model
    prompts = random_prompts([7, 12, 5], 300, seed=6)
    params = [SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, **PENALTIES[0]),
              SamplingParams(temperature=0.8, seed=5, max_tokens=32, n=2, ignore_eos=True, **PENALTIES[3]),
              SamplingParams(temperature=0.8, seed=11, max_tokens=32, ignore_eos=True)]
    outs = {}
    for async_on in (False, True):
        llm = LLM(path, device="cuda", dtype="float32", async_scheduling=async_on)
        outs[async_on] = [c.token_ids for o in llm.generate(prompts, params) for c in o.outputs]
        del llm
        torch.cuda.empty_cache()
    assert outs[True] == outs[False]
