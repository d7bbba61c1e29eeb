"""The batch-invariant mode's pieces, each held to its promise: a row's bits do not depend on the other
rows of the call (docs/invariance.md). Torch pieces at this machine's thread count; Triton kernels in
Triton's interpreter on CPU (compiled on a GPU); the ordered TP reduction over gloo in two processes."""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from inference.batch import AttentionMetadata
from inference.core import SamplingParams
from inference.layers import gemv as gemv_mod
from inference.layers.attention import ReferenceAttention
from inference.layers.attention_invariant import TiledReferenceAttention, batch_invariant_backend, tiled_attention
from inference.layers.invariant import row_sum, silu_and_mul_invariant, tiled_linear
from inference.layers.linear import RowParallelLinear
from inference.parallel import TPInfo
from inference.sampler import SamplingBatch, row_chunks, row_stats_triton, sample

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
@pytest.fixture
def force_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gemv_mod, "FORCE_ON_CPU", True)
    monkeypatch.setattr(gemv_mod, "ENABLED", True)


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
@pytest.mark.parametrize("fused", [True, False])
def test_invariant_gemm_rows_do_not_depend_on_the_row_count(force_triton: None, monkeypatch: pytest.MonkeyPatch,
                                                            n: int, k: int, spec: tuple | None, fused: bool) -> None:
    from inference.layers.gemm_invariant import BLOCK_M, invariant_gemm, invariant_linear, invariant_tiles

    monkeypatch.setattr(gemv_mod, "FUSED_SPLIT", fused)
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

    monkeypatch.setattr(fused, "FORCE_ON_CPU", True)
    gate_up, w = _half(130, 2 * k, seed=7, scale=2.0), _half(n, k, seed=8, scale=k ** -0.5)
    tiles = _tiles(spec)
    rows_equal_across_counts(lambda t: invariant_silu_mul_gemm(t, w, tiles), gate_up)
    assert torch.equal(invariant_silu_mul_gemm(gate_up, w, tiles), invariant_gemm(fused.silu_and_mul(gate_up), w, None,
                                                                                  tiles))


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
    prologue and the SiLU prologue give a row the same bits at 1 to 130 rows and inside a 2048-row prefill."""
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
def test_triton_attention_in_the_mode_gives_a_query_the_same_bits_on_every_path(dtype: torch.dtype) -> None:
    from inference.layers.triton_attention import TritonAttention, TritonAttentionTiles

    default = TritonAttention(TritonAttentionTiles(decode_block_n=16))
    backend = batch_invariant_backend(default)
    tiles = backend.tiles
    assert tiles.num_splits == 1 and not tiles.fused_decode_rope and tiles.prefill_block_n == 16
    for path, (got, want) in _attention_paths(backend, dtype).items():
        assert torch.equal(got, want), path
    # the default tiles (prefill tiles of other shapes, split-KV decode at batch 1) differ somewhere
    assert not all(torch.equal(got, want) for got, want in _attention_paths(default, dtype).values())


@needs_triton
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


# ---- tensor parallelism: the ordered all-reduce ------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tp_worker(rank: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    try:
        tp = TPInfo(rank=rank, size=2, group=dist.new_group([0, 1]))
        layer = RowParallelLinear(96, 40, True, tp, torch.float32, "cpu", invariant=True)
        g = torch.Generator().manual_seed(0)
        layer.weight.weight_loader(layer.weight, torch.randn(40, 96, generator=g))
        layer.bias.weight_loader(layer.bias, torch.randn(40, generator=g))
        x = torch.randn(21, 96, generator=g)[:, rank * 48:(rank + 1) * 48]  # this rank's input shard
        full = layer(x.contiguous())
        alone = torch.cat([layer(x[j:j + 1].contiguous()) for j in range(21)])
        torch.save({"full": full, "alone": alone}, Path(out) / f"rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_row_parallel_sums_ranks_in_a_fixed_order(tmp_path: Path) -> None:
    mp.spawn(_tp_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for got in ranks:
        assert torch.equal(got["alone"], got["full"])  # a row alone = the row in the batch
        assert torch.equal(got["full"], ranks[0]["full"])  # every rank holds the same bits
