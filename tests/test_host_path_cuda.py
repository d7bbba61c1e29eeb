"""On the GPU: the greedy sampling graphs answer as the sampler does, and the staged graph inputs
(one row copy, block-table rows re-sent only when changed) give the eager path's completions while
the batch shrinks, grows blocks and pads."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from inference.core import SamplingParams
from inference.engine.llm import LLM
from inference.sample.sampler import SamplingBatch, sample
from tests.helpers_models import make_hf_checkpoint, random_prompts

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("host-path")
    make_hf_checkpoint("qwen2", path, initializer_range=0.2, max_position_embeddings=512)
    return path


def engine(path: Path, **kw: object) -> LLM:
    return LLM(path, device="cuda", dtype="float32", kv_cache_bytes=64 << 20, max_num_seqs=8, max_model_len=256,
               **kw)


def test_greedy_graph_equals_sample(model_dir: Path) -> None:
    llm = engine(model_dir)
    runner = llm.worker.runner
    graphs, greedy = runner.graphs, runner.greedy_graphs
    assert graphs is not None and greedy is not None
    vocab = llm.model_config.vocab_size
    for n in (1, 3, 8):
        bs = graphs.size_for(n)
        logits = graphs.outputs[bs]
        logits.copy_(4 * torch.randn(logits.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(n)))
        logits[0, 5] = logits[0, 50] = logits[0].max() + 1  # a tie: the first index wins
        got = greedy.replay(n).clone()
        sb = SamplingBatch.build([SamplingParams(temperature=0.0)] * n, [None] * n, [0] * n, vocab,
                                 torch.device("cuda"))
        want = sample(logits[:n], sb)
        assert got[:, 0].long().tolist() == want.token_ids.tolist() and int(got[0, 0]) == 5
        torch.testing.assert_close(got[:, 1].float(), want.logprobs, atol=1e-6, rtol=0)


def test_staged_graph_path_equals_eager(model_dir: Path) -> None:
    prompts = random_prompts([3, 17, 9, 30, 5], 300, seed=4)
    # different lengths: the batch shrinks step by step (5 rows pad to 8, then 4, 2, 1)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (40, 12, 25, 33, 7)]
    eager = engine(model_dir, enforce_eager=True)
    graphs = engine(model_dir)
    replays: Counter[int] = Counter()
    greedy = graphs.worker.runner.greedy_graphs
    replay = greedy.replay

    def counted(n: int) -> torch.Tensor:
        replays[n] += 1
        return replay(n)

    greedy.replay = counted  # type: ignore[method-assign]
    a, b = eager.generate(prompts, params), graphs.generate(prompts, params)
    assert sum(replays.values()) > 0 and {5, 4, 1} <= set(replays)
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        torch.testing.assert_close(torch.tensor(x.outputs[0].logprobs), torch.tensor(y.outputs[0].logprobs),
                                   atol=1e-4, rtol=0)
