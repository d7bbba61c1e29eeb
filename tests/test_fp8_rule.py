"""The FP8 weight rule (inference/quant/fp8.py) equals an independent reference bit for bit on edge values:
numpy fp32 arithmetic for the scale and the division, and the nearest of the 256 e4m3fn codes (ties to
the even code) for the rounding. CPU here; the same bits on CUDA under `cuda`."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from inference.core import InvalidRequestError
from inference.quant.fp8 import FP8_DTYPE, dequantize_rows, quantize_activations, quantize_rows

_CODES = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float().numpy().astype(np.float64)
_FINITE = np.array([c for c in range(256) if np.isfinite(_CODES[c])])


def _nearest_code(v: float) -> int:
    """The e4m3fn code nearest to v (fp64 distance), ties to the even code; |v| <= 448 here."""
    dist = np.abs(_CODES[_FINITE] - v)
    best = _FINITE[dist == dist.min()]
    if len(best) > 1:  # +0 and -0 tie at v = 0: keep v's sign
        best = [c for c in best if c % 2 == 0] if v != 0 else [128 if np.signbit(v) else 0]
    return int(best[0])


def _reference(w: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(codes [N, K] uint8, scales [N] fp32) by the documented rule, in numpy fp32."""
    w32 = w.float().numpy()
    codes = np.zeros(w32.shape, dtype=np.uint8)
    scales = np.zeros(w32.shape[0], dtype=np.float32)
    for n, row in enumerate(w32):
        amax = np.float32(np.abs(row).max())
        scale = np.float32(1.0) if amax == 0 else max(amax / np.float32(448.0), np.float32(2.0 ** -126))
        scales[n] = scale
        for k, x in enumerate(row):
            v = np.float32(x) / scale
            codes[n, k] = _nearest_code(float(np.clip(v, -448.0, 448.0)))
    return codes, scales


def _edge_weights() -> list[torch.Tensor]:
    tiny = torch.finfo(torch.float32).tiny
    midpoints = torch.tensor([448.0, 1.0 + 1 / 16, 1.0 + 3 / 16, 2 ** -7 + 2 ** -10, 0.5 + 1 / 32, -(1.0 + 1 / 16),
                              0.0, -0.0, 13.0, 2 ** -9])
    return [
        torch.zeros(3, 8),  # zero rows
        torch.full((2, 5), -0.0),
        torch.tensor([[3.0, -3.0, 1.0, -1.0], [-2.5, 2.5, 2.5, 0.0]]),  # amax ties, +a against -a
        midpoints[None, :].clone(),  # amax 448: scale 1, values on e4m3 rounding midpoints
        torch.tensor([[tiny / 4, -tiny / 8, tiny / 2, 0.0], [tiny, 3 * tiny, -tiny, tiny / 1024]]),  # subnormals
        torch.tensor([[3.0e38, -1.0e38, 1.0, 1e-30]]),  # near the fp32 top: 1e-30 underflows to 0
        torch.tensor([[2.0 ** 20, 2.0 ** -20, 7.0, -(2.0 ** 19) * 3]]),
    ]


@pytest.mark.parametrize("case", range(7))
def test_rule_is_the_reference_on_edge_values(case: int) -> None:
    w = _edge_weights()[case]
    q, scale = quantize_rows(w, "edge")
    codes, scales = _reference(w)
    assert q.dtype == FP8_DTYPE and scale.dtype == torch.float32
    assert np.array_equal(scale.numpy().view(np.uint32), scales.view(np.uint32))
    assert np.array_equal(q.view(torch.uint8).numpy(), codes)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rule_is_the_reference_on_random_rows(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(6, 40, generator=g) * torch.logspace(-6, 4, 6)[:, None]).to(dtype)
    q, scale = quantize_rows(w, "random")
    codes, scales = _reference(w)
    assert np.array_equal(scale.numpy().view(np.uint32), scales.view(np.uint32))
    assert np.array_equal(q.view(torch.uint8).numpy(), codes)
    # and dequantized it stays within half an e4m3 step (2^-4 relative) of the row's weights
    back = dequantize_rows(q, scale, torch.float32)
    assert torch.all((back - w.float()).abs() <= w.float().abs() * 2 ** -4 + scale[:, None] * 2 ** -9)


def test_rows_are_independent_of_their_neighbours() -> None:
    """A row's bytes are its own: a row shard (TP, a fused part) quantizes to the slice of the whole."""
    w = torch.randn(16, 24, dtype=torch.bfloat16)
    q, scale = quantize_rows(w, "whole")
    q2, scale2 = quantize_rows(w[4:12], "shard")
    assert torch.equal(q2.view(torch.uint8), q[4:12].view(torch.uint8)) and torch.equal(scale2, scale[4:12])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_weight_of_many_cpu_blocks_is_each_rows_rule_and_is_left_unchanged(dtype: torch.dtype) -> None:
    """On the CPU the rule runs over blocks of rows (1030 rows of 300 here: two blocks): each row still gets
    the bytes it gets alone (the reference's, at the block boundary too), and the weight is not written."""
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(1030, 300, generator=g) * torch.logspace(-3, 2, 1030)[:, None]).to(dtype)
    before = w.clone()
    q, scale = quantize_rows(w, "blocks")
    assert torch.equal(w.view(torch.uint8), before.view(torch.uint8))
    for n in (0, 872, 873, 874, 1029):
        codes, scales = _reference(w[n : n + 1])
        assert np.array_equal(q[n : n + 1].view(torch.uint8).numpy(), codes), n
        assert np.array_equal(scale[n : n + 1].numpy().view(np.uint32), scales.view(np.uint32)), n


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_weights_are_refused_naming_the_tensor(bad: float) -> None:
    w = torch.ones(3, 4, dtype=torch.bfloat16)
    w[1, 2] = bad
    with pytest.raises(InvalidRequestError, match=r"model\.layers\.0\.mlp\.down_proj\.weight.*\[1, 2\]") as e:
        quantize_rows(w, "model.layers.0.mlp.down_proj.weight")
    assert e.value.field == "model.layers.0.mlp.down_proj.weight"


def test_activations_follow_the_same_rule() -> None:
    x = torch.randn(5, 32, dtype=torch.bfloat16)
    qa, sa = quantize_activations(x)
    qw, sw = quantize_rows(x, "x")
    assert torch.equal(qa.view(torch.uint8), qw.view(torch.uint8)) and torch.equal(sa, sw)


@pytest.mark.cuda
def test_cuda_quantizes_to_the_same_bits_as_cpu() -> None:
    cases = [*_edge_weights(), torch.randn(512, 1024, dtype=torch.bfloat16) * 3,
             torch.randn(64, 4096, dtype=torch.float32) * 1e-3]
    for w in cases:
        q, scale = quantize_rows(w, "cpu")
        qc, scalec = quantize_rows(w.cuda(), "cuda")
        assert torch.equal(qc.cpu().view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(scalec.cpu().view(torch.int32), scale.view(torch.int32))
