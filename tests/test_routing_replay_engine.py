"""Routing replay end to end on CPU (docs/moe.md): the engine samples rollouts of a tiny Qwen3-MoE and Mixtral
model with return_routing; a trainer whose router differs by a hair (one expert's router row nudged, so
that expert and its near twin trade places at the top-k boundary) routes some rollout tokens elsewhere
and scores them far from the engine's logprobs; replaying the engine's recorded routing brings every
token back within the dense families' tolerance. The hook's logprob-gap stats report both gaps."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from torch import nn

from inference.core import RequestOutput, SamplingParams
from inference.engine.llm import LLM
from tests.helpers_models import make_hf_checkpoint, random_prompts
from trainer_hooks import WeightSyncHook
from trainer_hooks.logprob_gap import completion_routing, completions, measure_logprob_gap, trainer_logprobs
from trainer_hooks.routing_replay import moe_routers, record_routing

pytestmark = pytest.mark.slow
DENSE_TOL = 1e-4  # the dense families' logprob tolerance against transformers (tests/test_engine.py)
NUDGE = 1e-6  # expert 1's router row is expert 0's plus this times a random direction


def nudge(hf: nn.Module, sign: float) -> None:
    """Expert 1's router row := expert 0's + sign * NUDGE * u (u fixed per layer): experts 0 and 1 tie
    but for a hair, and the sign says which wins every token where they meet at the top-k boundary."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for router in moe_routers(hf):
            u = torch.randn(router.weight.shape[1], generator=g)
            router.weight[1] = router.weight[0] + sign * NUDGE * u


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def rollouts(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
             ) -> tuple[nn.Module, list[RequestOutput]]:
    """(the trainer's model: the engine's weights with the nudge reversed; the engine's rollouts)."""
    path = tmp_path_factory.mktemp(request.param)
    hf = make_hf_checkpoint(request.param, path)
    nudge(hf, +1.0)
    hf.save_pretrained(str(path), safe_serialization=True)
    llm = LLM(path, device="cpu", dtype="float32", kv_cache_bytes=4 << 20, block_size=4)
    prompts = random_prompts([9, 17, 5, 12], llm.model_config.vocab_size, seed=1)
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=16, ignore_eos=True, return_routing=True)
    outs = llm.generate(prompts, params)
    llm.worker.shutdown()
    nudge(hf, -1.0)
    return hf, outs


def test_replaying_the_engines_routing_closes_the_gap_a_different_routing_opens(
        rollouts: tuple[nn.Module, list[RequestOutput]]) -> None:
    hf, outs = rollouts
    items = completions(outs)
    pairs = [(p, c) for p, c, _ in items]
    engine = [torch.tensor(lps) for _, _, lps in items]
    routing = completion_routing(outs)
    diverged = 0
    for (prompt, completion), r in zip(pairs, routing):
        with record_routing(hf) as free_routing, torch.no_grad():
            hf(torch.tensor([prompt + completion[:-1]]))
        diverged += int((free_routing[0].numpy() != r).any(-1).sum())
    assert diverged > 0, "the trainer's router must route some rollout tokens elsewhere"
    free = trainer_logprobs(hf, pairs)
    assert max((f - e).abs().max().item() for f, e in zip(free, engine)) > 0.05
    replayed = trainer_logprobs(hf, pairs, routing=routing)
    for i, (t, e) in enumerate(zip(replayed, engine)):
        torch.testing.assert_close(t, e, atol=DENSE_TOL, rtol=0, msg=f"completion {i}")


class _FakeClient:
    """What the hook asks of a sidecar for rollouts: its state when it attaches, and generate."""

    def __init__(self, outs: list[RequestOutput]) -> None:
        self.outs = outs

    def state(self) -> dict[str, Any]:
        return {"sleeping": False, "weight_versions": {"target": 0}, "tags": {"weights": "awake"}}

    def generate(self, prompts: Any, sampling: Any) -> list[RequestOutput]:
        return self.outs


def test_the_hooks_gap_stats_report_it_with_and_without_replay(
        rollouts: tuple[nn.Module, list[RequestOutput]]) -> None:
    hf, outs = rollouts
    hook = WeightSyncHook(_FakeClient(outs), hf, sender="gloo", logprob_gap=True, sync_on_attach=False)
    assert hook.rollouts([[1, 2, 3]]) is outs
    stats = hook.stats
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    assert stats["logprob_gap_tokens"] == stats["logprob_gap_replay_tokens"] == tokens
    assert stats["logprob_gap_max_abs"] > 0.05 and stats["logprob_gap_replay_max_abs"] < DENSE_TOL
    assert measure_logprob_gap(hf, outs, replay=True).as_stats("logprob_gap_replay_").items() <= stats.items()
    # without routing in the rollouts the hook reports the free gap alone
    bare = [RequestOutput(o.request_id, o.prompt_token_ids, [replace(c, routing=None) for c in o.outputs],
                          o.weight_version) for o in outs]
    hook = WeightSyncHook(_FakeClient(bare), hf, sender="gloo", logprob_gap=True, sync_on_attach=False)
    hook.rollouts([[1, 2, 3]])
    assert "logprob_gap_max_abs" in hook.stats and not any(k.startswith("logprob_gap_replay") for k in hook.stats)
    with pytest.raises(ValueError, match="carries no routing"):
        measure_logprob_gap(hf, bare, replay=True)

