"""The fused Triton kernels equal their eager twins (Triton's interpreter on CPU, the GPU under `cuda`)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("triton")

from inference.layers import fused
from inference.layers.kernel_device import interpreted_on_cpu, use_triton

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
DTYPES = [torch.float32, torch.bfloat16]


def close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """fp32: equal up to exp/rsqrt ulps. bf16: within one bf16 ulp of the operands on the GPU (a sum of
    rounded products can cancel); Triton's CPU interpreter truncates where the GPU rounds to nearest
    even, and the truncations compound to a few ulps."""
    if got.dtype == torch.bfloat16:
        atol, rtol = (2 ** -8, 2 ** -7) if got.is_cuda else (0.02, 0.03)
        torch.testing.assert_close(got.float(), expected.float(), atol=atol, rtol=rtol)
    else:
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.fixture(autouse=True)
def _kernels_on_cpu() -> Iterator[None]:
    with interpreted_on_cpu():
        yield


def _rand(*shape: int, dtype: torch.dtype, device: str, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96, 896])
def test_add_rms_norm_matches_eager(device: str, dtype: torch.dtype, hidden: int) -> None:
    x, r = _rand(7, hidden, dtype=dtype, device=device), _rand(7, hidden, dtype=dtype, device=device, seed=1)
    w = _rand(hidden, dtype=dtype, device=device, seed=2)
    assert use_triton(x)
    out, res = fused.add_rms_norm(x, r, w, 1e-6)
    ref_out, ref_res = fused.add_rms_norm_torch(x, r, w, 1e-6)
    close(res, ref_res)
    close(out, ref_out)
    out1, same = fused.add_rms_norm(x, None, w, 1e-6)
    assert torch.equal(same, x)
    close(out1, fused.add_rms_norm_torch(x, None, w, 1e-6)[0])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_eager(device: str, dtype: torch.dtype) -> None:
    x = _rand(5, 2 * 300, dtype=dtype, device=device)
    close(fused.silu_and_mul(x), fused.silu_and_mul_torch(x))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "head_dim"), [(4, 16), (14, 64), (3, 128)])
def test_rotary_matches_eager_on_strided_views(device: str, dtype: torch.dtype, heads: int, head_dim: int) -> None:
    from inference.config import RopeConfig
    from inference.layers.rotary import RotaryEmbedding

    rot = RotaryEmbedding(head_dim, 64, RopeConfig(theta=10000.0), device)
    qkv = _rand(6, (heads + 2) * head_dim, dtype=dtype, device=device)
    q = qkv[:, : heads * head_dim].view(6, heads, head_dim)  # a strided view, as after the qkv split
    positions = torch.tensor([0, 5, 9, 63, 1, 2], device=device)
    cos, sin = rot.cos_sin_cache[positions].to(dtype).unsqueeze(1).chunk(2, dim=-1)
    expected = fused.rotary_torch(q, torch.cat((cos, cos), -1), torch.cat((sin, sin), -1))
    got = fused.rotary(q, positions, rot.cos_sin_cache)
    if got.is_cuda:  # compiled without FP contraction, the kernel rounds exactly where eager torch does
        assert torch.equal(got, expected), (got - expected).abs().max()
    else:
        close(got, expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_qk_in_one_launch_equals_two_rotations(device: str, dtype: torch.dtype) -> None:
    from inference.config import RopeConfig
    from inference.layers.rotary import RotaryEmbedding

    rot = RotaryEmbedding(64, 32, RopeConfig(theta=500.0), device)
    qkv = _rand(5, (14 + 2 + 2) * 64, dtype=dtype, device=device)
    q, k = qkv[:, :14 * 64].view(5, 14, 64), qkv[:, 14 * 64:16 * 64].view(5, 2, 64)
    positions = torch.tensor([3, 0, 31, 7, 7], device=device)
    q2, k2 = fused.rotary_qk(q, k, positions, rot.cos_sin_cache)
    assert torch.equal(q2, fused.rotary(q, positions, rot.cos_sin_cache))
    assert torch.equal(k2, fused.rotary(k, positions, rot.cos_sin_cache))
