"""TP=2 over gloo, in two processes: the engine gives the same tokens and logprobs as TP=1."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from inference.core import SamplingParams
from inference.engine.llm import LLM
from inference.parallel import TPInfo
from tests.helpers_models import make_hf_checkpoint, random_prompts
from tests.helpers_tp import free_port, gloo_tp

pytestmark = pytest.mark.slow  # every test here starts real processes or runs for seconds

TP = 2
PARAMS = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
          SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=20, ignore_eos=True),
          SamplingParams(n=2, temperature=1.0, max_tokens=12, ignore_eos=True)]


def _generate(path: Path, tp: TPInfo | None) -> list[tuple[list[int], list[float]]]:
    llm = LLM(path, device="cpu", dtype="float32", block_size=4, kv_cache_bytes=2 << 20, tp=tp)
    prompts = random_prompts([5, 12, 8], llm.model_config.vocab_size, seed=11)
    outs = llm.generate(prompts, PARAMS)
    return [(c.token_ids, c.logprobs) for o in outs for c in o.outputs]


def _rank(rank: int, port: int, path: str) -> None:
    with gloo_tp(rank, TP, port) as tp:
        torch.save(_generate(Path(path), tp), Path(path) / f"out.rank{rank}.pt")


@pytest.mark.parametrize("case", ["llama", "qwen2"])
def test_tp2_engine_equals_tp1(tmp_path: Path, case: str) -> None:
    make_hf_checkpoint(case, tmp_path, seed=4, initializer_range=0.2, vocab_size=301 if case == "qwen2" else 300)
    expected = _generate(tmp_path, None)
    mp.spawn(_rank, args=(free_port(), str(tmp_path)), nprocs=TP, join=True)
    for rank in range(TP):
        got = torch.load(tmp_path / f"out.rank{rank}.pt")
        assert [g[0] for g in got] == [e[0] for e in expected], f"rank {rank} tokens differ"
        for (_, lp_got), (_, lp_exp) in zip(got, expected):
            torch.testing.assert_close(torch.tensor(lp_got), torch.tensor(lp_exp), atol=1e-4, rtol=0)
