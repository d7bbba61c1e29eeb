"""The small-M Triton GEMV equals F.linear (Triton's interpreter on CPU, real shapes under `cuda`)."""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from inference.layers import gemv as gemv_mod
from inference.layers.fused import silu_and_mul_torch
from inference.layers.gemv import ROUTE_MAX_M, GemvConfig, gemv, pick_config, silu_mul_gemv, use_gemv
from inference.layers.kernel_device import interpreted_on_cpu
from inference.layers.linear import QKVParallelLinear, RowParallelLinear
from inference.models.decoder import DecoderMLP, _Build
from inference.parallel import TPInfo


@pytest.fixture(autouse=True)
def _kernels_on_cpu() -> Iterator[None]:
    with interpreted_on_cpu():
        yield


def _rand(*shape: int, dtype: torch.dtype, device: str, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)


def _operands(m: int, n: int, k: int, dtype: torch.dtype = torch.bfloat16,
              device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [m, k], weight [n, k] scaled so outputs are O(1), bias [n]."""
    return (_rand(m, k, dtype=dtype, device=device, seed=m),
            _rand(n, k, dtype=dtype, device=device, seed=n, scale=k ** -0.5),
            _rand(n, dtype=dtype, device=device, seed=k))


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """The fp32 product, rounded once to the operands' dtype."""
    return F.linear(x.float(), w.float(), None if b is None else b.float()).to(x.dtype)


def close(got: torch.Tensor, expected: torch.Tensor, atol: float = 2e-2) -> None:
    """Within two ulps of the output dtype: both sides accumulate in fp32 and round once, in a different
    order (and Triton's CPU interpreter truncates where the GPU rounds)."""
    assert got.shape == expected.shape and got.dtype == expected.dtype, (got.shape, got.dtype)
    torch.testing.assert_close(got.float(), expected.float(), atol=atol, rtol=2 ** -6)


SHAPES = [(37, 70), (130, 300), (5, 1100)]  # (N, K): none a multiple of a block


@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_matches_linear(m: int, n: int, k: int, with_bias: bool) -> None:
    x, w, b = _operands(m, n, k, dtype=torch.float16)  # bf16 per kind below: the default may be "dot"
    bias = b if with_bias else None
    assert use_gemv(x, w) == (m <= ROUTE_MAX_M)  # the kernel takes up to MAX_M rows; linears route fewer
    close(gemv(x, w, bias), _reference(x, w, bias))


KINDS = ["lanes", "reduce", "dot"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("split_k", [1, 2, 3])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_split_k_and_kinds(kind: str, split_k: int, with_bias: bool) -> None:
    x, w, b = _operands(3, 45, 200, dtype=torch.float16 if kind == "dot" else torch.bfloat16)
    bias = b if with_bias else None
    cfg = GemvConfig(block_n=16 if kind == "dot" else 8, block_k=32, split_k=split_k, kind=kind)
    close(gemv(x, w, bias, config=cfg), _reference(x, w, bias))


def _split_sum_is_in_split_order(device: str) -> None:
    """Split-K: the second launch sums the fp32 partials in split order (+ bias), so the result is the same
    bits at every launch (a graph replay equals eager), within rounding of the fp32 product."""
    x, w, b = _operands(3, 45, 200, dtype=torch.float16, device=device)
    for kind in KINDS:
        cfg = GemvConfig(block_n=16 if kind == "dot" else 8, block_k=32, split_k=3, kind=kind)
        assert gemv_mod.split_k_plan(200, 3, 32) == (96, 3)  # three splits: 96, 96 and 8 columns
        first = gemv(x, w, b, config=cfg)
        assert torch.equal(gemv(x, w, b, config=cfg), first), kind
        close(first, _reference(x, w, b))


@pytest.mark.slow
def test_split_k_sum_is_deterministic() -> None:
    _split_sum_is_in_split_order("cpu")


@pytest.mark.cuda
def test_split_k_sum_is_deterministic_cuda() -> None:
    _split_sum_is_in_split_order("cuda")


def test_gemv_reads_strided_rows() -> None:
    x, w, b = _operands(4, 33, 96, dtype=torch.float16)
    wide = torch.cat([x, x], dim=1)[:, :96]  # rows with stride 192
    assert not wide.is_contiguous() and use_gemv(wide[:1], w)
    close(gemv(wide, w, b), _reference(x, w, b))


@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("split_k", [1, 2])
@pytest.mark.parametrize("kind", KINDS)
def test_silu_mul_gemv_matches_unfused(m: int, split_k: int, kind: str) -> None:
    i, n = 150, 41
    dtype = torch.float16 if kind == "dot" else torch.bfloat16  # Triton 3.x's interpreter: bf16 tl.dot is wrong
    gate_up = _rand(m, 2 * i, dtype=dtype, device="cpu", seed=7, scale=2.0)
    w = _rand(n, i, dtype=dtype, device="cpu", seed=8, scale=i ** -0.5)
    cfg = GemvConfig(block_n=16 if kind == "dot" else 4, block_k=64, split_k=split_k, kind=kind)
    # The interpreter truncates the rounded activation (eager rounds to nearest): a bias of up to one
    # bf16 ulp per activation that does not cancel in the sum.
    close(silu_mul_gemv(gate_up, w, config=cfg), _reference(silu_and_mul_torch(gate_up), w, None), atol=6e-2)


def test_decode_routes_only_one_row_to_the_gemv() -> None:
    """2-8 rows go to cuBLAS, which ran them faster on the H200."""
    x, w, _ = _operands(2, 16, 32)
    assert ROUTE_MAX_M == 1 and use_gemv(x[:1], w) and not use_gemv(x, w)


def test_use_gemv_guards() -> None:
    x, w, _ = _operands(1, 16, 32)
    assert use_gemv(x, w)
    assert not use_gemv(x[:0], w)
    assert not use_gemv(x.float(), w.float())
    assert not use_gemv(x, w.t().contiguous().t())  # a transposed view of the weight
    assert not use_gemv(x.half(), w)
    assert not use_gemv(torch.cat([x, x]), w)  # 2 rows: cuBLAS


def test_cpu_tensors_take_torch_outside_the_interpreter_scope() -> None:
    """Outside interpreted_on_cpu() a CPU tensor never reaches a kernel: the engine on CPU runs torch."""
    x, w, b = _operands(1, 16, 32)
    assert not contextvars.Context().run(use_gemv, x, w)  # a context the fixture never entered
    assert torch.equal(contextvars.Context().run(gemv_mod.linear, x, w, b), F.linear(x, w, b))


def test_linear_falls_back_to_torch_above_max_m() -> None:
    x, w, b = _operands(9, 20, 40)
    assert torch.equal(gemv_mod.linear(x, w, b), F.linear(x, w, b))


@pytest.mark.parametrize(("m", "n", "k"), [(1, 896, 896), (1, 896, 4864), (8, 1152, 896), (8, 896, 4864),
                                           (1, 151936, 896), (4, 4608, 3584), (1, 3584, 18944)])
def test_pick_config_fills_the_h200(m: int, n: int, k: int) -> None:
    """Programs on every SM, a "lanes" accumulator of at most 64 fp32 per thread, dot blocks of >= 16 rows,
    and every K split at least two blocks long."""
    cfg = pick_config(m, n, k, num_sms=132)
    assert -(-n // cfg.block_n) * cfg.split_k >= 132 or (m > 1 and n <= 2048)
    if cfg.kind == "lanes":
        assert cfg.block_m(m) * cfg.block_n * cfg.block_k <= 64 * 32 * cfg.num_warps
    else:
        assert cfg.kind == "dot" and cfg.block_n >= 16
    assert cfg.split_k == 1 or k >= 2 * cfg.split_k * cfg.block_k


def test_silu_mul_gemv_only_for_one_row_and_small_weights() -> None:
    w = torch.zeros(8, 16, dtype=torch.bfloat16)
    assert gemv_mod.use_silu_mul_gemv(torch.zeros(1, 32, dtype=torch.bfloat16), w)
    assert not gemv_mod.use_silu_mul_gemv(torch.zeros(2, 32, dtype=torch.bfloat16), w)
    big = torch.zeros(gemv_mod.SILU_MUL_MAX_WEIGHT // 1024 + 1, 1024, dtype=torch.bfloat16)  # one row too many
    assert gemv_mod.use_gemv(torch.zeros(1, 1024, dtype=torch.bfloat16), big)
    assert not gemv_mod.use_silu_mul_gemv(torch.zeros(1, 2048, dtype=torch.bfloat16), big)


def _filled(module: torch.nn.Module) -> torch.nn.Module:
    for i, p in enumerate(module.parameters()):
        p.data.copy_(_rand(*p.shape, dtype=p.dtype, device="cpu", seed=100 + i, scale=p.shape[-1] ** -0.5))
    return module


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.slow
def test_layers_on_gemv_equal_layers_on_torch(m: int) -> None:
    """QKV (bias), o_proj (bias) and the MLP (fused down projection at one row) against the same layers
    on torch (CPU tensors outside the interpreter's scope)."""
    dt, tp = torch.float16, TPInfo()
    config = SimpleNamespace(hidden_size=40, intermediate_size=72, hidden_act="silu")
    layers = [_filled(QKVParallelLinear(40, 8, 3, 1, True, tp, dt, "cpu")),
              _filled(RowParallelLinear(40, 40, True, tp, dt, "cpu")),
              _filled(DecoderMLP(_Build(config, tp, dt, "cpu")))]  # type: ignore[arg-type]
    x = _rand(m, 40, dtype=dt, device="cpu", seed=5)
    got = [layer(x) for layer in layers]
    assert gemv_mod.use_silu_mul_gemv(layers[2].gate_up_proj(x), layers[2].down_proj.weight) == (m == 1)
    for out, layer in zip(got, layers):
        close(out, contextvars.Context().run(layer, x))


# ---- on the GPU ---------------------------------------------------------------------------------
CUDA_SHAPES = [(1152, 896), (896, 896), (9728, 896), (896, 4864), (151936, 896), (4608, 3584), (3584, 18944)]


@pytest.mark.cuda
@pytest.mark.parametrize("m", [1, 2, 5, 8])
@pytest.mark.parametrize(("n", "k"), CUDA_SHAPES)
def test_gemv_real_shapes_cuda(m: int, n: int, k: int) -> None:
    x, w, b = _operands(m, n, k, device="cuda")
    assert use_gemv(x, w) == (m <= ROUTE_MAX_M)
    close(gemv(x, w, b), _reference(x, w, b))
    close(gemv(x, w), _reference(x, w, None))


@pytest.mark.cuda
@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.parametrize(("i", "n"), [(4864, 896), (18944, 3584)])
def test_silu_mul_gemv_real_shapes_cuda(m: int, i: int, n: int) -> None:
    gate_up = _rand(m, 2 * i, dtype=torch.bfloat16, device="cuda", seed=3, scale=2.0)
    w = _rand(n, i, dtype=torch.bfloat16, device="cuda", seed=4, scale=i ** -0.5)
    close(silu_mul_gemv(gate_up, w), _reference(silu_and_mul_torch(gate_up), w, None))


@pytest.mark.cuda
@pytest.mark.parametrize(("n", "k"), [(1152, 896), (896, 4864)])  # one plain, one split-K
def test_gemv_graph_replay_equals_eager_cuda(n: int, k: int) -> None:
    x, w, b = _operands(4, n, k, device="cuda")
    eager = gemv(x, w, b)
    fused_eager = silu_mul_gemv(torch.cat([x, x], dim=1), w)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out = gemv(x, w, b)
        fused_out = silu_mul_gemv(torch.cat([x, x], dim=1), w)
    torch.cuda.current_stream().wait_stream(stream)
    x.copy_(_rand(4, k, dtype=x.dtype, device="cuda", seed=99))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, gemv(x, w, b))
    assert torch.equal(fused_out, silu_mul_gemv(torch.cat([x, x], dim=1), w))
    assert not torch.equal(out, eager) and not torch.equal(fused_out, fused_eager)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("m", [1, 8])
def test_gemv_kinds_real_shape_cuda(kind: str, m: int) -> None:
    x, w, b = _operands(m, 896, 4864, device="cuda")
    cfg = GemvConfig(block_n=16 if kind == "dot" else 4, block_k=256, split_k=2, kind=kind)
    close(gemv(x, w, b, config=cfg), _reference(x, w, b))
    close(silu_mul_gemv(torch.cat([x, x], dim=1), w, config=cfg),
          _reference(silu_and_mul_torch(torch.cat([x, x], dim=1)), w, None))


@pytest.mark.parametrize(("n", "k", "prologue"), [(1152, 896, "norm"), (9728, 896, "norm"), (896, 4864, "silu"),
                                                  (8, 16, "silu")])
def test_pick_config_one_row_prologues(n: int, k: int, prologue: str) -> None:
    """A row formed in the kernel (norm_gemv, silu_mul_gemv) takes its own shapes: "lanes" (no tensor
    cores), an accumulator of at most 64 fp32 per thread, no split under the norm (every split would
    redo the variance), and silu's K splits of at most two blocks. Several rows keep the plain shapes."""
    cfg = pick_config(1, n, k, num_sms=132, prologue=prologue)
    assert cfg.kind == "lanes" and cfg.block_n * cfg.block_k <= 64 * 32 * cfg.num_warps
    if prologue == "norm":
        assert cfg.split_k == 1
    else:
        assert 1 <= cfg.split_k <= 4 and -(-k // cfg.split_k) <= 2 * cfg.block_k
    assert pick_config(2, n, k, num_sms=132, prologue=prologue) == pick_config(2, n, k, num_sms=132)


@pytest.mark.parametrize("n", [4608, 37888])  # Qwen2.5-7B qkv and gate_up: K = 3584, not swept with the norm
def test_pick_config_norm_beyond_the_swept_width_keeps_the_plain_shape(n: int) -> None:
    assert pick_config(1, n, 3584, num_sms=132, prologue="norm") == pick_config(1, n, 3584, num_sms=132)
