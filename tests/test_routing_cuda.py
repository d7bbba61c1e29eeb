"""The routing record on CUDA (SamplingParams.return_routing): the decode graphs write each step's expert
ids into the static routing buffer they captured, so a run on graphs (async scheduling, the pinned copy
behind an event) records the routing an eager run records, bit for bit in the batch-invariant mode; so
do the speculative verify graphs, and a level-1 sleep moves nothing the graphs write."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from inference.core import SamplingParams
from inference.engine.llm import LLM
from inference.models.tiny import make_tiny_model

pytestmark = pytest.mark.cuda
GPU = {"device": "cuda", "dtype": "bfloat16", "kv_cache_bytes": 64 << 20, "batch_invariant": True}
SAMPLING = SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=24, ignore_eos=True, return_routing=True)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("routing-cuda") / "m", "qwen3_moe", seed=2, dtype="bfloat16")


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(4, 512) for _ in range(n)] for n in (3, 17, 8, 30, 5, 60, 1, 12)]


def routed(llm: LLM) -> list[tuple[list[int], bytes, tuple[int, ...]]]:
    return [(c.token_ids, c.routing.tobytes(), c.routing.shape)
            for o in llm.generate(prompts(), SAMPLING) for c in o.outputs]


def test_decode_graphs_record_the_routing_eager_steps_record(moe_dir: Path) -> None:
    graphs = LLM(moe_dir, **GPU)
    runner = graphs.worker.runner
    assert runner is not None and runner.graphs is not None and runner.routing is not None
    want = routed(graphs)
    assert runner.routing.frozen and sum(runner.eager_steps.values()) < SAMPLING.max_tokens, "decodes ran on graphs"
    mc = graphs.model_config
    rows = [len(p) + len(t) - 1 for (t, _, _), p in zip(want, [p for p in prompts() for _ in range(SAMPLING.n)])]
    assert [shape for _, _, shape in want] == [(n, mc.num_moe_layers, mc.num_experts_per_tok) for n in rows]
    eager = LLM(moe_dir, enforce_eager=True, **GPU)
    assert routed(eager) == want
    del eager
    graphs.sleep(1)
    graphs.wake_up()
    assert routed(graphs) == want


def test_speculative_verify_graphs_record_the_accepted_positions(moe_dir: Path) -> None:
    want = routed(LLM(moe_dir, enforce_eager=True, **GPU))
    spec = LLM(moe_dir, draft_model=str(moe_dir), num_speculative_tokens=3, **GPU)  # its own draft: all accepted
    assert spec.worker.runner is not None and spec.worker.runner.verify_graphs is not None
    got = routed(spec)
    assert spec.spec_stats.accepted > 0
    assert got == want
    assert all(np.frombuffer(r, dtype=np.uint8).max() < spec.model_config.num_experts for _, r, _ in got)
