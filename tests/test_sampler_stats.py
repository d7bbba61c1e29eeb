"""The sampler draws from the distribution it defines: counts over many seeded draws against the exact
processed distribution (temperature, top-k, top-p, min-p), the generator's own uniformity and its
small-E precision, the filters' and temperatures' edge cases on both backends, and TP-like
determinism: runners with one seed pick the same unseeded tokens with no communication."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from inference.core import SamplingParams
from inference.engine.llm import LLM
from inference.sample import kernels as sampler_kernels
from inference.sample import sampler
from inference.sample.sampler import SamplingBatch, sample
from inference.sched.sequence import Sequence

needs_triton = pytest.mark.skipif(sampler.triton is None, reason="triton is not installed")
BACKENDS = [pytest.param(False, id="torch"), pytest.param(True, id="triton", marks=needs_triton)]
LOGITS = torch.tensor([2.0, 1.5, 1.2, 1.0, 0.7, 0.5, 0.3, 0.0, -0.5, -1.0, -2.0, -3.0])
CASES = {"t1": SamplingParams(temperature=1.0), "t0.6": SamplingParams(temperature=0.6),
         "t1.8": SamplingParams(temperature=1.8), "top_k4": SamplingParams(top_k=4),
         "top_p0.7": SamplingParams(top_p=0.7), "min_p0.15": SamplingParams(min_p=0.15),
         "all": SamplingParams(temperature=1.3, top_k=8, top_p=0.9, min_p=0.05)}


@dataclass(frozen=True)
class RawParams:
    """SamplingParams' fields as the sampler reads them, without SamplingParams' normalisation (which
    turns a tiny temperature into greedy and refuses a top_p float32 cannot hold): what a kernel must
    survive if such a value ever reached it."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    logprobs: int = 0
    logprobs_mode: str = "raw"

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def exact_distribution(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The processed distribution by its definition, in float64 (distinct logits: no ties): temperature;
    top-k keeps the k largest; top-p the smallest prefix, in sorted order, whose mass reaches p; min-p
    the tokens with probability >= min_p * the largest."""
    x = logits.double() / p.temperature
    order = x.argsort(descending=True)
    keep = torch.ones_like(x, dtype=torch.bool)
    if 0 < p.top_k < x.numel():
        keep[order[p.top_k:]] = False
    if p.top_p < 1.0:
        probs = torch.softmax(x.masked_fill(~keep, -math.inf), 0)[order]
        keep[order[(probs.cumsum(0) - probs) >= p.top_p]] = False
    probs = torch.softmax(x.masked_fill(~keep, -math.inf), 0)
    if p.min_p > 0:
        keep &= probs >= p.min_p * probs.max()
    return torch.softmax(x.masked_fill(~keep, -math.inf), 0)


def chi_square_bound(dof: int, z: float = 3.72) -> float:
    """The chi-square quantile at 1 - 1e-4 (z), by Wilson-Hilferty: a fixed-seed test that fails only
    when the distribution is wrong."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


@pytest.mark.parametrize("walk", ["seeds", "positions"])
@pytest.mark.parametrize("case", list(CASES))
def test_draws_follow_the_processed_distribution(case: str, walk: str) -> None:
    """20,000 draws of one row's logits, over distinct seeds or over the positions of one seed (a
    sequence's walk): filtered tokens never appear, counts fit the exact distribution (chi-square at
    1e-4) and the total variation stays under 0.015."""
    params, n = CASES[case], 20_000
    seeds = list(range(1, n + 1)) if walk == "seeds" else [987654321] * n
    positions = [0] * n if walk == "seeds" else list(range(n))
    sb = SamplingBatch.build([params] * n, seeds, positions, LOGITS.numel(), "cpu")
    counts = torch.bincount(sample(LOGITS.repeat(n, 1), sb).token_ids, minlength=LOGITS.numel()).double()
    want = exact_distribution(LOGITS, params)
    assert counts[want == 0].sum() == 0
    live = want > 0
    chi2 = float(((counts[live] - n * want[live]) ** 2 / (n * want[live])).sum())
    assert chi2 < chi_square_bound(int(live.sum()) - 1), (chi2, counts.tolist())
    assert 0.5 * float((counts / n - want).abs().sum()) < 0.015


def test_noise_is_uniform_and_exponential() -> None:
    """1M uniforms of 200 rows (consecutive seeds and positions): 64 equal bins fit (chi-square), and
    E = exp(log E) has mean 1, P(E > 3) = e^-3 and P(E < 2^-10) = 2^-10 within 5 standard errors."""
    seeds, positions = torch.arange(200) + 1000, torch.arange(200) % 7
    w = sampler_kernels.uniforms_torch(seeds, positions, 5000).flatten()
    n = w.numel()
    bins = torch.bincount((w * 64).long(), minlength=64).double()
    assert float(((bins - n / 64) ** 2 / (n / 64)).sum()) < chi_square_bound(63)
    e = sampler_kernels.log_exponential_torch(w).double().exp()
    assert abs(float(e.mean()) - 1) < 5 / math.sqrt(n)
    for frac, prob in ((float((e > 3).double().mean()), math.exp(-3)), (float((e < 2**-10).double().mean()), 2**-10)):
        assert abs(frac - prob) < 5 * math.sqrt(prob / n), (frac, prob)


def test_small_exponentials_keep_their_precision() -> None:
    """log E against float64's log(-log1p(-w)) from w = 2^-33 (the smallest uniform) to the largest:
    both branches within 5e-6 (float32's spacing at |log E| = 22 is 2e-6), where -log(u) of a float32
    u = 1 - w would lose every E below 6e-8."""
    w = torch.cat([torch.logspace(-33, -1, 400, base=2.0), torch.linspace(0.5, sampler_kernels.W_MAX, 400)]).float()
    want = torch.log(-torch.log1p(-w.double()))
    got = sampler_kernels.log_exponential_torch(w).double()
    assert float((got - want).abs().max()) < 5e-6


@pytest.mark.parametrize("use_triton", BACKENDS)
@pytest.mark.slow
def test_top_p_below_float32_keeps_only_the_top_token(use_triton: bool) -> None:
    """top_p = 1e-300 rounds to 0 in float32 and 1.2e-38 is the smallest SamplingParams takes: the top
    token always stays, so both sample it, at every position and temperature."""
    logits = 3 * torch.randn(8, 300, generator=torch.Generator().manual_seed(4))  # no ties
    for params in (RawParams(top_p=1e-300), SamplingParams(top_p=1.2e-38), RawParams(temperature=5.0, top_p=1e-300)):
        for position in (0, 1):
            sb = SamplingBatch.build([params] * 8, list(range(8)), [position] * 8, 300, "cpu")
            assert torch.equal(sample(logits, sb, use_triton=use_triton).token_ids, logits.argmax(-1))


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # x * 1/T -> -inf, as intended
@pytest.mark.parametrize("use_triton", BACKENDS)
def test_extreme_temperatures_are_safe(use_triton: bool) -> None:
    """Temperatures whose 1/T overflows float32 (1e-45 is subnormal, 1/1e-45 is inf) give the argmax
    and finite logprobs (processed: log 1 = 0); a huge one gives a uniform processed distribution."""
    logits = 3 * torch.randn(6, 400, generator=torch.Generator().manual_seed(2))
    for t in (1e-30, 1e-38, 1e-45):
        sb = SamplingBatch.build([RawParams(temperature=t, logprobs_mode="processed")] * 6, list(range(6)),
                                 [0] * 6, 400, "cpu")
        out = sample(logits, sb, use_triton=use_triton)
        assert torch.equal(out.token_ids, logits.argmax(-1)) and torch.equal(out.logprobs, torch.zeros(6))
    sb = SamplingBatch.build([RawParams(temperature=1e30, logprobs_mode="processed")] * 6, list(range(6)), [0] * 6,
                             400, "cpu")
    out = sample(logits, sb, use_triton=use_triton)
    torch.testing.assert_close(out.logprobs, torch.full((6,), -math.log(400)))
    assert not torch.equal(out.token_ids, logits.argmax(-1))


def test_ties_at_a_threshold_all_stay() -> None:
    """Tokens tied at top-k's threshold all stay (the kept set depends on values, not on an order): with
    top_k=1 and two tokens tied at the max, both are drawn, nothing else is; greedy takes the first."""
    logits = torch.zeros(1, 50, dtype=torch.bfloat16)
    logits[0, 7] = logits[0, 30] = 2.0
    n = 400
    sb = SamplingBatch.build([SamplingParams(top_k=1)] * n, [5] * n, list(range(n)), 50, "cpu")
    drawn = torch.bincount(sample(logits.expand(n, 50), sb).token_ids, minlength=50)
    assert set(drawn.nonzero().flatten().tolist()) == {7, 30} and min(drawn[7], drawn[30]) > n // 4
    greedy = SamplingBatch.build([SamplingParams(temperature=0.0)], [5], [0], 50, "cpu")
    assert int(sample(logits, greedy).token_ids[0]) == 7


def unseeded_tokens(llm: LLM, seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
    runner = llm.worker.runner
    return runner._sample(logits, runner._sampling_batch(seqs), False).pairs[:, 0].long().tolist()


@pytest.mark.slow
def test_runners_with_one_seed_pick_the_same_unseeded_tokens() -> None:
    """TP ranks are runners with one seed and one schedule: they pick the same unseeded tokens step
    after step without exchanging anything, even over Sequence objects of their own (ids differ, as
    between processes); the noise moves on with the position and with a new list of rows; a runner
    with another seed picks other tokens."""
    a, b, c = (LLM(None, device="cpu", max_num_seqs=8, seed=s) for s in (7, 7, 8))
    vocab = a.model_config.vocab_size
    params = SamplingParams(temperature=1.0, top_p=0.95)
    seqs_a, seqs_b, seqs_c = ([Sequence("r", i, [1, 2, 3], params) for i in range(6)] for _ in range(3))
    picks_a, picks_c = [], []
    for step in range(4):
        logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(step % 2))
        rows = slice(None) if step < 3 else slice(1, None)  # step 3: sequence 0 has finished
        picks_a.append(unseeded_tokens(a, seqs_a[rows], logits[rows]))
        assert unseeded_tokens(b, seqs_b[rows], logits[rows]) == picks_a[-1]
        picks_c.append(unseeded_tokens(c, seqs_c[rows], logits[rows]))
        for seqs in (seqs_a, seqs_b, seqs_c):
            for seq, tok in zip(seqs[rows], picks_a[-1]):
                seq.append(tok, 0.0)
    assert picks_a != picks_c
    assert picks_a[0] != picks_a[2] and picks_a[1][1:] != picks_a[3]  # same logits, other positions / rows


def test_runner_builds_row_tensors_once_per_list_of_rows() -> None:
    """The same sequences in the same order keep their row tensors; a step sends only positions;
    unchanged positions give back the same batch; another order builds new rows."""
    llm = LLM(None, device="cpu", max_num_seqs=4)
    runner = llm.worker.runner
    seqs = [Sequence("s", 0, [5, 6], SamplingParams(temperature=1.0, seed=3)),
            Sequence("t", 0, [7], SamplingParams(temperature=0.5, top_k=4))]
    one = runner._sampling_batch(seqs)
    assert runner._sampling_batch(seqs) is one
    for seq in seqs:
        seq.append(9, -1.0)
    two = runner._sampling_batch(seqs)
    assert two is not one and two.greedy is one.greedy and two.seeds is one.seeds
    assert one.positions.tolist() == [0, 0] and two.positions.tolist() == [1, 1]
    assert runner._sampling_batch(seqs[::-1]).greedy is not one.greedy
