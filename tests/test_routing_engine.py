"""The engine's routing record on CPU (SamplingParams.return_routing): for tiny Qwen3-MoE and Mixtral models,
each completion's routing is what transformers' routers choose over the same tokens (prompt and completion
but the last), wherever their choice is not a near tie, through plain steps, async scheduling, chunked
prefill and prefix-cache hits (the samples of a prompt share its blocks); a preemption's recompute and a
rejected speculative token overwrite by position, so the routing equals the undisturbed run's; a dense
model refuses the field. The CUDA graph twin is in tests/test_routing_cuda.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from inference.core import InvalidRequestError, SamplingParams
from inference.engine.llm import LLM
from inference.models.tiny import make_tiny_model
from tests.helpers_models import make_hf_checkpoint, random_prompts
from trainer_hooks.routing_replay import moe_routers

pytestmark = pytest.mark.slow
CPU: dict[str, Any] = {"device": "cpu", "dtype": "float32", "kv_cache_bytes": 4 << 20, "block_size": 4}
NEAR_TIE = 1e-4  # probability between the k-th and the next expert below which the choice is a coin toss


def hf_routing(hf: nn.Module, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(the experts transformers' routers choose for `ids` [tokens, moe layers, k], and each choice's
    margin [tokens, moe layers]: the k-th expert's probability minus the next one's)."""
    routers = moe_routers(hf)
    ids_out: list[torch.Tensor] = []
    margins: list[torch.Tensor] = []

    def keep(module: nn.Module, args: Any, out: tuple) -> None:
        probs = torch.softmax(out[0].float(), dim=-1).sort(dim=-1, descending=True).values
        margins.append(probs[:, module.top_k - 1] - probs[:, module.top_k])
        ids_out.append(out[2])

    handles = [r.register_forward_hook(keep) for r in routers]
    try:
        with torch.no_grad():
            hf(torch.tensor([ids]))
    finally:
        for h in handles:
            h.remove()
    return torch.stack(ids_out, 1).numpy(), torch.stack(margins, 1).numpy()


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def hf_case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, nn.Module]:
    path = tmp_path_factory.mktemp(request.param)
    return path, make_hf_checkpoint(request.param, path)


@pytest.mark.parametrize("engine", [{}, {"async_scheduling": True, "max_num_batched_tokens": 7}],
                         ids=["sync", "async-chunked"])
def test_recorded_routing_is_the_hf_forwards_where_not_near_tied(hf_case: tuple[Path, nn.Module],
                                                                 engine: dict[str, Any]) -> None:
    path, hf = hf_case
    llm = LLM(path, **CPU, **engine)
    mc = llm.model_config
    prompts = random_prompts([9, 17, 5, 12], mc.vocab_size, seed=1)
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True, return_routing=True)
    outs = llm.generate(prompts, params)
    assert sum(o.num_cached_tokens for o in outs) > 0, "the second samples hit their prompt's blocks"
    clear = tied = 0
    for prompt, out in zip(prompts, outs):
        for c in out.outputs:
            tokens = prompt + c.token_ids[:-1]  # what the engine computed, what a trainer forwards
            r = c.routing
            assert isinstance(r, np.ndarray) and r.dtype == np.uint8
            assert r.shape == (len(tokens), mc.num_moe_layers, mc.num_experts_per_tok)
            want, margin = hf_routing(hf, tokens)
            ok = margin > NEAR_TIE
            assert np.array_equal(r[ok], want[ok]), f"{mc.family}: routing differs off near ties"
            clear, tied = clear + int(ok.sum()), tied + int((~ok).sum())
    assert tied <= 0.05 * clear, (tied, clear)
    assert all(c.routing is None for c in llm.generate(prompts[:1], SamplingParams(max_tokens=3))[0].outputs)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {"moe": make_tiny_model(root / "moe", "qwen3_moe", seed=2, num_layers=2),
            "dense": make_tiny_model(root / "dense", "qwen3", seed=4, num_layers=1)}


def routed(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], np.ndarray]]:
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, return_routing=True)
    return [(o.outputs[0].token_ids, o.outputs[0].routing) for o in llm.generate(prompts, params)]


def same(a: list[tuple[list[int], np.ndarray]], b: list[tuple[list[int], np.ndarray]]) -> bool:
    return all(ta == tb and np.array_equal(ra, rb) for (ta, ra), (tb, rb) in zip(a, b, strict=True))


def test_a_recompute_and_rejected_draft_tokens_overwrite_by_position(tiny: dict[str, Path]) -> None:
    """The batch-invariant mode computes a token's routing the same in any batch, so the routing of an
    undisturbed run is the reference bit for bit."""
    prompts = random_prompts([11, 6, 14, 9], 500, seed=5)
    free = LLM(tiny["moe"], batch_invariant=True, **CPU)
    want = routed(free, prompts)
    block_bytes = free.worker.kv_bytes_per_block(CPU["block_size"])
    tight = LLM(tiny["moe"], batch_invariant=True, **{**CPU, "kv_cache_bytes": 14 * block_bytes})
    assert same(routed(tight, prompts), want)
    assert tight.scheduler.preempted > 0, "the cache must be small enough to preempt"
    # a random dense draft is rejected at once (a run keeps one row); the target as its own draft is
    # accepted whole (a run keeps every verify row)
    for draft, accepted in ((tiny["dense"], False), (tiny["moe"], True)):
        spec = LLM(tiny["moe"], batch_invariant=True, draft_model=str(draft), num_speculative_tokens=3, **CPU)
        assert same(routed(spec, prompts), want)
        stats = spec.spec_stats
        assert stats.proposed > 0 and (stats.accepted == stats.proposed if accepted else stats.accepted == 0)


def test_a_dense_model_refuses_return_routing_naming_the_field(tiny: dict[str, Path]) -> None:
    llm = LLM(tiny["dense"], **CPU)
    with pytest.raises(InvalidRequestError, match="dense") as e:
        llm.add_request([5, 6, 7], SamplingParams(return_routing=True))
    assert e.value.field == "sampling_params.return_routing"
    assert not llm.has_unfinished()
