"""Several decode rows of one sequence in one launch (speculative decoding's verify, inference/runner/inputs.py).

Row t of a sequence reads the keys that earlier-position rows of the same launch write into the cache in
that launch; on a GPU the programs run in no fixed order, so the kernel must take those keys from the
k/v inputs. Triton's interpreter runs programs in grid order, so a launch whose rows ascend never shows
the race; the rows here also run DESCENDING (the reading row before the writing one), over cache slots
that hold NaN until written, so a key read from the cache before its write turns the output NaN.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from types import ModuleType

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from inference.batch import AttentionMetadata
from inference.layers.attention import ReferenceAttention
from tests.test_triton_attention import SMALL_TILES, Batch, make_batch, tolerance

PAD = -1  # a CUDA-graph padding row: context 0, slot -1, a table of zeros


@pytest.fixture(scope="module")
def ta() -> ModuleType:
    pytest.importorskip("triton")
    return importlib.import_module("inference.layers.triton_attention")


def verify_rows(b: Batch, descending: bool, pads: bool) -> tuple[Batch, list[int]]:
    """The varlen step b as one decode launch of single-token rows: token j of a sequence becomes a row
    with context (its position + 1), the sequence's table and its slot. Rows of a sequence ascend or
    descend in position; with pads, a padded row opens the launch and follows every sequence. Returns
    the launch and, per row, the token of b it carries (PAD for a padded row)."""
    meta, width = b.meta, b.meta.block_tables.shape[1]
    order: list[int] = [PAD] if pads else []
    contexts: list[int] = [0] if pads else []
    start = 0
    for q_len, ctx in zip(meta.query_lens, meta.context_lens_host):
        toks = list(range(start, start + q_len))
        ctxs = list(range(ctx - q_len + 1, ctx + 1))
        if descending:
            toks, ctxs = toks[::-1], ctxs[::-1]
        order += toks + ([PAD] if pads else [])
        contexts += ctxs + ([0] if pads else [])
        start += q_len
    seq_of = [i for i, q_len in enumerate(meta.query_lens) for _ in range(q_len)]
    tables = [[0] * width if t == PAD else meta.block_tables[seq_of[t]].tolist() for t in order]
    slots = [-1 if t == PAD else int(meta.slot_mapping[t]) for t in order]
    rows = AttentionMetadata.build([1] * len(order), contexts, slots, tables, meta.block_size, b.q.device)
    # q/k/v stay strided views of one fused tensor; a padded row carries token 0's data (never used).
    qkv = torch.cat([b.q, b.k, b.v], dim=1)[torch.tensor([max(t, 0) for t in order], device=b.q.device)]
    q, k, v = qkv.split([b.q.shape[1], b.k.shape[1], b.v.shape[1]], dim=1)
    return dataclasses.replace(b, meta=rows, q=q, k=k, v=v), order


def assert_rows_match_reference(backend: object, b: Batch, order: list[int]) -> None:
    """The launch equals ReferenceAttention over its real rows: outputs within tolerance, both caches
    bit for bit; padded rows come out zero and write nothing."""
    real = [r for r, t in enumerate(order) if t != PAD]
    pad = [r for r, t in enumerate(order) if t == PAD]
    ctx = b.meta.context_lens_host
    idx = torch.tensor(real, device=b.q.device)
    ref_meta = AttentionMetadata.build([1] * len(real), [ctx[r] for r in real], b.meta.slot_mapping[idx],
                                       [b.meta.block_tables[r].tolist() for r in real], b.meta.block_size,
                                       b.q.device)
    want_kc, want_vc = b.k_cache.clone(), b.v_cache.clone()
    scale = b.q.shape[-1] ** -0.5
    want = ReferenceAttention().forward(b.q[idx], b.k[idx], b.v[idx], want_kc, want_vc, ref_meta, scale, None)
    kc, vc = b.k_cache.clone(), b.v_cache.clone()
    got = backend.forward(b.q, b.k, b.v, kc, vc, b.meta, scale, None)
    torch.testing.assert_close(got[idx].float(), want.float(), **tolerance(b.q.dtype))
    torch.testing.assert_close(kc, want_kc, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(vc, want_vc, atol=0, rtol=0, equal_nan=True)
    assert torch.equal(got[pad], torch.zeros_like(got[pad]))


# (num_splits, decode_split_tiles): a single pass, and 16-key tiles spread over 4 splits (the keys the
# other rows write then sit in a split of their own or straddle two).
ROW_SPLITS = [(1, 4), (4, 1)]


@pytest.mark.parametrize(("splits", "split_tiles"), ROW_SPLITS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.slow
def test_descending_rows_take_earlier_keys_from_the_inputs(ta: ModuleType, splits: int, split_tiles: int,
                                                           dtype: torch.dtype) -> None:
    """GQA 4:1; 5 rows crossing a block (8) and a KV tile (16) boundary, 5 rows of a fresh sequence
    (context 1 .. 5), 3 rows late in a long context; padded rows around them. The rows of a sequence
    run last position first, so each reads its predecessors' keys before they are stored."""
    b = make_batch([5, 5, 3], [19, 5, 40], 8, 2, 32, 8, dtype, seed=41, table_width=6)
    rows, order = verify_rows(b, descending=True, pads=True)
    tiles = ta.TritonAttentionTiles(**{**SMALL_TILES, "num_splits": splits, "decode_split_tiles": split_tiles})
    assert_rows_match_reference(ta.TritonAttention(tiles), rows, order)


@pytest.mark.slow
def test_ascending_and_descending_rows_agree_bit_for_bit(ta: ModuleType) -> None:
    """A row's output does not depend on where its sequence's other rows sit in the launch."""
    b = make_batch([4, 6], [33, 18], 4, 2, 32, 8, torch.bfloat16, seed=42)
    tiles = ta.TritonAttentionTiles(**{**SMALL_TILES, "num_splits": 2, "decode_split_tiles": 1})
    backend = ta.TritonAttention(tiles)
    outs = {}
    for descending in (False, True):
        rows, order = verify_rows(b, descending=descending, pads=False)
        kc, vc = rows.k_cache.clone(), rows.v_cache.clone()
        out = backend.forward(rows.q, rows.k, rows.v, kc, vc, rows.meta, 32 ** -0.5, None)
        outs[descending] = out[torch.tensor(order).argsort()]  # back to b's token order
    assert not outs[True].isnan().any()
    torch.testing.assert_close(outs[True], outs[False], atol=0, rtol=0)


@pytest.mark.slow
def test_sixteen_rows_of_one_sequence(ta: ModuleType) -> None:
    """The most rows of one sequence a launch may hold (tiles.decode_max_rows), descending, GQA 7:1."""
    b = make_batch([16, 1], [30, 7], 7, 1, 16, 8, torch.float32, seed=43)
    rows, order = verify_rows(b, descending=True, pads=True)
    tiles = ta.TritonAttentionTiles(**SMALL_TILES)
    assert_rows_match_reference(ta.TritonAttention(tiles), rows, order)


@pytest.mark.cuda
@pytest.mark.parametrize("descending", [False, True])
@pytest.mark.parametrize("split_tiles", [2, 1])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_verify_rows_match_reference(ta: ModuleType, descending: bool, split_tiles: int,
                                          dtype: torch.dtype) -> None:
    """Qwen2-0.5B heads (14 q, 2 kv, head_dim 64), compiled: 3 sequences x 5 verify rows and padded rows,
    repeated so that a racing read would have many chances to land before its write."""
    b = make_batch([5, 5, 5], [300, 5, 2100], 14, 2, 64, 16, dtype, seed=44, table_width=256)
    rows, order = verify_rows(b, descending=descending, pads=True)
    tiles = ta.TritonAttentionTiles(decode_split_tiles=split_tiles)
    for _ in range(20):
        assert_rows_match_reference(ta.TritonAttention(tiles), rows, order)
