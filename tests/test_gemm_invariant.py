"""The batch-invariant mode's GEMM (inference/layers/gemm_invariant.py): a row's bits do not depend on the
row count, with and without split-K, in Triton's interpreter on CPU (compiled on a GPU); the decoder
layer of the mode keeps its norms and activation apart; the real weight shapes on the GPU."""

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
@pytest.mark.slow
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
    assert BLOCK_M == 64


@needs_triton
@pytest.mark.slow
def test_decoder_layer_in_the_mode_equals_its_parts(force_triton: None) -> None:
    """The mode's decoder layer runs add_rms_norm, the invariant GEMM and silu_and_mul as separate
    launches (no prologue forms them), so its MLP half equals those parts called one by one, bit for bit,
    and a row keeps its bits at every row count."""
    from inference.config import ModelConfig, RopeConfig
    from inference.layers.fused import add_rms_norm, silu_and_mul
    from inference.layers.gemm_invariant import invariant_gemm
    from inference.models.decoder import DecoderLayer, _Build

    config = ModelConfig(family="qwen2", vocab_size=32, hidden_size=40, intermediate_size=48, num_layers=1,
                         num_heads=2, num_kv_heads=1, head_dim=16, rms_norm_eps=1e-6, rope=RopeConfig(),
                         max_position_embeddings=64, tie_word_embeddings=True, qkv_bias=True, qk_norm=False)
    layer = DecoderLayer(_Build(config, TPInfo(), torch.float16, DEVICE, True), ReferenceAttention())
    for i, p in enumerate(layer.parameters()):
        p.data.copy_(_half(*p.shape, seed=50 + i, scale=p.shape[-1] ** -0.5) + (1 if p.dim() == 1 else 0))
    norm, mlp = layer.post_attention_layernorm, layer.mlp

    def mlp_half(x: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate_up, s = norm.linear(x, r, mlp.gate_up_proj)
        return mlp.activate_down(gate_up), s

    x, r = _half(130, 40, seed=60), _half(130, 40, seed=61)
    with torch.no_grad():
        rows_equal_across_counts(mlp_half, x, r)
        h, s = add_rms_norm(x, r, norm.weight, norm.eps)
        want = invariant_gemm(silu_and_mul(invariant_gemm(h, mlp.gate_up_proj.weight)), mlp.down_proj.weight)
        got, got_s = mlp_half(x, r)
    assert torch.equal(got_s, s) and torch.equal(got, want)


@pytest.mark.cuda
@pytest.mark.parametrize(("n", "k"), [(1152, 896), (896, 4864), (151936, 896), (4608, 3584), (3584, 18944)])
def test_invariant_gemm_real_shapes_rows_do_not_depend_on_the_row_count_cuda(n: int, k: int) -> None:
    """bf16 on the GPU's tensor cores (the interpreter cannot prove this part): a row has the same bits at 1
    to 130 rows and inside a 2048-row prefill."""
    from inference.layers.gemm_invariant import invariant_gemm

    g = torch.Generator(device="cuda").manual_seed(n + k)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device="cuda") * scale).bfloat16()

    w, b = rand(n, k, scale=k ** -0.5), rand(n)
    big = rand(2048, k)
    head = big[:130].clone()
    rows_equal_across_counts(lambda x: invariant_gemm(x, w, b), head)
    assert torch.equal(invariant_gemm(big, w, b)[:130], invariant_gemm(head, w, b))
