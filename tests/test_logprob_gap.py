"""The training-inference logprob gap (trainer_hooks/logprob_gap.py): right on a hand-built bigram model
with known logprobs; small for rollouts the engine generated from the trainer's own weights; large once
the trainer changes its weights without a sync; kept in WeightSyncHook.stats when asked for."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from inference.core import CompletionOutput, RequestOutput, SamplingParams
from inference.models.tiny import default_model_dir
from trainer_hooks import LogprobGap, WeightSyncHook, measure_logprob_gap
from trainer_hooks.logprob_gap import gap_of, trainer_logprobs
from trainer_hooks.toy_policy import ToyPolicy

VOCAB = 7


class Bigram(nn.Module):
    """logits[b, t] = table[ids[b, t]]: log p(c | prev p) = log_softmax(table[p])[c], known by hand.
    Returns an HF-style object (`.logits`), and counts calls to check the one batched forward."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(0)))
        self.calls: list[tuple[torch.Size, bool, bool]] = []

    def forward(self, ids: torch.Tensor) -> Any:
        self.calls.append((ids.shape, torch.is_grad_enabled(), self.training))
        return type("Out", (), {"logits": self.table[ids]})()


def _expected(model: Bigram, prompt: list[int], completion: list[int]) -> list[float]:
    logp = torch.log_softmax(model.table.detach().double(), dim=-1)
    prev = [prompt[-1], *completion[:-1]]
    return [logp[p, c].item() for p, c in zip(prev, completion)]


def _rollout(prompt: list[int], completions: list[tuple[list[int], list[float]]]) -> RequestOutput:
    outs = [CompletionOutput(index=i, token_ids=ids, logprobs=lps) for i, (ids, lps) in enumerate(completions)]
    return RequestOutput(request_id="r", prompt_token_ids=prompt, outputs=outs, weight_version=0)


def test_the_figures_on_a_hand_built_example() -> None:
    model = Bigram()
    model.train()
    seqs = [([1, 2, 3], [4, 5, 6, 0]), ([5], [3]), ([2, 2, 6, 1, 0], [1, 1])]
    offsets = [[0.1, -0.2, 0.0, 0.3], [-0.5], [0.05, 0.0]]  # rollout = exact + offset, so diff = -offset
    rollouts = [_rollout(p, [(c, [e + o for e, o in zip(_expected(model, p, c), off)])])
                for (p, c), off in zip(seqs, offsets)]
    rollouts[1].outputs.append(CompletionOutput(index=1, token_ids=[], logprobs=[]))  # empty: no tokens
    gap = measure_logprob_gap(model, rollouts)
    diffs = [-o for off in offsets for o in off]
    assert gap.tokens == 7
    assert gap.mean == pytest.approx(sum(diffs) / 7, abs=1e-6)
    assert gap.mean_abs == pytest.approx(sum(map(abs, diffs)) / 7, abs=1e-6)
    assert gap.max_abs == pytest.approx(0.5, abs=1e-6)
    assert gap.ratio_minus_one == pytest.approx(sum(math.expm1(d) for d in diffs) / 7, abs=1e-6)
    # one right-padded forward, without autograd, in eval mode; the model gets its training mode back
    assert model.calls == [(torch.Size([3, 6]), False, False)] and model.training
    assert gap.as_stats() == {"logprob_gap_tokens": 7, "logprob_gap_mean": gap.mean,
                              "logprob_gap_mean_abs": gap.mean_abs, "logprob_gap_max_abs": gap.max_abs,
                              "logprob_gap_ratio_minus_one": gap.ratio_minus_one}


def test_exact_rollout_logprobs_give_a_zero_gap_and_mismatches_are_named() -> None:
    model = Bigram()
    trainer = trainer_logprobs(model, [([3, 1], [2, 4, 4])])
    assert torch.allclose(trainer[0].double(), torch.tensor(_expected(model, [3, 1], [2, 4, 4]), dtype=torch.float64))
    assert gap_of(trainer, [trainer[0].tolist()]) == LogprobGap(3, 0.0, 0.0, 0.0, 0.0)
    assert measure_logprob_gap(model, []) == LogprobGap(0, 0.0, 0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="completion 0: 2 tokens but 1 logprobs"):
        measure_logprob_gap(model, [_rollout([1], [([2, 3], [-1.0])])])
    with pytest.raises(ValueError, match="completion 0: 3 trainer logprobs for 2"):
        gap_of(trainer, [[0.0, 0.0]])


# ---- against the engine -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine_rollouts() -> tuple[Path, list[RequestOutput]]:
    from inference.engine.llm import LLM  # the test runs the engine; trainer_hooks itself never imports it

    model_dir = default_model_dir()
    llm = LLM(model_dir, device="cpu", dtype="float32", kv_cache_bytes=4 << 20)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(4, 400, (n,), generator=gen).tolist() for n in (3, 17, 8, 30, 1, 12)]
    params = SamplingParams(n=2, temperature=1.0, max_tokens=24, ignore_eos=True, seed=7)
    outs = llm.generate(prompts, params)
    llm.worker.shutdown()
    return model_dir, outs


@pytest.mark.slow
def test_rollouts_of_the_same_weights_have_a_tiny_zero_mean_gap(engine_rollouts: tuple[Path, list]) -> None:
    model_dir, outs = engine_rollouts
    gap = measure_logprob_gap(ToyPolicy.from_dir(model_dir), outs)
    assert gap.tokens == 6 * 2 * 24
    # float32 on the CPU: two implementations agree to rounding (measured ~1e-6), no bias either way
    assert gap.max_abs < 1e-4 and gap.mean_abs < 1e-5, gap
    assert abs(gap.mean) < 1e-5 and abs(gap.ratio_minus_one) < 1e-5, gap


@pytest.mark.slow
def test_weights_changed_without_a_sync_show_a_large_gap(engine_rollouts: tuple[Path, list]) -> None:
    model_dir, outs = engine_rollouts
    policy = ToyPolicy.from_dir(model_dir)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(3)))
    gap = measure_logprob_gap(policy, outs)
    assert gap.max_abs > 0.1 and gap.mean_abs > 0.01, gap  # a check with the bound above fails here
    assert abs(gap.ratio_minus_one) > 1e-3


class _FakeClient:
    """What the hook asks of a sidecar for rollouts: its state when the hook attaches (awake, serving the
    checkpoint) and generate."""

    def __init__(self, outs: list[RequestOutput]) -> None:
        self.outs = outs

    def state(self) -> dict[str, Any]:
        return {"sleeping": False, "weight_versions": {"target": 0}, "tags": {"weights": "awake"}}

    def generate(self, prompts: Any, sampling: Any) -> list[RequestOutput]:
        return self.outs


@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.slow
def test_the_hook_keeps_the_gap_in_its_stats_when_asked(engine_rollouts: tuple[Path, list], enabled: bool) -> None:
    model_dir, outs = engine_rollouts
    policy = ToyPolicy.from_dir(model_dir)
    hook = WeightSyncHook(_FakeClient(outs), policy, sender="gloo", logprob_gap=enabled, sync_on_attach=False)
    assert hook.rollouts([[1, 2, 3]]) is outs
    if not enabled:
        assert not any(k.startswith("logprob_gap") for k in hook.stats)
        return
    assert hook.stats["logprob_gap_tokens"] == 6 * 2 * 24 and hook.stats["logprob_gap_max_abs"] < 1e-4
    assert hook.stats["logprob_gap_ms"] >= 0.0
    assert measure_logprob_gap(policy, outs).as_stats().items() <= hook.stats.items()


def test_truncated_importance_weights_are_the_capped_ratio_per_token() -> None:
    """min(exp(trainer - rollout), cap) per token: the correction an FP8 rollout needs (docs/fp8.md)."""
    from trainer_hooks.logprob_gap import rollout_importance_weights, truncated_importance_weights

    trainer = [torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-3.0])]
    rollout = [[-1.0, -3.0, -0.4], [-2.0]]
    weights = truncated_importance_weights(trainer, rollout, cap=2.0)
    assert torch.allclose(weights[0], torch.tensor([1.0, 2.0, math.exp(-0.1)]))  # e^1 capped at 2
    assert torch.allclose(weights[1], torch.tensor([math.exp(-1.0)]))
    assert all(w.dtype == torch.float32 and not w.requires_grad for w in weights)
    with pytest.raises(ValueError, match="completion 0"):
        truncated_importance_weights([torch.zeros(2)], [[0.0]])
    with pytest.raises(ValueError, match="cap"):
        truncated_importance_weights(trainer, rollout, cap=0.0)

    model = Bigram()
    prompt, completion = [1, 2, 3], [4, 5, 6]
    exact = _expected(model, prompt, completion)
    rolled = [_rollout(prompt, [(completion, [e - 1.0 for e in exact])])]  # the rollout 1 nat less likely
    (w,) = rollout_importance_weights(model, rolled, cap=2.0)
    assert torch.allclose(w, torch.full((3,), 2.0))  # e^1 > 2: every token capped
