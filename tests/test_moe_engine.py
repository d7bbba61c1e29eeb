"""An MoE model through the engine on CPU: a dense draft serves an MoE target with the target's greedy
output; the batch-invariant mode gives a prompt's tokens and logprobs the same bits alone and in a batch
(routing included); a level-1 sleep changes no bit. The GPU twins are in tests/test_moe_cuda.py."""

from __future__ import annotations

import random
from array import array
from pathlib import Path

import pytest

from inference.core import SamplingParams
from inference.engine.llm import LLM
from inference.models.tiny import make_tiny_model

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
CPU = {"device": "cpu", "dtype": "float32", "kv_cache_bytes": 4 << 20, "block_size": 4}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe-engine")
    return {"moe": make_tiny_model(root / "moe", "qwen3_moe", seed=2, num_layers=2),
            "mixtral": make_tiny_model(root / "mixtral", "mixtral", seed=2, num_layers=2),
            "dense": make_tiny_model(root / "dense", "qwen3", seed=4, num_layers=1)}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(4, 512) for _ in range(n)] for n in (3, 17, 8, 30, 5)]


def run(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], bytes]]:
    """Tokens and logprobs as their float64 bytes: equal only when every bit is."""
    return [(o.outputs[0].token_ids, array("d", o.outputs[0].logprobs).tobytes())
            for o in llm.generate(prompts, GREEDY)]


def test_a_dense_draft_serves_an_moe_target(dirs: dict[str, Path], prompts: list[list[int]]) -> None:
    want = [t for t, _ in run(LLM(dirs["moe"], **CPU), prompts)]
    spec = LLM(dirs["moe"], draft_model=str(dirs["dense"]), num_speculative_tokens=3, **CPU)
    assert [t for t, _ in run(spec, prompts)] == want


@pytest.mark.parametrize("family", ["moe", "mixtral"])
def test_batch_invariant_mode_gives_a_prompt_the_same_bits_alone_and_batched(
        dirs: dict[str, Path], prompts: list[list[int]], family: str) -> None:
    llm = LLM(dirs[family], batch_invariant=True, **CPU)
    alone = []
    for p in prompts:
        llm.block_manager.reset_prefix_cache()
        alone += run(llm, [p])
    llm.block_manager.reset_prefix_cache()
    assert run(llm, prompts) == alone
    llm.block_manager.reset_prefix_cache()
    assert run(llm, prompts[::-1]) == alone[::-1]


def test_level1_sleep_changes_no_bit(dirs: dict[str, Path], prompts: list[list[int]]) -> None:
    llm = LLM(dirs["moe"], **CPU)
    before = run(llm, prompts)
    llm.sleep(1)
    llm.wake_up()
    assert run(llm, prompts) == before
