"""The sampler equals the materialized log_softmax sampler it replaced, and its row reduction (two-stage
Triton kernels on CUDA, run here in Triton's CPU interpreter) equals the torch twin."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from inference import sampler
from inference.core import SamplingParams
from inference.sampler import SamplerOutput, SamplingBatch, row_stats_torch, sample, sample_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(sampler.triton is None, reason="triton is not installed")


def assert_same(got: SamplerOutput, want: SamplerOutput) -> None:
    assert torch.equal(got.token_ids, want.token_ids)
    torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-5, rtol=1e-5)
    assert (got.top_ids is None) == (want.top_ids is None)
    if want.top_ids is not None:
        assert torch.equal(got.top_ids, want.top_ids)
        torch.testing.assert_close(got.top_logprobs, want.top_logprobs, atol=1e-5, rtol=1e-5)


def random_logits(rows: int, vocab: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator(DEVICE).manual_seed(seed)
    return (4 * torch.randn(rows, vocab, generator=gen, device=DEVICE)).to(dtype)


def build(params: list[SamplingParams], vocab: int, seeds: list[int | None] | None = None) -> SamplingBatch:
    seeds = seeds or [None] * len(params)
    return SamplingBatch.build(params, seeds, list(range(len(params))), vocab, torch.device(DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top", [0, 5])
def test_greedy_equals_log_softmax_sampler(dtype: torch.dtype, top: int) -> None:
    logits = random_logits(3, 1000, dtype)
    logits[1, 7] = logits[1, 900] = logits[1].max() + 1  # a tie: the first index wins, as in argmax
    sb = build([SamplingParams(temperature=0.0, logprobs=top)] * 3, 1000)
    got = sample(logits, sb)
    assert int(got.token_ids[1]) == 7
    assert_same(got, sample_reference(logits, sb, None))


def test_mixed_batch_equals_log_softmax_sampler() -> None:
    """Greedy, temperature, top-k, top-p, min-p, processed logprobs and seeded rows in one batch; both
    samplers draw the same noise, so they pick the same tokens."""
    vocab = 500
    params = [SamplingParams(temperature=0.0, logprobs=3),
              SamplingParams(temperature=0.7, logprobs=2),
              SamplingParams(temperature=1.3, top_k=20, logprobs=4, logprobs_mode="processed"),
              SamplingParams(temperature=1.0, top_p=0.8, seed=5),
              SamplingParams(temperature=0.9, min_p=0.05, logprobs=1, logprobs_mode="processed"),
              SamplingParams(temperature=0.0, top_k=3, logprobs=2, logprobs_mode="processed")]
    for step in range(4):
        logits = random_logits(len(params), vocab, torch.float32, seed=step)
        sb = build(params, vocab, seeds=[None, None, None, 11, None, None])
        got = sample(logits, sb, torch.Generator(DEVICE).manual_seed(step))
        want = sample_reference(logits, sb, torch.Generator(DEVICE).manual_seed(step))
        assert_same(got, want)


@needs_triton
@pytest.mark.parametrize(("rows", "cols"), [(1, 1), (1, 9000), (3, 5000), (20, 4097)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_stats_kernels_equal_torch(rows: int, cols: int, dtype: torch.dtype) -> None:
    """Rows split into several chunks (a row of 9000 into 5 programs) or one; ties across chunks keep
    the first index; masked (-inf) entries and whole -inf chunks count for nothing."""
    x = random_logits(rows, cols, dtype, seed=cols).cpu()
    if cols > 4096:
        x[0, 4096:] = float("-inf")
        x[-1, [100, 2048 + 5, cols - 1]] = 30.0
    got = sampler.row_stats_triton(x)
    want = row_stats_torch(x)
    assert torch.equal(got.max, want.max) and torch.equal(got.argmax, want.argmax)
    torch.testing.assert_close(got.log_sum, want.log_sum, atol=1e-5, rtol=1e-5)
    if cols > 4096:
        assert int(got.argmax[-1]) == 100


@needs_triton
def test_row_chunks_cover_the_row() -> None:
    for rows, cols in [(1, 151936), (128, 151936), (7, 100), (1, 2048)]:
        chunks, span = sampler.row_chunks(rows, cols, target=528)
        assert span % 2048 == 0 and (chunks - 1) * span < cols <= chunks * span
    assert sampler.row_chunks(1, 151936, target=528)[0] == 75  # one row spreads over 75 programs
    assert sampler.row_chunks(128, 151936, target=528)[0] == 5


# ---- CUDA: the compiled kernels at a Qwen2 vocabulary -------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("rows", [1, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_sampler_equals_log_softmax_sampler(rows: int, dtype: torch.dtype) -> None:
    vocab = 151936
    logits = random_logits(rows, vocab, dtype, seed=rows)
    stats = sampler.row_stats(logits)
    want = row_stats_torch(logits)
    assert torch.equal(stats.max, want.max) and torch.equal(stats.argmax, want.argmax)
    torch.testing.assert_close(stats.log_sum, want.log_sum, atol=1e-5, rtol=1e-5)
    sb = build([SamplingParams(temperature=0.0, logprobs=5)] * rows, vocab)
    assert_same(sample(logits, sb), sample_reference(logits, sb, None))
    sb = build([SamplingParams(temperature=0.8, top_k=50, logprobs=2)] * rows, vocab)
    got = sample(logits, sb, torch.Generator(DEVICE).manual_seed(1))
    assert_same(got, sample_reference(logits, sb, torch.Generator(DEVICE).manual_seed(1)))
