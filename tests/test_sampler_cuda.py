"""On the GPU: the compiled sampler kernels equal their torch twins at a Qwen2 vocabulary, a seeded row
draws the same token alone and among 511 others, and the sampling graphs answer as the eager sampler
(and an engine's seeded completions with graphs equal those without)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from inference.core import SamplingParams
from inference.engine.llm import LLM
from inference.sample import kernels as sampler_kernels
from inference.sample.sampler import SamplingBatch, sample, sample_pairs
from tests.helpers_models import make_hf_checkpoint, random_prompts

pytestmark = pytest.mark.cuda
VOCAB = 151936
MIXED = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=50),
         SamplingParams(top_p=0.9, logprobs_mode="processed"), SamplingParams(temperature=1.2, min_p=0.05),
         SamplingParams(temperature=0.8, top_k=1000, top_p=0.95, min_p=0.01, logprobs_mode="processed"),
         SamplingParams(top_k=1), SamplingParams(temperature=0.6, top_p=0.5)]


def logits_of(rows: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator("cuda").manual_seed(seed)
    return (4 * torch.randn(rows, VOCAB, generator=gen, device="cuda")).to(dtype)


def mixed_batch(rows: int, position: int = 0) -> SamplingBatch:
    params = [MIXED[i % len(MIXED)] for i in range(rows)]
    return SamplingBatch.build(params, [1000 + i for i in range(rows)], [position] * rows, VOCAB, torch.device("cuda"))


def test_compiled_noise_equals_torch() -> None:
    seeds = torch.tensor([0, 1, (1 << 63) - 1, 987654321987654321], device="cuda")
    positions = torch.tensor([0, 1, 5, (1 << 31) + 3], device="cuda")
    got = sampler_kernels.uniforms_triton(seeds, positions, VOCAB)
    assert torch.equal(got, sampler_kernels.uniforms_torch(seeds, positions, VOCAB))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compiled_thresholds_equal_the_sort(dtype: torch.dtype) -> None:
    logits = logits_of(64, dtype, seed=1)
    sb = mixed_batch(64)
    row_max = logits.float().amax(dim=-1)
    got = sampler_kernels.thresholds_triton(logits, row_max, sb.inv_temps, sb.top_ks, sb.top_ps)
    want = sampler_kernels.thresholds_torch(logits, row_max, sb.inv_temps, sb.top_ks, sb.top_ps)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compiled_sampler_equals_twins(dtype: torch.dtype) -> None:
    """Tokens equal (a race score within float32 rounding of the next would be a rare exception: none
    here), logprobs within 1e-5, for raw and processed rows."""
    logits = logits_of(128, dtype, seed=2)
    for position in (0, 1):
        sb = mixed_batch(128, position)
        got, want = sample(logits, sb, use_triton=True), sample(logits, sb, use_triton=False)
        assert torch.equal(got.token_ids, want.token_ids)
        torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-5, rtol=1e-5)


def test_seeded_row_alone_equals_in_a_batch_of_512() -> None:
    logits = logits_of(512, torch.bfloat16, seed=3)
    target = MIXED[5]
    gen = torch.Generator().manual_seed(0)
    for position in (0, 7):
        alone = sample(logits[:1], SamplingBatch.build([target], [42], [position], VOCAB, torch.device("cuda")))
        order = torch.randperm(512, generator=gen).tolist()
        params = [target if r == 0 else MIXED[r % len(MIXED)] for r in order]
        seeds = [42 if r == 0 else (None if r % 4 == 0 else r) for r in order]
        sb = SamplingBatch.build(params, seeds, [position] * 512, VOCAB, torch.device("cuda"))
        batch = sample(logits[torch.tensor(order, device="cuda")], sb)
        at = order.index(0)
        assert int(batch.token_ids[at]) == int(alone.token_ids[0])
        assert float(batch.logprobs[at]) == float(alone.logprobs[0])  # processed: chunks fixed by the vocab


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sampling-graphs")
    make_hf_checkpoint("qwen2", path, initializer_range=0.2, max_position_embeddings=512)
    return path


def engine(path: Path, **kw: object) -> LLM:
    return LLM(path, device="cuda", dtype="float32", kv_cache_bytes=64 << 20, max_num_seqs=8, max_model_len=256,
               **kw)


def test_sampling_graph_equals_eager(model_dir: Path) -> None:
    llm = engine(model_dir)
    runner = llm.worker.runner
    graphs, sampling = runner.graphs, runner.sampling_graphs
    assert graphs is not None and sampling is not None
    vocab = llm.model_config.vocab_size
    for n in (1, 3, 8, 3):  # 3 twice: the second replay reloads rows after 8
        bs = graphs.size_for(n)
        logits = graphs.outputs[bs]
        logits.copy_(4 * torch.randn(logits.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(n)))
        params = [MIXED[(i + n) % len(MIXED)] for i in range(n)]
        sb = SamplingBatch.build(params, [7 + i for i in range(n)], [n] * n, vocab, torch.device("cuda"))
        got = sampling.replay(n, sb).clone()
        want = sample_pairs(logits[:n], sb, torch.empty(n, 2, dtype=torch.float64, device="cuda"))
        assert got[:, 0].tolist() == want[:, 0].tolist()
        torch.testing.assert_close(got[:, 1], want[:, 1], atol=1e-6, rtol=0)


def test_seeded_completions_equal_with_and_without_graphs(model_dir: Path) -> None:
    prompts = random_prompts([3, 17, 9], 300, seed=4)
    params = SamplingParams(n=3, temperature=1.0, top_p=0.9, top_k=40, seed=11, max_tokens=24, ignore_eos=True)
    eager, graphed = engine(model_dir, enforce_eager=True), engine(model_dir)
    replays: Counter[int] = Counter()
    sampling = graphed.worker.runner.sampling_graphs
    replay = sampling.replay

    def counted(n: int, sb: SamplingBatch) -> torch.Tensor:
        replays[n] += 1
        return replay(n, sb)

    sampling.replay = counted  # type: ignore[method-assign]
    a, b = eager.generate(prompts, params), graphed.generate(prompts, params)
    assert sum(replays.values()) > 0
    for x, y in zip(a, b):
        for u, v in zip(x.outputs, y.outputs):
            assert u.token_ids == v.token_ids
