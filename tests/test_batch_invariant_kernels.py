"""The batch-invariant mode's pieces, each held to its promise: a row's bits do not depend on the other
rows of the call (docs/invariance.md). Torch pieces at this machine's thread count; Triton kernels in
Triton's interpreter on CPU (compiled on a GPU); the ordered TP reduction over gloo in two processes."""

from __future__ import annotations

import os
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from inference.batch import AttentionMetadata
from inference.core import SamplingParams
from inference.layers import gemv as gemv_mod
from inference.layers.attention import ReferenceAttention
from inference.layers.attention_invariant import TiledReferenceAttention, batch_invariant_backend, tiled_attention
from inference.layers.fp8_linear import fp8_linear
from inference.layers.invariant import row_sum, silu_and_mul_invariant, tiled_linear
from inference.layers.kernel_device import interpreted_on_cpu
from inference.layers.linear import RowParallelLinear
from inference.layers.lora import LoRAPart, LoRASlot
from inference.quant.fp8 import quantize_rows
from inference.sample.sampler import SamplingBatch, row_chunks, row_stats_triton, sample
from tests.helpers_tp import free_port, gloo_tp

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(gemv_mod.triton is None, reason="triton is not installed")


def alone_equals_batched(fn, x: torch.Tensor, sizes: tuple[int, ...] = (1, 2, 5, 16, 17)) -> None:
    """fn over every window of `sizes` rows of x gives the rows fn(x) gives, bit for bit."""
    full = fn(x)
    for m in sizes:
        for start in range(0, x.shape[0] - m + 1, max(1, (x.shape[0] - m) // 3 or 1)):
            got = fn(x[start:start + m])
            assert torch.equal(got, full[start:start + m]), (m, start)


# ---- torch pieces --------------------------------------------------------------------------------
@pytest.mark.parametrize(("n", "k"), [(384, 128), (896, 896), (37, 70)])
def test_tiled_linear_rows_do_not_depend_on_the_batch(n: int, k: int) -> None:
    g = torch.Generator().manual_seed(n)
    x, w, b = torch.randn(41, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    alone_equals_batched(lambda t: tiled_linear(t, w, b), x)
    torch.testing.assert_close(tiled_linear(x, w, b), F.linear(x, w, b), atol=1e-4, rtol=1e-5)


def test_row_sum_of_a_long_row_does_not_depend_on_the_batch() -> None:
    x = torch.randn(6, 151936, generator=torch.Generator().manual_seed(0))  # a Qwen vocabulary: over the grain
    alone_equals_batched(row_sum, x, sizes=(1, 2, 3))
    torch.testing.assert_close(row_sum(x), x.double().sum(-1).float(), atol=1e-2, rtol=1e-5)
    short = x[:, :512]
    assert torch.equal(row_sum(short), short.sum(-1))  # under the grain: torch's own sum


def test_silu_and_mul_invariant_rows_do_not_depend_on_the_batch() -> None:
    # 333 rows of 100: two threads split the call inside a row, where F.silu's scalar tail differs
    x = torch.randn(333, 200, generator=torch.Generator().manual_seed(0))
    alone_equals_batched(silu_and_mul_invariant, x, sizes=(1, 7, 166))
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(silu_and_mul_invariant(x), F.silu(gate) * up, atol=1e-6, rtol=1e-6)


def _sequence(ctx: int, heads: int, kv_heads: int, dim: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(ctx, heads, dim, generator=g), torch.randn(ctx, kv_heads, dim, generator=g),
            torch.randn(ctx, kv_heads, dim, generator=g))


@pytest.mark.parametrize("window", [None, 7])
def test_tiled_attention_prefill_chunks_and_decode_rows_agree_bit_for_bit(window: int | None) -> None:
    q, k, v = _sequence(37, 4, 2, 8)
    pos = torch.arange(37)
    prefill = tiled_attention(q, k, v, pos, 0.3, window)
    chunk = tiled_attention(q[20:], k, v, pos[20:], 0.3, window)  # a later chunk over cached keys
    assert torch.equal(chunk, prefill[20:])
    for j in (0, 15, 16, 17, 36):  # decode: the context ends at the query
        assert torch.equal(tiled_attention(q[j:j + 1], k[:j + 1], v[:j + 1], pos[j:j + 1], 0.3, window),
                           prefill[j:j + 1]), j


def _paged(query_lens: list[int], context_lens: list[int], heads: int, kv_heads: int, dim: int,
           dtype: torch.dtype = torch.float32) -> tuple:
    """One varlen step over a paged cache of block size 4 whose cached slots hold keys, the rest NaN."""
    g = torch.Generator().manual_seed(1)
    bs, tables, slots, next_block = 4, [], [], 0
    kc = torch.full((64, bs, kv_heads, dim), float("nan"), dtype=dtype, device=DEVICE)
    vc = kc.clone()
    for q_len, ctx in zip(query_lens, context_lens):
        table = list(range(next_block, next_block + -(-ctx // bs)))
        next_block += len(table)
        tables.append(table)
        cached = [table[p // bs] * bs + p % bs for p in range(ctx)]
        for cache in (kc, vc):
            n = ctx - q_len
            cache.view(-1, kv_heads, dim)[cached[:n]] = torch.randn(n, kv_heads, dim, generator=g).to(dtype).to(DEVICE)
        slots += cached[ctx - q_len:]
    meta = AttentionMetadata.build(query_lens, context_lens, slots, tables, bs, DEVICE)
    t = sum(query_lens)
    q = torch.randn(t, heads, dim, generator=g).to(dtype).to(DEVICE)
    k = torch.randn(t, kv_heads, dim, generator=g).to(dtype).to(DEVICE)
    v = torch.randn(t, kv_heads, dim, generator=g).to(dtype).to(DEVICE)
    return q, k, v, kc, vc, meta


@pytest.mark.parametrize("window", [None, 6])
def test_tiled_reference_backend_matches_the_reference(window: int | None) -> None:
    q, k, v, kc, vc, meta = _paged([5, 1, 9, 1], [5, 11, 30, 3], 4, 2, 8)
    got = TiledReferenceAttention().forward(q, k, v, kc.clone(), vc.clone(), meta, 0.35, window)
    want = ReferenceAttention().forward(q, k, v, kc.clone(), vc.clone(), meta, 0.35, window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert isinstance(batch_invariant_backend(ReferenceAttention()), TiledReferenceAttention)


# ---- Triton kernels (the interpreter on CPU) ----------------------------------------------------------
def _attention_paths(backend: object, dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """One sequence's queries through each path, paired with the same queries' rows of its full prefill:
    a later prefill chunk over cached keys, a decode batch of several of its rows (as spec-decode verify
    runs them), and a batch-1 decode of its last query."""
    ctx, heads, kv_heads, dim, bs = 37, 4, 2, 16, 4
    q, k, v = (t.to(dtype).to(DEVICE) for t in _sequence(ctx, heads, kv_heads, dim))
    table, slots = list(range(10)), list(range(ctx))  # blocks in order: position p sits at slot p
    kc = torch.zeros(16, bs, kv_heads, dim, dtype=dtype, device=DEVICE)
    vc = kc.clone()

    def run(idx: list[int], query_lens: list[int], context_lens: list[int]) -> torch.Tensor:
        meta = AttentionMetadata.build(query_lens, context_lens, [slots[j] for j in idx], [table] * len(query_lens),
                                       bs, DEVICE)
        return backend.forward(q[idx], k[idx], v[idx], kc, vc, meta, 0.25, None)

    prefill = run(list(range(ctx)), [ctx], [ctx])
    rows = [3, 15, 16, 30, 36]
    return {"chunk": (run(list(range(20, ctx)), [ctx - 20], [ctx]), prefill[20:]),
            "decode": (run(rows, [1] * len(rows), [j + 1 for j in rows]), prefill[rows]),
            "single": (run([36], [1], [ctx]), prefill[36:])}


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("segment", [0, 1, 2])
@pytest.mark.slow
def test_triton_attention_in_the_mode_gives_a_query_the_same_bits_on_every_path(dtype: torch.dtype,
                                                                                segment: int) -> None:
    """segment: the mode's key segments in tiles of 16 keys (0: the mode's own, 8 tiles: one segment for
    these 37 keys); 1 and 2 cut them into 3 and 2 segments, so decode runs split-KV over the segments and
    prefill folds them in one program."""
    from inference.layers.triton_attention import SEGMENT_TILES, TritonAttention, TritonAttentionTiles

    default = TritonAttention(TritonAttentionTiles(decode_block_n=16, segment_tiles=segment))
    backend = batch_invariant_backend(default)
    tiles = backend.tiles
    assert tiles.segment_tiles == (segment or SEGMENT_TILES) and tiles.num_splits is None
    assert tiles.exact_rounding and tiles.prefill_block_n == 16
    for path, (got, want) in _attention_paths(backend, dtype).items():
        assert torch.equal(got, want), path
    # the default tiles (prefill tiles of other shapes, split-KV decode at batch 1) differ somewhere
    assert not all(torch.equal(got, want) for got, want in _attention_paths(default, dtype).values())


@needs_triton
@pytest.mark.slow
def test_sampler_rows_in_the_mode_do_not_depend_on_the_batch() -> None:
    rows, vocab = 6, 8192
    # without the mode a lone row is cut into more chunks than a row of a batch
    assert row_chunks(1, vocab, 16) != row_chunks(rows, vocab, 16)
    logits = (4 * torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0))).to(DEVICE)
    stats = row_stats_triton(logits, invariant=True)
    for j in range(rows):
        lone = row_stats_triton(logits[j:j + 1], invariant=True)
        assert torch.equal(lone.log_sum, stats.log_sum[j:j + 1]) and torch.equal(lone.argmax, stats.argmax[j:j + 1])
    params = [SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=10 + j) for j in range(rows)]

    def draw(lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        sb = SamplingBatch.build(params[lo:hi], [p.seed for p in params[lo:hi]], list(range(lo, hi)), vocab,
                                 torch.device(DEVICE), invariant=True)
        out = sample(logits[lo:hi], sb, use_triton=True)
        return out.token_ids, out.logprobs

    tokens, logprobs = draw(0, rows)
    for j in range(rows):
        t, lp = draw(j, j + 1)
        assert torch.equal(t, tokens[j:j + 1]) and torch.equal(lp, logprobs[j:j + 1]), j


# ---- the linears' variants: FP8 weights, a LoRA adapter -------------------------------------------
def _kernels(where: str) -> Any:
    """torch: the CPU twins; triton: the invariant GEMM in Triton's interpreter (fp16 there)."""
    if where == "triton" and gemv_mod.triton is None:
        pytest.skip("triton is not installed")
    return interpreted_on_cpu() if where == "triton" else nullcontext()


@pytest.mark.parametrize("where", ["torch", "triton"])
def test_fp8_linear_in_the_mode_gives_a_row_the_same_bits_alone_or_batched(where: str) -> None:
    """FP8 weights dequantize into the invariant product: a row's bits follow the weight, not the batch."""
    dtype = torch.float16 if where == "triton" else torch.float32
    g = torch.Generator().manual_seed(3)
    q, scale = quantize_rows(torch.randn(72, 96, generator=g) / 96 ** 0.5, "w")
    x, b = torch.randn(40, 96, generator=g).to(dtype), torch.randn(72, generator=g).to(dtype)
    with _kernels(where):
        alone_equals_batched(lambda t: fp8_linear(t, q, scale, b, invariant=True), x)


@pytest.mark.parametrize("where", ["torch", "triton"])
def test_a_lora_adapter_in_the_mode_gives_a_row_the_same_bits_alone_or_batched(where: str) -> None:
    """Both adapter products (x A^T for the stacked parts, then each part's (x A^T)_i B_i^T read through a
    strided view) run in the invariant product, and the add into the layer's output is elementwise."""
    dtype = torch.float16 if where == "triton" else torch.float32
    parts = [LoRAPart("q", 0, 48), LoRAPart("v", 64, 24)]
    slot = LoRASlot(parts, rank=8, in_features=96, scaling=2.0, dtype=dtype, device="cpu", invariant=True)
    g = torch.Generator().manual_seed(4)
    for t in slot.buffers():
        t.copy_(torch.randn(t.shape, generator=g) / t.shape[-1] ** 0.5)
    x, y = torch.randn(40, 96, generator=g).to(dtype), torch.randn(40, 96, generator=g).to(dtype)
    with _kernels(where):
        alone_equals_batched(lambda rows: slot(rows, y[:0].new_zeros(rows.shape[0], 96)), x)
        out = slot(x, y.clone())
    assert torch.equal(out[:, 48:64], y[:, 48:64]) and not torch.equal(out[:, :48], y[:, :48])  # parts only


# ---- tensor parallelism: the ordered all-reduce ------------------------------------------------------
def _tp_worker(rank: int, port: int, out: str) -> None:
    with gloo_tp(rank, 2, port) as tp:
        layer = RowParallelLinear(96, 40, True, tp, torch.float32, "cpu", invariant=True)
        g = torch.Generator().manual_seed(0)
        layer.weight.weight_loader(layer.weight, torch.randn(40, 96, generator=g))
        layer.bias.weight_loader(layer.bias, torch.randn(40, generator=g))
        x = torch.randn(21, 96, generator=g)[:, rank * 48:(rank + 1) * 48]  # this rank's input shard
        full = layer(x.contiguous())
        alone = torch.cat([layer(x[j:j + 1].contiguous()) for j in range(21)])
        torch.save({"full": full, "alone": alone}, Path(out) / f"rank{rank}.pt")


@pytest.mark.slow
def test_row_parallel_sums_ranks_in_a_fixed_order(tmp_path: Path) -> None:
    mp.spawn(_tp_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for got in ranks:
        assert torch.equal(got["alone"], got["full"])  # a row alone = the row in the batch
        assert torch.equal(got["full"], ranks[0]["full"])  # every rank holds the same bits
