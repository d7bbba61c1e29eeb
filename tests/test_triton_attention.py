"""The "triton" attention backend equals ReferenceAttention over the paged KV cache.

Without a GPU the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set below before triton
is imported) on small shapes; with one, the same tests run compiled, and the `cuda` tests add realistic
model shapes (bf16 and fp32) and a CUDA-graph capture + replay of decode. Caches start as NaN, so any
read of a slot outside a sequence's context shows up as a NaN in the output.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import random
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from inference import envs
from inference.batch import AttentionMetadata
from inference.core import InvalidRequestError, StateError
from inference.layers.attention import ReferenceAttention, get_attention_backend, store_kv
from tests.helpers_models import ToyPager, hf_logits, load_ours, make_hf_checkpoint, our_logits, random_prompts

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def ta() -> ModuleType:
    pytest.importorskip("triton")
    return importlib.import_module("inference.layers.triton_attention")


@dataclasses.dataclass
class Batch:
    meta: AttentionMetadata
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor


def make_batch(query_lens: list[int], context_lens: list[int], heads: int, kv_heads: int, head_dim: int,
               block_size: int, dtype: torch.dtype, seed: int = 0, pad_rows: int = 0,
               table_width: int | None = None, num_blocks: int | None = None, device: str = DEVICE) -> Batch:
    """A varlen step over shuffled (non-contiguous) blocks. The first context - query_len tokens of each
    sequence are already cached; every other cache slot holds NaN. `pad_rows` CUDA-graph padding rows
    (query 1, context 0, slot -1, table of zeros) are appended."""
    gen = torch.Generator(device).manual_seed(seed)
    rng = random.Random(seed)
    needed = [-(-c // block_size) for c in context_lens]
    num_blocks = num_blocks or sum(needed) + 3
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in needed]
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype, device=device)
    v_cache = k_cache.clone()
    slots: list[int] = []
    cached: list[int] = []
    for q_len, ctx, table in zip(query_lens, context_lens, tables):
        positions = [table[p // block_size] * block_size + p % block_size for p in range(ctx)]
        cached += positions[:ctx - q_len]
        slots += positions[ctx - q_len:]
    for cache in (k_cache, v_cache):
        values = torch.randn(len(cached), kv_heads, head_dim, generator=gen, device=device).to(dtype)
        cache.view(-1, kv_heads, head_dim)[torch.tensor(cached, dtype=torch.long, device=device)] = values
    query_lens, context_lens = query_lens + [1] * pad_rows, context_lens + [0] * pad_rows
    tables, slots = tables + [[]] * pad_rows, slots + [-1] * pad_rows
    if table_width is not None:
        tables = [t + [0] * (table_width - len(t)) for t in tables]
    meta = AttentionMetadata.build(query_lens, context_lens, slots, tables, block_size, device)
    num_tokens = sum(query_lens)
    # q, k, v are strided views of one fused tensor, as QKVParallelLinear.split hands them over.
    qkv = torch.randn(num_tokens, heads + 2 * kv_heads, head_dim, generator=gen, device=device).to(dtype)
    q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
    return Batch(meta, q, k, v, k_cache, v_cache)


def run(backend: object, b: Batch, window: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One forward on copies of the caches: (output, k_cache after, v_cache after)."""
    kc, vc = b.k_cache.clone(), b.v_cache.clone()
    out = backend.forward(b.q, b.k, b.v, kc, vc, b.meta, b.q.shape[-1] ** -0.5, window)
    return out, kc, vc


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    # bf16/fp16: both round the output to the dtype (rtol: a bf16 ulp is 2**-8 relative), and the kernel
    # rounds probabilities to it before P @ V as flash attention does (atol: cancelling terms near 0).
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 5e-3, "rtol": 2e-2}


def assert_matches_reference(got: object, b: Batch, window: int | None = None, real_rows: int | None = None,
                             ref_batch: Batch | None = None) -> torch.Tensor:
    """Output rows and cache contents equal the reference's (caches exactly, NaN slots included)."""
    out, kc, vc = run(got, b, window)
    want, want_kc, want_vc = run(ReferenceAttention(), ref_batch or b, window)
    rows = real_rows if real_rows is not None else out.shape[0]
    torch.testing.assert_close(out[:rows].float(), want.float(), **tolerance(b.q.dtype))
    torch.testing.assert_close(kc, want_kc, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(vc, want_vc, atol=0, rtol=0, equal_nan=True)
    return out


SMALL_TILES = {"prefill_block_m": 16, "prefill_block_n": 16, "decode_block_n": 16,
               "fp32_prefill_block_m": 16, "fp32_prefill_block_n": 16}


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (7, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.slow
def test_mixed_batch_matches_reference(ta: ModuleType, heads: int, kv_heads: int, dtype: torch.dtype) -> None:
    """Chunked prefill over cached context, a fresh prompt and decodes in one step; GQA ratios 1, 2, 7."""
    b = make_batch([9, 20, 1, 1], [30, 20, 45, 3], heads, kv_heads, 32, 8, dtype, seed=heads)
    backend = ta.TritonAttention(ta.TritonAttentionTiles(**SMALL_TILES))
    assert_matches_reference(backend, b)


@pytest.mark.parametrize(("head_dim", "block_size", "default_tiles"), [(16, 16, True), (24, 8, False)])
@pytest.mark.slow
def test_prefill_head_dims_and_default_tiles(ta: ModuleType, head_dim: int, block_size: int,
                                             default_tiles: bool) -> None:
    """A head_dim that is not a power of two (padded to 32) and the default (large) tiles."""
    b = make_batch([37, 5, 1], [40, 5, 70], 6, 2, head_dim, block_size, torch.float32, seed=3)
    tiles = ta.TritonAttentionTiles() if default_tiles else ta.TritonAttentionTiles(**SMALL_TILES)
    assert_matches_reference(ta.TritonAttention(tiles), b)


# (num_splits, decode_split_tiles). With 16-key tiles the contexts below span 1, 3, 4 and 10 tiles:
# split_tiles 1 spreads all but the first over several splits, split_tiles 4 runs the first three in a
# single pass and the last over 3 splits; 8 splits of at least 2 tiles leave splits idle.
DECODE_SPLITS = [(None, 4), (1, 4), (4, 1), (4, 4), (8, 2)]


@pytest.mark.parametrize(("splits", "split_tiles"), DECODE_SPLITS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.slow
def test_decode_matches_reference(ta: ModuleType, splits: int | None, split_tiles: int, dtype: torch.dtype) -> None:
    """Pure decode: single pass and split-KV merged by the last split (None: the heuristic, which splits
    on the interpreter's 8 "SMs")."""
    b = make_batch([1, 1, 1, 1], [1, 38, 64, 150], 8, 2, 32, 8, dtype, seed=5)
    assert b.meta.is_decode
    tiles = ta.TritonAttentionTiles(**{**SMALL_TILES, "num_splits": splits, "decode_split_tiles": split_tiles})
    assert_matches_reference(ta.TritonAttention(tiles), b)


@pytest.mark.slow
def test_split_decode_leaves_its_counters_zero(ta: ModuleType) -> None:
    """The merging split resets its counter, so the next launch (another layer, a graph replay) merges."""
    b = make_batch([1, 1, 1], [150, 90, 7], 4, 2, 16, 8, torch.float32, seed=12)
    backend = ta.TritonAttention(ta.TritonAttentionTiles(**{**SMALL_TILES, "num_splits": 4, "decode_split_tiles": 1}))
    first = assert_matches_reference(backend, b)
    counters = backend.merge_counters(b.q.device, 1)
    assert counters.numel() >= 4 * 2 and not counters.any()
    second, _, _ = run(backend, b)
    torch.testing.assert_close(second, first, atol=0, rtol=0)
    assert not counters.any()


@pytest.mark.slow
def test_short_contexts_take_the_single_pass(ta: ModuleType) -> None:
    """Contexts within one split's tiles never touch the merge counters: with every counter poisoned,
    a merge would never fire and its rows would stay unwritten, yet the output equals the reference."""
    b = make_batch([1, 1, 1], [64, 33, 1], 4, 2, 16, 8, torch.float32, seed=13, table_width=64)
    backend = ta.TritonAttention(ta.TritonAttentionTiles(**{**SMALL_TILES, "num_splits": 8, "decode_split_tiles": 4}))
    assert backend.plan(b.q, b.k_cache, b.meta).splits == 8
    counters = backend.merge_counters(b.q.device, 3 * 2)
    counters.fill_(1000)
    assert_matches_reference(backend, b)
    assert bool((counters == 1000).all())
    long = make_batch([1], [65], 4, 2, 16, 8, torch.float32, seed=13, table_width=64)
    out, _, _ = run(backend, long)  # 5 tiles: two splits, whose merge the poisoned counter blocks
    want, _, _ = run(ta.TritonAttention(ta.TritonAttentionTiles(**SMALL_TILES)), long)
    assert not torch.equal(out, want)


@pytest.mark.parametrize("decode", [True, False])
@pytest.mark.slow
def test_sliding_window(ta: ModuleType, decode: bool) -> None:
    """A query at position p sees keys in (p - window, p]; windows cut through blocks and KV tiles."""
    query_lens = [1, 1, 1] if decode else [13, 1, 30]
    b = make_batch(query_lens, [50, 7, 41], 4, 2, 16, 8, torch.float32, seed=7)
    tiles = ta.TritonAttentionTiles(**{**SMALL_TILES, "num_splits": 2})
    for window in (1, 5, 20, 100):
        assert_matches_reference(ta.TritonAttention(tiles), b, window)


@pytest.mark.slow
def test_padded_rows_are_ignored(ta: ModuleType) -> None:
    """CUDA-graph padding rows (slot -1, context 0) write nothing, read nothing and come out zero."""
    real = make_batch([1, 1], [17, 33], 4, 2, 16, 8, torch.float32, seed=9)
    padded = make_batch([1, 1], [17, 33], 4, 2, 16, 8, torch.float32, seed=9, pad_rows=3, table_width=8)
    # The real rows carry the same data in both batches (q/k/v are views of one fused tensor).
    padded.q[:2], padded.k[:2], padded.v[:2] = real.q, real.k, real.v
    padded.k_cache, padded.v_cache = real.k_cache.clone(), real.v_cache.clone()
    for splits, split_tiles in [(1, 4), (2, 4), (2, 1)]:  # (2, 1): the 33-token row merges two splits
        tiles = {**SMALL_TILES, "num_splits": splits, "decode_split_tiles": split_tiles}
        backend = ta.TritonAttention(ta.TritonAttentionTiles(**tiles))
        out = assert_matches_reference(backend, padded, real_rows=2, ref_batch=real)
        assert torch.equal(out[2:], torch.zeros_like(out[2:]))


def test_store_skips_negative_slots(ta: ModuleType) -> None:
    kc = torch.zeros(4, 8, 2, 16, device=DEVICE)
    vc = torch.zeros_like(kc)
    k, v = torch.randn(3, 2, 16, device=DEVICE), torch.randn(3, 2, 16, device=DEVICE)
    slots = torch.tensor([5, -1, 30], device=DEVICE)
    ta.store_kv_triton(k, v, kc, vc, slots)
    flat_k, flat_v = kc.view(-1, 2, 16), vc.view(-1, 2, 16)
    assert torch.equal(flat_k[5], k[0]) and torch.equal(flat_v[30], v[2])
    assert int((flat_k.abs().sum(dim=(1, 2)) > 0).sum()) == 2  # nothing else was written


def test_reference_store_skips_negative_slots() -> None:
    kc = torch.zeros(4, 8, 2, 16)
    vc = torch.zeros_like(kc)
    k, v = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    store_kv(k, v, kc, vc, torch.tensor([5, -1, 30]))
    flat_k, flat_v = kc.view(-1, 2, 16), vc.view(-1, 2, 16)
    assert torch.equal(flat_k[5], k[0]) and torch.equal(flat_v[30], v[2])
    assert int((flat_k.abs().sum(dim=(1, 2)) > 0).sum()) == 2


@pytest.mark.parametrize("query_lens", [[1, 1, 1], [4, 1, 9]])
@pytest.mark.slow
def test_reads_only_device_metadata(ta: ModuleType, query_lens: list[int]) -> None:
    """The host copies of the lengths may be stale (as in a replayed CUDA graph): results do not change."""
    b = make_batch(query_lens, [20, 9, 30], 4, 2, 16, 8, torch.float32, seed=11)
    stale = dataclasses.replace(b.meta, query_lens=[], context_lens_host=[], max_query_len=0, max_context_len=0)
    backend = ta.TritonAttention(ta.TritonAttentionTiles(**SMALL_TILES))
    want, _, _ = run(backend, b)
    got, _, _ = run(backend, dataclasses.replace(b, meta=stale))
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_decode_num_splits_depends_on_static_shapes(ta: ModuleType) -> None:
    tiles = ta.TritonAttentionTiles()
    one = ta.decode_num_splits(1, 2, 128, 16, tiles, num_sms=132)  # batch 1, 2048-token tables
    assert one > 1 and one & (one - 1) == 0 and one <= tiles.max_splits
    assert ta.decode_num_splits(128, 4, 128, 16, tiles, num_sms=132) == 1  # enough programs already
    assert ta.decode_num_splits(1, 2, 2, 16, tiles, num_sms=132) == 1  # one KV tile: nothing to split


@pytest.mark.slow
def test_large_decode_batches_take_long_tiles(ta: ModuleType) -> None:
    """A model without speculative decoding (decode_max_rows 1) takes 128-key tiles in decode launches of
    at least long_decode_min_seqs sequences; with verify rows possible (the default 16), in the
    batch-invariant mode and below the threshold the tiles stay 64. Results equal the reference over one
    to three long tiles of context."""
    b32 = make_batch([1] * 32, [20] * 32, 4, 2, 16, 16, torch.float32, seed=3, table_width=8)
    rows1 = ta.TritonAttention().for_decode_rows(1)
    assert rows1.plan(b32.q, b32.k_cache, b32.meta).block_n == 128
    assert ta.TritonAttention().plan(b32.q, b32.k_cache, b32.meta).block_n == 64
    assert rows1.batch_invariant().plan(b32.q, b32.k_cache, b32.meta).block_n == 64
    b31 = make_batch([1] * 31, [20] * 31, 4, 2, 16, 16, torch.float32, seed=3, table_width=8)
    assert rows1.plan(b31.q, b31.k_cache, b31.meta).block_n == 64
    small = ta.TritonAttention(ta.TritonAttentionTiles(decode_max_rows=1, long_decode_min_seqs=2))
    b = make_batch([1, 1, 1], [100, 250, 390], 14, 2, 64, 16, torch.float32, seed=5, table_width=32)
    assert small.plan(b.q, b.k_cache, b.meta).block_n == 128
    assert_matches_reference(small, b)


def test_registry_selects_triton(ta: ModuleType) -> None:
    backend = get_attention_backend("triton")
    assert backend.name == "triton" and isinstance(backend, ta.TritonAttention)


def test_registry_without_triton_names_the_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    with pytest.raises(InvalidRequestError, match="triton"):
        get_attention_backend("triton")


def test_cpu_tensors_need_the_interpreter(ta: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    b = make_batch([1], [3], 2, 1, 16, 8, torch.float32, device="cpu")
    with pytest.raises(StateError, match="CUDA"):
        run(ta.TritonAttention(), b)


@pytest.mark.parametrize("case", ["qwen2", "mistral"])
@pytest.mark.slow
def test_model_with_triton_backend_matches_transformers(ta: ModuleType, case: str, tmp_path: Path) -> None:
    """A tiny model (GQA; Mistral: sliding window 4) through prefill and two decode steps, fp32, CPU."""
    if not envs.TRITON_INTERPRET.get():
        pytest.skip("the tiny-model helpers run on the CPU, where the kernels need the interpreter")
    hf = make_hf_checkpoint(case, tmp_path)
    model = load_ours(tmp_path)
    model.set_attention_backend(get_attention_backend("triton"))
    prompts = random_prompts([5, 11, 1, 8], model.config.vocab_size)
    pager = ToyPager(num_blocks=48, block_size=4)
    got = our_logits(model, pager, dict(enumerate(prompts)))
    for i, prompt in enumerate(prompts):
        torch.testing.assert_close(got[i], hf_logits(hf, prompt), atol=1e-4, rtol=0)
    for step in range(2):
        nxt = random_prompts([1] * len(prompts), model.config.vocab_size, seed=10 + step)
        got = our_logits(model, pager, dict(enumerate(nxt)))
        for i in range(len(prompts)):
            prompts[i] = prompts[i] + nxt[i]
            torch.testing.assert_close(got[i][-1], hf_logits(hf, prompts[i])[-1], atol=1e-4, rtol=0)


# ---- CUDA: realistic shapes, compiled kernels, graph capture -------------------------------------------

MODEL_SHAPES = [(14, 2, 64), (28, 4, 128), (16, 16, 128)]  # Qwen2-0.5B, Qwen2-7B, GQA ratio 1


@pytest.mark.cuda
@pytest.mark.parametrize("batch", [1, 32, 128])
@pytest.mark.parametrize("shape", MODEL_SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_decode_matches_reference(ta: ModuleType, batch: int, shape: tuple[int, int, int],
                                       dtype: torch.dtype) -> None:
    rng = random.Random(batch)
    contexts = [2048] + [rng.randint(1, 2048) for _ in range(batch - 1)]
    b = make_batch([1] * batch, contexts, *shape, 16, dtype, seed=batch)
    assert_matches_reference(ta.TritonAttention(), b)
    assert_matches_reference(ta.TritonAttention().for_decode_rows(1), b)  # the multi-row check compiled out


@pytest.mark.cuda
@pytest.mark.parametrize("split_tiles", [2, 4, 1])
@pytest.mark.parametrize("batch", [1, 8])
def test_cuda_decode_paths_match_reference(ta: ModuleType, split_tiles: int, batch: int) -> None:
    """Qwen2-0.5B heads, bf16: single pass (<= 128 keys by default) and splits merged by the last split,
    over short and long contexts in one batch."""
    contexts = [200, 3000, 256, 257, 1, 129, 4096, 64][:batch]
    b = make_batch([1] * batch, contexts, 14, 2, 64, 16, torch.bfloat16, seed=batch, table_width=256)
    tiles = ta.TritonAttentionTiles(decode_split_tiles=split_tiles)
    assert_matches_reference(ta.TritonAttention(tiles), b)


@pytest.mark.cuda
@pytest.mark.parametrize("window", [None, 300])
@pytest.mark.parametrize("shape", MODEL_SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_mixed_batch_matches_reference(ta: ModuleType, window: int | None, shape: tuple[int, int, int],
                                            dtype: torch.dtype) -> None:
    """A chunk after a prefix-cache hit, a fresh prompt, a short prompt and 29 decodes."""
    rng = random.Random(1)
    query_lens = [512, 700, 3] + [1] * 29
    contexts = [2000, 700, 3] + [rng.randint(1, 2048) for _ in range(29)]
    b = make_batch(query_lens, contexts, *shape, 16, dtype, seed=2)
    assert_matches_reference(ta.TritonAttention(), b, window)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_graph_replay_equals_eager(ta: ModuleType, dtype: torch.dtype) -> None:
    """Decode captured once (8 rows, 2 of them padding, split-KV) and replayed with new q/k/v, contexts,
    block tables and slots gives the eager result; the host copies in the captured meta stay stale."""
    backend = ta.TritonAttention()
    shape, width, num_blocks = (14, 2, 64), 128, 6 * 128 + 8
    steps = [make_batch([1] * 6, contexts, *shape, 16, dtype, seed=seed, pad_rows=2, table_width=width,
                        num_blocks=num_blocks)
             for seed, contexts in [(1, [5, 2048, 100, 17, 1, 999]), (2, [1500, 3, 64, 2047, 256, 700])]]
    static = steps[0]
    assert backend.plan(static.q, static.k_cache, static.meta).splits > 1
    kc, vc = static.k_cache.clone(), static.v_cache.clone()
    scale = shape[2] ** -0.5
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile the kernels before capture
        backend.forward(static.q, static.k, static.v, kc.clone(), vc.clone(), static.meta, scale, None)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(static.q, static.k, static.v, kc, vc, static.meta, scale, None)
    for step in steps:
        for dst, src in [(static.q, step.q), (static.k, step.k), (static.v, step.v), (kc, step.k_cache),
                         (vc, step.v_cache), (static.meta.context_lens, step.meta.context_lens),
                         (static.meta.slot_mapping, step.meta.slot_mapping),
                         (static.meta.block_tables, step.meta.block_tables)]:
            dst.copy_(src)
        graph.replay()
        want, want_kc, want_vc = run(backend, step)
        torch.testing.assert_close(out, want, atol=0, rtol=0)
        torch.testing.assert_close(kc, want_kc, atol=0, rtol=0, equal_nan=True)
        torch.testing.assert_close(vc, want_vc, atol=0, rtol=0, equal_nan=True)
        assert torch.equal(out[6:], torch.zeros_like(out[6:]))


def test_the_block_table_width_compiles_no_new_kernel() -> None:
    """An eager step's block-table width follows its longest context; compiled (outside the interpreter),
    the attention kernel must not specialize on it, or a rollout's first batch compiles what the start-up
    warm-up's short prompts never reached (scripts/bench/first_batch.py)."""
    code = ("from inference.layers.triton_attention_kernels import _paged_attention_kernel as k; "
            "print(sorted(p.name for p in k.params if p.do_not_specialize))")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["['stride_bt']"]
