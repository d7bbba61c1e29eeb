"""norm_gemv (residual add + RMSNorm in the GEMV's prologue) gives the same bits as add_rms_norm followed by
gemv with the same config, and a decoder's one-row steps take it (Triton's interpreter on CPU; Qwen2-0.5B
shapes under `cuda`)."""

from __future__ import annotations

import contextvars
from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("triton")

from inference.config import ModelConfig, RopeConfig
from inference.layers import fused, norm
from inference.layers.gemv import NORM_MAX_K, ROUTE_MAX_M, GemvConfig, gemv, norm_gemv, pick_config, use_norm_gemv
from inference.layers.kernel_device import interpreted_on_cpu, num_sms, use_triton
from inference.models import build_model
from inference.parallel import TPInfo
from tests.helpers_models import ToyPager

EPS = 1e-6


@pytest.fixture(autouse=True)
def _kernels_on_cpu() -> Iterator[None]:
    with interpreted_on_cpu():
        yield


def _rand(*shape: int, dtype: torch.dtype, device: str, seed: int, scale: float = 1.0,
          shift: float = 0.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale + shift).to(device=device, dtype=dtype)


def _operands(m: int, n: int, k: int, dtype: torch.dtype, device: str = "cpu") -> dict[str, torch.Tensor]:
    return {"x": _rand(m, k, dtype=dtype, device=device, seed=m, scale=3.0),
            "residual": _rand(m, k, dtype=dtype, device=device, seed=m + 50, scale=3.0),
            "norm_weight": _rand(k, dtype=dtype, device=device, seed=k, scale=0.2, shift=1.0),
            "weight": _rand(n, k, dtype=dtype, device=device, seed=n, scale=k ** -0.5),
            "bias": _rand(n, dtype=dtype, device=device, seed=n + k)}


def check_equals_unfused(ops: dict[str, torch.Tensor], with_res: bool, with_bias: bool,
                         config: GemvConfig | None) -> None:
    """norm_gemv against the two separate Triton launches, bit for bit; residual_out against the eager add."""
    x, nw, w = ops["x"], ops["norm_weight"], ops["weight"]
    res = ops["residual"] if with_res else None
    bias = ops["bias"] if with_bias else None
    assert use_norm_gemv(x, w, nw, res) == (x.shape[0] <= ROUTE_MAX_M) and use_triton(x)
    x_before, res_before = x.clone(), None if res is None else res.clone()
    y, res_out = norm_gemv(x, res, nw, EPS, w, bias, config=config)
    h, ref_res = fused.add_rms_norm(x, res, nw, EPS)
    # config None: norm_gemv's own default shape, which the plain GEMV must be given to sum in the same order
    same = config or pick_config(x.shape[0], w.shape[0], x.shape[1], num_sms(x.device), "norm")
    assert torch.equal(y, gemv(h, w, bias, config=same))
    assert torch.equal(res_out, ref_res)
    if res is None:
        assert res_out is x
    else:
        eager = x_before + res_before
        if x.is_cuda or x.dtype == torch.float16:
            assert torch.equal(res_out, eager)
        else:  # Triton's CPU interpreter truncates to bf16 where torch and the GPU round to nearest
            torch.testing.assert_close(res_out, eager, atol=0, rtol=2 ** -7)
        assert res_out.data_ptr() not in (x.data_ptr(), res.data_ptr())
    assert torch.equal(x, x_before) and (res is None or torch.equal(res, res_before))


# (N, K): K not a power of two and not a multiple of the K block; the split configs take 2 and 3 splits.
CONFIGS = [GemvConfig(block_n=4, block_k=32, kind="lanes"),
           GemvConfig(block_n=4, block_k=32, split_k=3, kind="reduce"),
           GemvConfig(block_n=16, block_k=32, split_k=2, kind="dot")]


@pytest.mark.parametrize("m", range(1, 9))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_norm_gemv_equals_add_rms_norm_then_gemv(m: int, dtype: torch.dtype) -> None:
    ops = _operands(m, 12, 112, dtype)
    for i, cfg in enumerate(CONFIGS):
        # every (residual, bias) pair meets every config across the parametrization
        check_equals_unfused(ops, with_res=(m + i) % 2 == 0, with_bias=(m // 2 + i) % 2 == 0, config=cfg)


@pytest.mark.parametrize("with_res", [False, True])
def test_norm_gemv_default_config(with_res: bool) -> None:
    ops = _operands(3, 24, 200, torch.float16)
    check_equals_unfused(ops, with_res, with_bias=True, config=None)


def test_use_norm_gemv_guards() -> None:
    ops = _operands(1, 8, 64, torch.bfloat16)
    x, r, nw, w = ops["x"], ops["residual"], ops["norm_weight"], ops["weight"]
    assert use_norm_gemv(x, w, nw) and use_norm_gemv(x, w, nw, r)
    assert not use_norm_gemv(x, w, nw.half())
    assert not use_norm_gemv(x, w, nw, r.half())
    assert not use_norm_gemv(x, w, nw, torch.cat([r, r]))
    assert not use_norm_gemv(torch.cat([x, x]), w, nw)  # 2 rows: cuBLAS
    wide = _operands(1, 8, NORM_MAX_K + 16, torch.bfloat16)  # a row wider than one norm block
    assert not use_norm_gemv(wide["x"], wide["weight"], wide["norm_weight"])
    assert not contextvars.Context().run(use_norm_gemv, x, w, nw)  # CPU tensors outside the interpreter's scope


# ---- a tiny decoder -------------------------------------------------------------------------------------
def _tiny_model(dtype: torch.dtype) -> torch.nn.Module:
    config = ModelConfig(family="qwen2", vocab_size=32, hidden_size=40, intermediate_size=48, num_layers=2,
                         num_heads=2, num_kv_heads=1, head_dim=16, rms_norm_eps=EPS, rope=RopeConfig(),
                         max_position_embeddings=64, tie_word_embeddings=True, qkv_bias=True, qk_norm=False)
    model = build_model(config, TPInfo(), dtype, "cpu")
    for i, (name, p) in enumerate(model.named_parameters()):
        shift = 1.0 if name.endswith("norm.weight") else 0.0
        p.data.copy_(_rand(*p.shape, dtype=dtype, device="cpu", seed=200 + i, scale=p.shape[-1] ** -0.5,
                           shift=shift))
    model.bind_kv_cache(torch.zeros(model.kv_cache_spec().shape(8, 4), dtype=dtype))
    return model


def _run_steps() -> list[torch.Tensor]:
    """One sequence: a 3-token prefill, then two one-row decode steps; the hidden states of each step."""
    model, pager = _tiny_model(torch.float16), ToyPager(8, 4)  # fp16: the interpreter truncates bf16
    hidden = []
    with torch.no_grad():
        for step in ({0: [3, 7, 9]}, {0: [11]}, {0: [12]}):
            input_ids, positions, meta = pager.step(step)
            hidden.append(model(input_ids, positions, meta))
    return hidden


@pytest.mark.slow
def test_decoder_forms_its_pre_norms_in_the_gemv_at_one_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """The one-row decode steps run both pre-norms of every layer in the qkv / gate_up GEMV's prologue (the
    first layer without a residual, the next with one), the prefill in add_rms_norm; every step's hidden
    states stay within rounding of the same decoder on torch (CPU tensors outside the interpreter's scope)."""
    calls: list[bool] = []
    counted = norm.norm_gemv
    monkeypatch.setattr(norm, "norm_gemv", lambda x, r, *a, **kw: calls.append(r is None) or counted(x, r, *a, **kw))
    on_kernels = _run_steps()
    assert len(calls) == 2 * 2 * 2  # two per layer, in the two decode steps only
    assert calls.count(True) == 2  # the first layer's input norm of each decode step has no residual yet
    on_torch = contextvars.Context().run(_run_steps)
    assert len(calls) == 8
    for got, want in zip(on_kernels, on_torch):
        torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=2 ** -9)


# ---- on the GPU: Qwen2-0.5B shapes ----------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("m", [1, 2, 8])
@pytest.mark.parametrize("n", [1152, 9728])  # qkv and gate_up of Qwen2-0.5B (hidden 896)
@pytest.mark.parametrize("with_res", [False, True])
def test_norm_gemv_real_shapes_cuda(m: int, n: int, with_res: bool) -> None:
    ops = _operands(m, n, 896, torch.bfloat16, device="cuda")
    check_equals_unfused(ops, with_res, with_bias=n == 1152, config=None)
    # and close to eager torch (a bug shared by both Triton paths would not show above)
    h = fused.add_rms_norm_torch(ops["x"], ops["residual"], ops["norm_weight"], EPS)[0]
    got = norm_gemv(ops["x"], ops["residual"], ops["norm_weight"], EPS, ops["weight"])[0]
    torch.testing.assert_close(got.float(), torch.nn.functional.linear(h, ops["weight"]).float(),
                               atol=2e-2, rtol=2 ** -6)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["lanes", "reduce", "dot"])
def test_norm_gemv_split_k_cuda(kind: str) -> None:
    ops = _operands(4, 1152, 896, torch.bfloat16, device="cuda")
    cfg = GemvConfig(block_n=16 if kind == "dot" else 4, block_k=128, split_k=2, kind=kind)
    check_equals_unfused(ops, with_res=True, with_bias=True, config=cfg)


@pytest.mark.cuda
def test_norm_gemv_graph_replay_equals_eager_cuda() -> None:
    ops = _operands(2, 1152, 896, torch.bfloat16, device="cuda")
    x, r, nw, w, b = ops["x"], ops["residual"], ops["norm_weight"], ops["weight"], ops["bias"]
    norm_gemv(x, r, nw, EPS, w, b)  # compile outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        y, res_out = norm_gemv(x, r, nw, EPS, w, b)
    torch.cuda.current_stream().wait_stream(stream)
    x.copy_(_rand(2, 896, dtype=x.dtype, device="cuda", seed=99, scale=3.0))
    graph.replay()
    torch.cuda.synchronize()
    y_eager, res_eager = norm_gemv(x, r, nw, EPS, w, b)
    assert torch.equal(y, y_eager) and torch.equal(res_out, res_eager)
