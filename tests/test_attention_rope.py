"""Decode attention that rotates q and the new k itself (the caller passes them unrotated with their Rope).

The fused launch must give the same bits as rotary_qk followed by the plain launch: the output, and the
k cache, which later steps read. Spec-decode verify rows (several rows of one sequence in a launch) take
other rows' new keys from the inputs, so those keys must be rotated at their own positions. Without a GPU
the kernels run in Triton's interpreter (set below, before triton is imported); the `cuda` tests run them
compiled on the model shapes.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import random
from collections.abc import Iterator
from types import ModuleType

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from inference.config import ModelConfig, RopeConfig
from inference.layers.attention import Attention, ReferenceAttention
from inference.layers.kernel_device import interpreted_on_cpu
from inference.layers.rotary import Rope, RotaryEmbedding
from inference.models import build_model
from inference.parallel import TPInfo
from tests.helpers_models import ToyPager
from tests.test_triton_attention import DEVICE, MODEL_SHAPES, SMALL_TILES, Batch, make_batch, tolerance
from tests.test_triton_attention_rows import PAD, verify_rows


@pytest.fixture(scope="module")
def ta() -> ModuleType:
    pytest.importorskip("triton")
    return importlib.import_module("inference.layers.triton_attention")


@pytest.fixture(autouse=True)
def _triton_rotary_on_cpu() -> Iterator[None]:
    """The unfused comparison path runs fused.py's rotary kernel (in the interpreter on CPU)."""
    with interpreted_on_cpu():
        yield


def rope_for(b: Batch, positions: list[int], theta: float = 10000.0) -> Rope:
    """The Rope a model would hand over for these positions (llama3 scaling exercised via theta only)."""
    head_dim = b.q.shape[-1]
    table = RotaryEmbedding(head_dim, max(positions) + 8, RopeConfig(theta=theta), b.q.device)
    return table.prepare(torch.tensor(positions, device=b.q.device), b.q.dtype)


def decode_positions(b: Batch) -> list[int]:
    """Row i of a decode launch sits at position context_lens[i] - 1 (0 for a padded row)."""
    return [max(c - 1, 0) for c in b.meta.context_lens_host]


def rotated_first(backend: object, b: Batch, rope: Rope) -> tuple[torch.Tensor, ...]:
    """rotary_qk, then the plain forward: (out, k_cache, v_cache)."""
    kc, vc = b.k_cache.clone(), b.v_cache.clone()
    q, k = rope.apply_qk(b.q, b.k)
    return backend.forward(q, k, b.v, kc, vc, b.meta, b.q.shape[-1] ** -0.5, None), kc, vc


def both_paths(backend: object, b: Batch, rope: Rope) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """(fused: forward with rope, unfused: rotary_qk then forward), each as (out, k_cache, v_cache)."""
    kc, vc = b.k_cache.clone(), b.v_cache.clone()
    out = backend.forward(b.q, b.k, b.v, kc, vc, b.meta, b.q.shape[-1] ** -0.5, None, rope)
    return (out, kc, vc), rotated_first(backend, b, rope)


def assert_same_bits(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> None:
    for name, x, y in zip(("output", "k_cache", "v_cache"), got, want):
        assert torch.equal(x.isnan(), y.isnan()), name
        differ = x.nan_to_num() != y.nan_to_num()
        assert not differ.any(), (f"{name}: {int(differ.sum())} of {x.numel()} elements differ, at most by "
                                  f"{float((x.float() - y.float()).nan_to_num().abs().max())}")


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 2, 16), (7, 1, 32)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_rope_decode_has_the_bits_of_rotary_then_attention(ta: ModuleType, heads: int, kv_heads: int,
                                                                 head_dim: int, dtype: torch.dtype) -> None:
    """Contexts in one and several splits, and a padded row (graph batches), GQA."""
    b = make_batch([1, 1, 1], [9, 40, 1], heads, kv_heads, head_dim, 8, dtype, seed=7, pad_rows=1, table_width=6)
    backend = ta.TritonAttention(ta.TritonAttentionTiles(**SMALL_TILES, num_splits=2, decode_split_tiles=1))
    assert backend.fuses_rope(b.q, b.k, rope_for(b, decode_positions(b)))
    fused_run, plain_run = both_paths(backend, b, rope_for(b, decode_positions(b)))
    assert_same_bits(fused_run, plain_run)
    assert not fused_run[0][:3].isnan().any()


@pytest.mark.parametrize("descending", [False, True])
@pytest.mark.slow
def test_fused_rope_rotates_verify_rows_at_their_own_positions(ta: ModuleType, descending: bool) -> None:
    """Verify rows read the new keys of rows stored in the same launch from the inputs: those keys are
    rotated at the key's position, so the cache and the outputs equal the unfused path's."""
    b = make_batch([4, 3], [21, 6], 4, 2, 32, 8, torch.bfloat16, seed=11, table_width=4)
    rows, order = verify_rows(b, descending=descending, pads=True)
    tiles = ta.TritonAttentionTiles(**SMALL_TILES, num_splits=2, decode_split_tiles=1)
    backend = ta.TritonAttention(tiles)
    fused_run, plain_run = both_paths(backend, rows, rope_for(rows, decode_positions(rows)))
    assert_same_bits(fused_run, plain_run)
    real = torch.tensor([r for r, t in enumerate(order) if t != PAD])
    assert not fused_run[0][real].isnan().any()


@pytest.mark.slow
def test_the_invariant_tiles_rotate_in_decode_with_exact_rounding(ta: ModuleType) -> None:
    """The batch-invariant tiles rotate in the decode kernel and launch every attention kernel without FP
    contraction; decode rows and verify rows keep rotary_qk's bits (here in the interpreter; compiled on
    the GPU: test_cuda_exact_rounding_rotates_with_rotary_qks_bits)."""
    tiles = ta.TritonAttentionTiles(**SMALL_TILES).batch_invariant()
    assert tiles.exact_rounding and tiles.segment_tiles > 0  # splits: the fixed key segments
    backend = ta.TritonAttention(tiles)
    b = make_batch([1, 1, 1], [9, 40, 1], 4, 2, 16, 8, torch.bfloat16, seed=8, pad_rows=1, table_width=6)
    assert backend.fuses_rope(b.q, b.k, rope_for(b, decode_positions(b)))
    assert_same_bits(*both_paths(backend, b, rope_for(b, decode_positions(b))))
    v = make_batch([4, 3], [21, 6], 4, 2, 16, 8, torch.bfloat16, seed=12, table_width=4)
    rows, _ = verify_rows(v, descending=True, pads=True)
    assert_same_bits(*both_paths(backend, rows, rope_for(rows, decode_positions(rows))))


def test_rope_falls_back_to_rotary_first(ta: ModuleType) -> None:
    """A head dim that is not a power of two, and prefill, rotate before the launch; the result equals
    rotary_qk followed by the plain launch either way."""
    odd = make_batch([1, 1], [12, 3], 4, 2, 24, 8, torch.float32, seed=3)
    backend = ta.TritonAttention(ta.TritonAttentionTiles(**SMALL_TILES))
    assert not backend.fuses_rope(odd.q, odd.k, rope_for(odd, decode_positions(odd)))
    prefill = make_batch([3, 5], [7, 5], 4, 2, 16, 8, torch.float32, seed=5)
    prefill_positions = [p for q_len, c in zip([3, 5], [7, 5]) for p in range(c - q_len, c)]
    for batch, positions in ((odd, decode_positions(odd)), (prefill, prefill_positions)):
        fused_run, plain_run = both_paths(backend, batch, rope_for(batch, positions))
        assert_same_bits(fused_run, plain_run)


def test_the_layer_rotates_for_the_reference_backend() -> None:
    """The reference backend does not take rope: the Attention layer rotates q and k before calling it,
    with the bits of rotating them first by hand."""
    b = make_batch([2, 1], [5, 9], 4, 2, 16, 8, torch.float32, seed=6)
    rope = rope_for(b, [3, 4, 8])
    assert not getattr(ReferenceAttention, "takes_rope", False)
    runs = []
    for fuse in (True, False):
        layer = Attention(4, 2, 16, 16 ** -0.5, None, ReferenceAttention())
        layer.bind_kv_cache(b.k_cache.clone(), b.v_cache.clone())
        if fuse:
            out = layer(b.q, b.k, b.v, b.meta, rope)
        else:
            out = layer(*rope.apply_qk(b.q, b.k), b.v, b.meta)
        runs.append((out, layer.k_cache, layer.v_cache))
    assert_same_bits(*runs)


def assert_within_a_rounding(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...], b: Batch) -> None:
    """Compiled, the in-kernel rotation and rotary_qk's may round a product differently (seen on the H200:
    ~1 in 8 elements of a head's second half, one bf16 step): the caches agree within one rounding of the
    rotated key (v exactly). The outputs: q and k going in differ by that rounding in a few elements, which
    moves a bf16 output near zero by a little more than the reference's own tolerance (H200: 0.0056 once in
    15232 elements of the verify-rows case), so the absolute tolerance is 1e-2 here."""
    out, kc, vc = got
    want_out, want_kc, want_vc = want
    assert torch.equal(vc.isnan(), want_vc.isnan()) and torch.equal(vc.nan_to_num(), want_vc.nan_to_num())
    assert torch.equal(kc.isnan(), want_kc.isnan())
    # one bf16 rounding (8 significant bits) of the result or of a product of terms of size <= ~4
    step = want_kc.float().abs().nan_to_num() * 2.0 ** -7 + 2.0 ** -6
    assert ((kc.float() - want_kc.float()).nan_to_num().abs() <= step).all()
    torch.testing.assert_close(out.float(), want_out.float(), **{**tolerance(b.q.dtype), "atol": 1e-2})


@pytest.mark.cuda
@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("shape", MODEL_SHAPES)
def test_cuda_fused_rope_decode(ta: ModuleType, batch: int, shape: tuple[int, int, int]) -> None:
    """Compiled, on the model shapes (Qwen2-0.5B, 7B, GQA 1), bf16: the fused launch against rotary_qk +
    the plain launch, and against the reference on the rotated inputs."""
    rng = random.Random(batch)
    contexts = [2048] + [rng.randint(1, 2048) for _ in range(batch - 1)]
    b = make_batch([1] * batch, contexts, *shape, 16, torch.bfloat16, seed=batch, device=DEVICE)
    backend = ta.TritonAttention(ta.TritonAttentionTiles())
    rope = rope_for(b, decode_positions(b), theta=1e6)
    assert backend.fuses_rope(b.q, b.k, rope)
    got, want = both_paths(backend, b, rope)
    assert_within_a_rounding(got, want, b)
    reference = rotated_first(ReferenceAttention(), b, rope)
    assert_within_a_rounding(got, reference, b)


@pytest.mark.cuda
@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("shape", MODEL_SHAPES)
def test_cuda_exact_rounding_rotates_with_rotary_qks_bits(ta: ModuleType, batch: int,
                                                          shape: tuple[int, int, int]) -> None:
    """Compiled without FP contraction (the invariant mode's tiles), the in-kernel
    rotation gives rotary_qk's bits exactly, unlike the default launch (assert_within_a_rounding above)."""
    rng = random.Random(batch)
    contexts = [2048] + [rng.randint(1, 2048) for _ in range(batch - 1)]
    b = make_batch([1] * batch, contexts, *shape, 16, torch.bfloat16, seed=batch, device=DEVICE)
    backend = ta.TritonAttention(dataclasses.replace(ta.TritonAttentionTiles(), exact_rounding=True))
    assert_same_bits(*both_paths(backend, b, rope_for(b, decode_positions(b), theta=1e6)))


@pytest.mark.cuda
def test_cuda_fused_rope_verify_rows(ta: ModuleType) -> None:
    b = make_batch([5, 5, 3], [300, 5, 2000], 14, 2, 64, 16, torch.bfloat16, seed=9, table_width=128)
    backend = ta.TritonAttention(ta.TritonAttentionTiles())
    for descending in (False, True):
        rows, _ = verify_rows(dataclasses.replace(b), descending=descending, pads=True)
        assert_within_a_rounding(*both_paths(backend, rows, rope_for(rows, decode_positions(rows))), rows)


@pytest.mark.slow
def test_decoder_decode_steps_rotate_in_the_kernel(ta: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny Qwen2 (GQA 2:1, head dim 16) on the triton backend: a prefill of three sequences, then decode
    steps. With the fused rotary, only the prefill calls rotary_qk (decode rotates in the attention kernel),
    and every step's hidden states equal those of the same backend rotating first (a backend that takes no
    rope, so the layer runs rotary_qk), bit for bit (Triton's interpreter)."""
    config = ModelConfig(family="qwen2", vocab_size=32, hidden_size=32, intermediate_size=48, num_layers=2,
                         num_heads=2, num_kv_heads=1, head_dim=16, rms_norm_eps=1e-6, rope=RopeConfig(),
                         max_position_embeddings=64, tie_word_embeddings=True, qkv_bias=True, qk_norm=False)
    rotations: list[int] = []
    apply_qk = Rope.apply_qk
    monkeypatch.setattr(Rope, "apply_qk", lambda self, q, k: rotations.append(q.shape[0]) or apply_qk(self, q, k))
    runs = []
    rotating_first = type("RotatingFirst", (ta.TritonAttention,), {"takes_rope": False})
    for backend_class in (ta.TritonAttention, rotating_first):
        torch.manual_seed(0)
        backend = backend_class(ta.TritonAttentionTiles(**SMALL_TILES))
        model = build_model(config, TPInfo(), torch.float32, "cpu", backend)
        for p in model.parameters():
            p.data.normal_(0, 0.3)
        model.bind_kv_cache(torch.full(model.kv_cache_spec().shape(12, 4), float("nan")))
        pager, hidden = ToyPager(12, 4), []
        steps = [{0: [3, 4, 5], 1: [6, 7], 2: [8]}] + [{s: [10 + 3 * i + s] for s in range(3)} for i in range(3)]
        rotations.clear()
        with torch.no_grad():
            for step in steps:
                hidden.append(model(*pager.step(step)))
        runs.append((hidden, list(rotations)))
    (fused_h, fused_rot), (plain_h, plain_rot) = runs
    assert fused_rot == [6, 6] and plain_rot == [6, 6] + [3, 3] * 3  # rows rotated by rotary_qk, per layer
    for got, want in zip(fused_h, plain_h):
        assert not got.isnan().any() and torch.equal(got, want)


class _OldStyleBackend:
    """A backend written before the rope argument: forward takes eight arguments, no takes_rope."""

    name = "old-style"

    def __init__(self) -> None:
        self.inner = ReferenceAttention()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: object, scale: float, sliding_window: int | None) -> torch.Tensor:
        return self.inner.forward(q, k, v, k_cache, v_cache, meta, scale, sliding_window)


def test_a_backend_without_rope_gets_rotated_inputs() -> None:
    """The attention layer rotates q and k itself for a backend that does not take rope: the model's
    output equals the one on the reference backend (which rotates them inside forward)."""
    config = ModelConfig(family="llama", vocab_size=32, hidden_size=32, intermediate_size=48, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope=RopeConfig(),
                         max_position_embeddings=64, tie_word_embeddings=False, qkv_bias=False, qk_norm=False)
    outs = []
    for backend in (ReferenceAttention(), _OldStyleBackend()):
        torch.manual_seed(1)
        model = build_model(config, TPInfo(), torch.float32, "cpu", backend)
        for p in model.parameters():
            p.data.normal_(0, 0.3)
        model.bind_kv_cache(torch.zeros(model.kv_cache_spec().shape(8, 4)))
        pager = ToyPager(8, 4)
        with torch.no_grad():
            outs.append([model(*pager.step(step)) for step in ({0: [1, 2, 3], 1: [4]}, {0: [5], 1: [6]})])
    for got, want in zip(*outs):
        assert torch.equal(got, want)


def test_rope_is_not_fused_for_a_key_of_another_dtype(ta: ModuleType) -> None:
    b = make_batch([1, 1], [12, 3], 4, 2, 16, 8, torch.float32, seed=8)
    backend = ta.TritonAttention(ta.TritonAttentionTiles(**SMALL_TILES))
    rope = rope_for(b, decode_positions(b))
    assert backend.fuses_rope(b.q, b.k, rope) and not backend.fuses_rope(b.q, b.k.double(), rope)
