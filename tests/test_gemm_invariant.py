"""The batch-invariant mode's GEMM (inference/layers/gemm_invariant.py): a row's bits do not depend on the
row count, with and without split-K and with each fused prologue, in Triton's interpreter on CPU
(compiled on a GPU); the decoder layer's routing in the mode; the real weight shapes on the GPU."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from inference.layers import gemv as gemv_mod
from inference.layers.attention import ReferenceAttention
from inference.layers.kernel_device import interpreted_on_cpu
from inference.parallel import TPInfo

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(gemv_mod.triton is None, reason="triton is not installed")

@pytest.fixture
def force_triton() -> Iterator[None]:
    with interpreted_on_cpu():
        yield


ROW_COUNTS = (1, 3, 16, 17, 64, 130)  # inside one 64-row block, across blocks, three blocks


def rows_equal_across_counts(fn, *inputs: torch.Tensor) -> None:
    """fn over windows of every ROW_COUNTS size of the 130-row inputs gives the rows fn(inputs) gives, bit
    for bit (fn returns a tensor or a tuple of tensors); windows start at row 0 and at unaligned rows."""
    full = fn(*inputs)
    full = full if isinstance(full, tuple) else (full,)
    for m in ROW_COUNTS:
        for start in sorted({0, 130 - m, (130 - m) // 2, min(5, 130 - m)}):
            got = fn(*(t[start:start + m] for t in inputs))
            got = got if isinstance(got, tuple) else (got,)
            for g, f in zip(got, full):
                assert torch.equal(g, f[start:start + m]), (m, start)


def _half(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    # fp16: the interpreter's bf16 tl.dot is wrong (see triton_attention_kernels._dot)
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).half().to(DEVICE)


# (N, K, tiles): the picked tiles (split-K at the interpreter's 8 SMs), then one K block per split and none
TILINGS = [(37, 300, None), (130, 300, (32, 64, 1)), (70, 200, (64, 32, 3))]


def _tiles(spec: tuple[int, int, int] | None):
    from inference.layers.gemm_invariant import InvariantTiles

    return None if spec is None else InvariantTiles(block_n=spec[0], block_k=spec[1], split_k=spec[2])


@needs_triton
@pytest.mark.parametrize(("n", "k", "spec"), TILINGS)
def test_invariant_gemm_rows_do_not_depend_on_the_row_count(force_triton: None, n: int, k: int,
                                                            spec: tuple | None) -> None:
    from inference.layers.gemm_invariant import BLOCK_M, invariant_gemm, invariant_linear, invariant_tiles

    x, w, b = _half(130, k, seed=k), _half(n, k, seed=n, scale=k ** -0.5), _half(n, seed=1)
    tiles = _tiles(spec)
    assert spec is not None or invariant_tiles(n, k, x.device).split_k > 1
    rows_equal_across_counts(lambda t: invariant_gemm(t, w, b, tiles), x)
    torch.testing.assert_close(invariant_gemm(x, w, b, tiles).float(), F.linear(x.float(), w.float(), b.float()),
                               atol=2e-2, rtol=2 ** -6)
    assert torch.equal(invariant_linear(x, w, b), invariant_gemm(x, w, b))  # the layers' entry takes the kernel
    assert BLOCK_M == 64 and not gemv_mod.merge_counters(x.device, 1).any()


@needs_triton
@pytest.mark.parametrize(("n", "k", "spec"), TILINGS)
@pytest.mark.parametrize("with_residual", [True, False])
def test_invariant_norm_gemm_rows_do_not_depend_on_the_row_count(force_triton: None, n: int, k: int,
                                                                 spec: tuple | None, with_residual: bool) -> None:
    """The fused RMSNorm prologue: the product's rows and the residual sum's rows keep their bits at every
    row count; x + r has add_rms_norm's bits, the product is the unfused one's within rounding."""
    from inference.layers.fused import add_rms_norm_torch
    from inference.layers.gemm_invariant import invariant_norm_gemm

    x, r, w = _half(130, k, seed=2), _half(130, k, seed=3), _half(n, k, seed=4, scale=k ** -0.5)
    nw, b = _half(k, seed=5, scale=0.5) + 1, _half(n, seed=6)
    tiles = _tiles(spec)
    if with_residual:
        rows_equal_across_counts(lambda a, c: invariant_norm_gemm(a, c, nw, 1e-6, w, b, tiles), x, r)
    else:
        rows_equal_across_counts(lambda a: invariant_norm_gemm(a, None, nw, 1e-6, w, b, tiles)[0], x)
    y, s = invariant_norm_gemm(x, r if with_residual else None, nw, 1e-6, w, b, tiles)
    h, s_ref = add_rms_norm_torch(x.float(), r.float() if with_residual else None, nw.float(), 1e-6)
    assert torch.equal(s, s_ref.half() if with_residual else x)
    torch.testing.assert_close(y.float(), F.linear(h, w.float(), b.float()), atol=3e-2, rtol=2 ** -6)


@needs_triton
@pytest.mark.parametrize(("n", "k", "spec"), TILINGS)
def test_invariant_silu_mul_gemm_equals_the_unfused_path(force_triton: None, monkeypatch: pytest.MonkeyPatch,
                                                         n: int, k: int, spec: tuple | None) -> None:
    """The fused SiLU * up prologue: rows keep their bits at every row count, and equal silu_and_mul's Triton
    kernel followed by invariant_gemm bit for bit (the activation is elementwise and rounds the same way)."""
    from inference.layers import fused
    from inference.layers.gemm_invariant import invariant_gemm, invariant_silu_mul_gemm

    gate_up, w = _half(130, 2 * k, seed=7, scale=2.0), _half(n, k, seed=8, scale=k ** -0.5)
    tiles = _tiles(spec)
    rows_equal_across_counts(lambda t: invariant_silu_mul_gemm(t, w, tiles), gate_up)
    assert torch.equal(invariant_silu_mul_gemm(gate_up, w, tiles), invariant_gemm(fused.silu_and_mul(gate_up), w, None,
                                                                                  tiles))


def _prologue_fns(n: int, k: int) -> tuple[dict, dict[str, torch.Tensor]]:
    """(name -> fn(tiles, m) of a fused product over the first m of 130 rows, for the SiLU and both norm
    prologues; their inputs by name)."""
    from inference.layers.gemm_invariant import invariant_norm_gemm, invariant_silu_mul_gemm

    t = {"gate_up": _half(130, 2 * k, seed=7, scale=2.0), "x": _half(130, k, seed=2), "r": _half(130, k, seed=3),
         "w": _half(n, k, seed=4, scale=k ** -0.5), "nw": _half(k, seed=5, scale=0.5) + 1, "b": _half(n, seed=6)}
    fns = {"silu": lambda tiles, m: (invariant_silu_mul_gemm(t["gate_up"][:m], t["w"], tiles),),
           "norm": lambda tiles, m: invariant_norm_gemm(t["x"][:m], None, t["nw"], 1e-6, t["w"], t["b"], tiles),
           "norm+res": lambda tiles, m: invariant_norm_gemm(t["x"][:m], t["r"][:m], t["nw"], 1e-6, t["w"], t["b"],
                                                            tiles)}
    return fns, t


@needs_triton
@pytest.mark.parametrize(("n", "k", "spec"), TILINGS)
def test_prologue_prefetch_keeps_the_bits(force_triton: None, n: int, k: int, spec: tuple | None) -> None:
    """The prologues' register double-buffering (InvariantTiles.prefetch) reorders loads only: every output
    has the same bits with it and without it, at a row count inside one block and across three."""
    from dataclasses import replace

    from inference.layers.gemm_invariant import invariant_tiles

    fns, inputs = _prologue_fns(n, k)
    on = _tiles(spec) or invariant_tiles(n, k, inputs["x"].device)
    assert on.prefetch
    for name, fn in fns.items():
        for m in (17, 130):
            for got, want in zip(fn(replace(on, prefetch=False), m), fn(on, m)):
                assert torch.equal(got, want), (name, m)


@needs_triton
@pytest.mark.skipif(torch.cuda.is_available(), reason="spies on a jit function, which only the interpreter calls")
def test_norm_variance_reads_only_the_sub_blocks_that_hold_rows(force_triton: None,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused norm sums the variance per 16-row sub-block and skips the sub-blocks past M (a batch of 1
    reads one, not 64 rows); the rows it keeps are the rows of the unfused path within rounding."""
    from inference.layers import gemm_invariant_kernels as kernels
    from inference.layers.fused import add_rms_norm_torch
    from inference.layers.gemm_invariant import NORM_SUB_M, InvariantTiles

    real, rows = kernels._sub_block_squares, []

    def spy(x_rows: object, r_rows: object, res_rows: object, m_mask: torch.Tensor, *args: object,
            **kwargs: object) -> object:
        rows.append(int(m_mask.sum()))
        return real(x_rows, r_rows, res_rows, m_mask, *args, **kwargs)

    monkeypatch.setattr(kernels, "_sub_block_squares", spy)
    tiles = InvariantTiles(block_n=64, block_k=64)  # one column block, no split: one program per row block
    fns, t = _prologue_fns(37, 300)
    for m in ROW_COUNTS:
        rows.clear()
        y, s = fns["norm+res"](tiles, m)
        want = [min(NORM_SUB_M, m - first) for first in range(0, m, NORM_SUB_M)]  # 64 = 4 sub-blocks
        assert sorted(rows) == sorted(want), (m, rows)
        h, s_ref = add_rms_norm_torch(t["x"][:m].float(), t["r"][:m].float(), t["nw"].float(), 1e-6)
        assert torch.equal(s, s_ref.half())
        torch.testing.assert_close(y.float(), F.linear(h, t["w"].float(), t["b"].float()), atol=3e-2,
                                   rtol=2 ** -6)


@needs_triton
def test_decoder_layer_in_the_mode_fuses_at_every_row_count(force_triton: None,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A decoder layer of the mode forms both pre-norms and the MLP's activation in the invariant GEMM at 1
    and at 130 rows alike (never by row count), and a row's outputs keep their bits; the default layer never
    calls the mode's kernels."""
    from inference.config import ModelConfig, RopeConfig
    from inference.layers import gemm_invariant
    from inference.models.decoder import DecoderLayer, _Build

    monkeypatch.setattr(gemm_invariant, "FUSE_PROLOGUES", True)  # off by default (slower on the H200)
    calls: list[str] = []
    for name in ("invariant_norm_gemm", "invariant_silu_mul_gemm"):
        real = getattr(gemm_invariant, name)
        monkeypatch.setattr(gemm_invariant, name, lambda *a, _f=real, _n=name, **kw: calls.append(_n) or _f(*a, **kw))
    config = ModelConfig(family="qwen2", vocab_size=32, hidden_size=40, intermediate_size=48, num_layers=1,
                         num_heads=2, num_kv_heads=1, head_dim=16, rms_norm_eps=1e-6, rope=RopeConfig(),
                         max_position_embeddings=64, tie_word_embeddings=True, qkv_bias=True, qk_norm=False)
    layers = {}
    for invariant in (True, False):
        layer = DecoderLayer(_Build(config, TPInfo(), torch.float16, DEVICE, invariant), ReferenceAttention())
        for i, p in enumerate(layer.parameters()):
            p.data.copy_(_half(*p.shape, seed=50 + i, scale=p.shape[-1] ** -0.5) + (1 if p.dim() == 1 else 0))
        layers[invariant] = layer

    def pre_norm_and_mlp(layer: DecoderLayer, x: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, ...]:
        gate_up, s = layer.norm_linear(layer.post_attention_layernorm, x, r, layer.mlp.gate_up_proj)
        qkv, _ = layer.norm_linear(layer.input_layernorm, x, None, layer.self_attn.qkv_proj)
        return qkv, s, layer.mlp.activate_down(gate_up)

    x, r = _half(130, 40, seed=60), _half(130, 40, seed=61)
    with torch.no_grad():
        rows_equal_across_counts(lambda a, c: pre_norm_and_mlp(layers[True], a, c), x, r)
        per_call = ["invariant_norm_gemm", "invariant_norm_gemm", "invariant_silu_mul_gemm"]
        assert sorted(calls) == sorted(per_call * (1 + sum(len({0, 130 - m, (130 - m) // 2, min(5, 130 - m)})
                                                             for m in ROW_COUNTS)))
        calls.clear()
        pre_norm_and_mlp(layers[False], x[:1], r[:1])
        assert not calls


@pytest.mark.cuda
@pytest.mark.parametrize(("n", "k"), [(1152, 896), (896, 4864), (151936, 896), (4608, 3584), (3584, 18944)])
def test_invariant_gemms_real_shapes_rows_do_not_depend_on_the_row_count_cuda(n: int, k: int) -> None:
    """bf16 on the GPU's tensor cores (the interpreter cannot prove this part): the plain product, the norm
    prologue and the SiLU prologue give a row the same bits at 1 to 130 rows and inside a 2048-row prefill
    (the norm's variance per 16-row sub-block, empty sub-blocks skipped), with and without prefetch."""
    from inference.layers.gemm_invariant import invariant_gemm, invariant_norm_gemm, invariant_silu_mul_gemm

    g = torch.Generator(device="cuda").manual_seed(n + k)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device="cuda") * scale).bfloat16()

    w, b, nw = rand(n, k, scale=k ** -0.5), rand(n), rand(k, scale=0.1) + 1
    fns = {"plain": (lambda x, r: invariant_gemm(x, w, b), 1),
           "norm": (lambda x, r: invariant_norm_gemm(x, r, nw, 1e-6, w, b), 1),
           "silu": (lambda gu, r: invariant_silu_mul_gemm(gu, w), 2)}
    def as_tuple(t: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return t if isinstance(t, tuple) else (t,)

    for name, (fn, width) in fns.items():
        big, res = rand(2048, width * k), rand(2048, width * k)
        head = (big[:130].clone(), res[:130].clone())
        rows_equal_across_counts(fn, *head)
        for got, want in zip(as_tuple(fn(big, res)), as_tuple(fn(*head))):
            assert torch.equal(got[:130], want), name
    # the prologues' register double-buffering reorders loads only (InvariantTiles.prefetch)
    from dataclasses import replace

    from inference.layers.gemm_invariant import invariant_tiles

    off = replace(invariant_tiles(n, k, torch.device("cuda")), prefetch=False)
    x, r, gate_up = rand(130, k), rand(130, k), rand(130, 2 * k)
    assert torch.equal(invariant_silu_mul_gemm(gate_up, w, off), invariant_silu_mul_gemm(gate_up, w))
    for got, want in zip(invariant_norm_gemm(x, r, nw, 1e-6, w, b, off), invariant_norm_gemm(x, r, nw, 1e-6, w, b)):
        assert torch.equal(got, want)
