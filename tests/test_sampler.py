"""The sampler equals its materialized definition (`sample_reference`), every kernel (run here in Triton's
CPU interpreter) equals its torch twin, and a seeded row's token does not depend on the batch around it.
The sampling statistics and the edge cases live in tests/test_sampler_stats.py."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from inference.core import SamplingParams
from inference.sample import kernels as sampler_kernels
from inference.sample import sampler
from inference.sample.sampler import (
    SamplerOutput,
    SamplingBatch,
    row_stats_torch,
    sample,
    sample_pairs,
    sample_reference,
)

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


BACKENDS = [pytest.param(False, id="torch"), pytest.param(True, id="triton", marks=needs_triton)]
SEED = 123456789012345


def test_generator_is_pinned() -> None:
    """The uniform of (seed, position, index) is part of the reproducibility contract: changing the
    generator changes every seeded completion, so its values are fixed here (high seed words included)."""
    seeds = torch.tensor([0, 1234567890123, (1 << 62) + 5])
    positions = torch.tensor([0, 7, 100000])
    want = [["0x1.0f12fep-1", "0x1.93f82ap-4", "0x1.6c501ap-1", "0x1.e1d7e0p-2"],
            ["0x1.007396p-1", "0x1.29a09cp-2", "0x1.110942p-1", "0x1.ca6b8cp-1"],
            ["0x1.37499ep-2", "0x1.1dc150p-2", "0x1.4e1858p-1", "0x1.9036e2p-2"]]
    got = sampler_kernels.uniforms_torch(seeds, positions, 4)
    assert got.tolist() == [[float.fromhex(h) for h in row] for row in want]


@needs_triton
def test_uniform_kernel_equals_torch() -> None:
    """The same bits: seeds with the high word set, positions past 2^31, several column blocks."""
    seeds = torch.tensor([0, 1, (1 << 63) - 1, 987654321987654321, SEED])
    positions = torch.tensor([0, 1, 5, (1 << 31) + 3, 4095])
    got = sampler_kernels.uniforms_triton(seeds, positions, 2500)
    assert torch.equal(got, sampler_kernels.uniforms_torch(seeds, positions, 2500))
    assert float(got.min()) > 0.0 and float(got.max()) < 1.0


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.slow
def test_threshold_kernel_equals_sort_definition(dtype: torch.dtype) -> None:
    """The search finds the sort's threshold exactly: top-k alone, top-p alone, both, k = 1, a top_p that
    underflowed to 0, heavy ties (a row of 12 distinct values), -inf entries, rows without filters."""
    vocab = 1200
    ks_ps_ts = [(vocab, 1.0, 1.0), (1, 1.0, 1.0), (50, 1.0, 0.7), (vocab, 0.9, 1.0), (40, 0.5, 1.3),
                (vocab, 0.0, 1.0), (7, 0.99, 2.0), (vocab, 0.999, 0.5), (30, 0.8, 1.0), (vocab, 0.6, 0.9)]
    logits = random_logits(len(ks_ps_ts), vocab, torch.float32, seed=3).cpu()
    gen = torch.Generator().manual_seed(1)
    logits[8] = torch.randint(-6, 6, (vocab,), generator=gen) * 0.5  # ties at every threshold
    logits[9] = logits[8]
    logits[3, :300] = float("-inf")
    logits = logits.to(dtype)
    row_max = logits.float().amax(dim=-1)
    inv_t = torch.tensor([1 / t for _, _, t in ks_ps_ts], dtype=torch.float32)
    ks = torch.tensor([k for k, _, _ in ks_ps_ts], dtype=torch.int32)
    ps = torch.tensor([p for _, p, _ in ks_ps_ts], dtype=torch.float32)
    got = sampler_kernels.thresholds_triton(logits, row_max, inv_t, ks, ps)
    want = sampler_kernels.thresholds_torch(logits, row_max, inv_t, ks, ps)
    assert torch.equal(got, want)
    kept = (logits.float() >= got[:, None]).sum(-1)
    assert kept[0] == vocab and kept[1] == 1 and kept[2] == 50
    assert kept[5] == 1 and float(got[5]) == float(row_max[5])  # only the top token
    assert kept[8] > 30  # every entry tied with the 30th stays


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.slow
def test_race_kernels_equal_twins(dtype: torch.dtype) -> None:
    """The whole sampled path, kernels against twins, over two race chunks per row: tokens equal,
    logprobs (raw and processed) equal to float32 rounding; the (token, logprob) pairs form too."""
    vocab = 5000
    params = [SamplingParams(temperature=0.0, logprobs_mode="processed"), SamplingParams(temperature=0.7),
              SamplingParams(temperature=1.3, top_k=20, logprobs_mode="processed"),
              SamplingParams(temperature=1.0, top_p=0.8), SamplingParams(temperature=0.9, min_p=0.05),
              SamplingParams(temperature=1.1, top_k=300, top_p=0.95, min_p=0.01, logprobs_mode="processed")]
    logits = random_logits(len(params), vocab, dtype, seed=11).cpu()
    for step in range(2):
        sb = SamplingBatch.build(params, [SEED + i for i in range(len(params))], [step] * len(params), vocab, "cpu")
        got, want = (sample(logits, sb, use_triton=t) for t in (True, False))
        assert_same(got, want)
        pairs = sample_pairs(logits, sb, torch.empty(len(params), 2, dtype=torch.float64), use_triton=True)
        assert pairs[:, 0].long().tolist() == want.token_ids.tolist()
        torch.testing.assert_close(pairs[:, 1].float(), want.logprobs, atol=1e-5, rtol=1e-5)


OTHERS = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_k=5),
          SamplingParams(top_p=0.6, logprobs_mode="processed"), SamplingParams(temperature=0.9, min_p=0.2),
          SamplingParams(temperature=1.0), SamplingParams(temperature=0.8), SamplingParams(temperature=1.2)]
TARGETS = {"greedy": SamplingParams(temperature=0.0), "plain": SamplingParams(temperature=1.0),
           "filtered": SamplingParams(temperature=0.8, top_k=30, top_p=0.9, min_p=0.02, logprobs_mode="processed")}


@pytest.mark.parametrize("use_triton", BACKENDS)
@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.slow
def test_seeded_row_alone_equals_in_batch(use_triton: bool, target: str) -> None:
    """A seeded row's token and logprob depend only on (seed, position, logits): alone, or at any place
    among 64 other rows (greedy, filtered, seeded and unseeded), whatever the others draw. bf16 logits,
    so the row has ties."""
    vocab = 700
    params = TARGETS[target]
    logits = random_logits(65, vocab, torch.bfloat16, seed=5).cpu()
    others = [OTHERS[i % len(OTHERS)] for i in range(64)]
    other_seeds = [None if i % 3 == 0 else i for i in range(64)]
    gen = torch.Generator().manual_seed(0)
    for position in (0, 9):
        alone = sample(logits[:1], SamplingBatch.build([params], [SEED], [position], vocab, "cpu"),
                       use_triton=use_triton)
        order = torch.randperm(65, generator=gen).tolist()  # order[j]: the row placed at j
        rows = [(params, SEED) if r == 0 else (others[r - 1], other_seeds[r - 1]) for r in order]
        sb = SamplingBatch.build([p for p, _ in rows], [s for _, s in rows], [position] * 65, vocab, "cpu")
        batch = sample(logits[order], sb, torch.Generator().manual_seed(position), use_triton=use_triton)
        at = order.index(0)
        assert int(batch.token_ids[at]) == int(alone.token_ids[0])
        assert float(batch.logprobs[at]) == pytest.approx(float(alone.logprobs[0]), abs=1e-5)


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
