"""FP8 linears (EngineConfig.quantization = "fp8"): the GEMV reading FP8 weights in Triton's interpreter,
_scaled_mm and graph capture under `cuda`, all held to dequantize-then-matmul; the layers' loaders install
the rule's bytes (TP shards are slices of the whole tensor's); an FP8 model equals the same model loaded
from offline-dequantized weights."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from inference.core import InvalidRequestError
from inference.layers.fp8_linear import fp8_linear, use_fp8_gemv, use_scaled_mm
from inference.layers.gemv import GemvConfig, gemv
from inference.layers.kernel_device import interpreted_on_cpu
from inference.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from inference.models.build import build_model
from inference.models.hf_config import read_model_config
from inference.models.loader import init_dummy_weights, load_weights
from inference.parallel import TPInfo
from inference.quant.fp8 import FP8_DTYPE, dequantize_rows, quantize_rows
from tests.test_fp8_engine import dequantized_copy


@pytest.fixture
def kernels_on_cpu() -> Iterator[None]:
    with interpreted_on_cpu():
        yield


def _fp8_operands(m: int, n: int, k: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(device=device, dtype=dtype)
    w = torch.randn(n, k, generator=g) * k ** -0.5 * torch.logspace(-1, 1, n)[:, None]  # rows of many scales
    q, scale = quantize_rows(w.to(device), "w")
    b = torch.randn(n, generator=g).to(device=device, dtype=dtype)
    return x, q, scale, b


def _reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """Dequantize, then the fp32 product, rounded once to x's dtype."""
    w = dequantize_rows(q, scale, torch.float32)
    return F.linear(x.float(), w, None if b is None else b.float()).to(x.dtype)


def _close(got: torch.Tensor, expected: torch.Tensor, atol: float = 3e-2) -> None:
    assert got.shape == expected.shape and got.dtype == expected.dtype
    torch.testing.assert_close(got.float(), expected.float(), atol=atol, rtol=2 ** -6)


@pytest.mark.usefixtures("kernels_on_cpu")
@pytest.mark.parametrize("kind", ["lanes", "reduce", "dot"])
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp8_gemv_matches_dequantize_then_matmul(kind: str, split_k: int, with_bias: bool) -> None:
    # fp16 for "dot": Triton's interpreter computes a bf16 tl.dot wrongly (tests/test_gemv.py)
    dtype = torch.float16 if kind == "dot" else torch.bfloat16
    x, q, scale, b = _fp8_operands(3, 45, 200, dtype)
    bias = b if with_bias else None
    cfg = GemvConfig(block_n=16 if kind == "dot" else 8, block_k=32, split_k=split_k, kind=kind)
    _close(gemv(x, q, bias, config=cfg, scale=scale), _reference(x, q, scale, bias))


@pytest.mark.usefixtures("kernels_on_cpu")
@pytest.mark.parametrize("m", [1, 4, 8])
def test_fp8_linear_routes_decode_rows_to_the_gemv(m: int) -> None:
    # several rows pick "dot": fp16 there (the interpreter's bf16 tl.dot is wrong)
    x, q, scale, b = _fp8_operands(m, 37, 70, torch.bfloat16 if m == 1 else torch.float16, seed=m)
    assert use_fp8_gemv(x, q) and not use_scaled_mm(x, q)  # CPU: no _scaled_mm
    _close(fp8_linear(x, q, scale, b), _reference(x, q, scale, b))
    assert not use_fp8_gemv(x.repeat(9, 1), q)  # past FP8_GEMV_MAX_M rows


def test_fp8_linear_off_the_kernels_is_the_reference() -> None:
    """CPU outside the interpreter (and fp32 anywhere): dequantize_rows then F.linear, bit for bit."""
    x, q, scale, b = _fp8_operands(5, 24, 40, torch.float32)
    expected = F.linear(x, dequantize_rows(q, scale, torch.float32), b)
    assert torch.equal(fp8_linear(x, q, scale, b), expected)
    # the batch-invariant mode dequantizes into its invariant GEMM (its own K order)
    torch.testing.assert_close(fp8_linear(x, q, scale, b, invariant=True), expected)


def _full(n: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


@pytest.mark.parametrize("tp_size", [1, 2])
def test_loaders_install_slices_of_the_whole_tensors_bytes(tp_size: int) -> None:
    """Every TP size installs the same bytes: a column shard's rows and a row shard's columns of
    quantize_rows(full), a row shard keeping the whole row's scale."""
    for rank in range(tp_size):
        tp = TPInfo(rank=rank, size=tp_size, group=None if tp_size == 1 else object())  # loaders only
        qkv = QKVParallelLinear(16, 4, 4, 2, False, tp, torch.bfloat16, "cpu", fp8=True)
        parts = {"q": _full(16, 16, 1), "k": _full(8, 16, 2), "v": _full(8, 16, 3)}
        for sid, full in parts.items():
            qkv.weight_loader(qkv.weight, full, sid)
        expected_q, expected_s = [], []
        for full in parts.values():
            rows = full.shape[0] // tp_size
            q, s = quantize_rows(full, "full")
            expected_q.append(q[rank * rows:(rank + 1) * rows])
            expected_s.append(s[rank * rows:(rank + 1) * rows])
        assert qkv.weight.dtype == FP8_DTYPE
        assert torch.equal(qkv.weight.view(torch.uint8), torch.cat(expected_q).view(torch.uint8))
        assert torch.equal(qkv.weight_scale, torch.cat(expected_s))

        down = RowParallelLinear(32, 16, False, tp, torch.bfloat16, "cpu", fp8=True)
        full = _full(16, 32, 4)
        down.weight_loader(down.weight, full)
        q, s = quantize_rows(full, "full")
        cols = 32 // tp_size
        assert torch.equal(down.weight.view(torch.uint8), q[:, rank * cols:(rank + 1) * cols].view(torch.uint8))
        assert torch.equal(down.weight_scale, s)

        gate_up = MergedColumnParallelLinear(16, [24, 24], False, tp, torch.bfloat16, "cpu", fp8=True)
        assert gate_up.weight.dtype == FP8_DTYPE and gate_up.weight_scale.shape == (48 // tp_size,)
        assert "weight_scale" not in dict(gate_up.named_parameters())  # parameter names stay the HF names


def test_a_non_finite_checkpoint_tensor_is_refused_by_name(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from tests.helpers_models import make_hf_checkpoint

    make_hf_checkpoint("qwen2", tmp_path)
    (path,) = tmp_path.glob("*.safetensors")
    tensors = load_file(str(path))
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = float("nan")
    save_file(tensors, str(path), metadata={"format": "pt"})
    config = read_model_config(tmp_path)
    model = build_model(config, TPInfo(), torch.float32, "cpu", quantization="fp8")
    with pytest.raises(InvalidRequestError, match="non-finite") as e:
        load_weights(model, tmp_path)
    assert e.value.field == "model.layers.1.mlp.up_proj.weight"


def test_fp8_model_equals_the_offline_dequantized_model(tmp_path: Path) -> None:
    """Loading bf16 with quantization="fp8" computes what the dequantized weights compute (CPU: the
    reference path, so bit for bit), and the logits differ from the unquantized model's."""
    from tests.helpers_models import make_hf_checkpoint

    make_hf_checkpoint("qwen3", tmp_path / "hf")
    dequantized_copy(tmp_path / "hf", tmp_path / "deq")
    config = read_model_config(tmp_path / "hf")
    fp8 = build_model(config, TPInfo(), torch.float32, "cpu", quantization="fp8")
    load_weights(fp8, tmp_path / "hf")
    deq = build_model(config, TPInfo(), torch.float32, "cpu")
    load_weights(deq, tmp_path / "deq")
    plain = build_model(config, TPInfo(), torch.float32, "cpu")
    load_weights(plain, tmp_path / "hf")
    x = torch.randn(6, config.hidden_size)
    for ours, offline, unquantized in zip(fp8.model.layers, deq.model.layers, plain.model.layers, strict=True):
        assert torch.equal(ours.self_attn.qkv_proj(x), offline.self_attn.qkv_proj(x))
        assert torch.equal(ours.mlp(x), offline.mlp(x))
        assert not torch.equal(ours.mlp(x), unquantized.mlp(x))
        h = torch.randn(6, ours.self_attn.o_proj.in_features_local)
        assert torch.equal(ours.self_attn.o_proj(h), offline.self_attn.o_proj(h))


def test_dummy_weights_in_fp8(tmp_path: Path) -> None:
    from tests.helpers_models import make_hf_checkpoint

    make_hf_checkpoint("llama", tmp_path)
    model = build_model(read_model_config(tmp_path), TPInfo(), torch.float32, "cpu", quantization="fp8")
    init_dummy_weights(model, seed=1)
    proj = model.model.layers[0].mlp.down_proj
    assert proj.weight.dtype == FP8_DTYPE and bool(torch.isfinite(proj.weight_scale).all())
    assert proj.weight.float().abs().amax(dim=1).eq(448.0).all()  # each row's amax lands on the top code


@pytest.mark.usefixtures("kernels_on_cpu")
def test_fp8_norm_and_silu_prologues_match_the_unfused_products() -> None:
    """At one row the RMSNorm and SiLU-and-multiply run in the FP8 GEMV's prologue, as in bf16."""
    from inference.layers.fused import add_rms_norm_torch, silu_and_mul_torch
    from inference.layers.gemv import norm_gemv, silu_mul_gemv, use_norm_gemv, use_silu_mul_gemv

    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, 96, generator=g).to(torch.bfloat16)
    residual = torch.randn(1, 96, generator=g).to(torch.bfloat16)
    norm_w = (torch.rand(96, generator=g) + 0.5).to(torch.bfloat16)
    _, q, scale, b = _fp8_operands(1, 40, 96, torch.bfloat16, seed=6)
    assert use_norm_gemv(x, q, norm_w, residual)
    y, s = norm_gemv(x, residual, norm_w, 1e-6, q, b, scale=scale)
    h, s_ref = add_rms_norm_torch(x, residual, norm_w, 1e-6)
    # the interpreter truncates its bf16 roundings where the GPU rounds (tests/test_gemv.py): an ulp per input
    _close(s, s_ref)
    _close(y, _reference(h, q, scale, b), atol=6e-2)

    gate_up = torch.randn(1, 2 * 96, generator=g).to(torch.bfloat16)
    assert use_silu_mul_gemv(gate_up, q)
    _close(silu_mul_gemv(gate_up, q, scale=scale), _reference(silu_and_mul_torch(gate_up), q, scale, None),
           atol=6e-2)
