"""Attention in the batch-invariant mode (EngineConfig.batch_invariant; docs/invariance.md).

A query's output must have the same bits whether it is computed in a prefill (with the other queries of
its chunk), in a decode step of any batch size, as a spec-decode verify row, after a prefix-cache hit or
after a preemption's recompute. So every path sums the keys of a query in the same fixed tiles:

    keys [0, KEY_TILE), [KEY_TILE, 2 KEY_TILE), ... of the query's sequence, tile boundaries at multiples
    of KEY_TILE from position 0 whatever the query, the chunk or the window; per tile, fp32 scores
    s = (q * k).sum over head_dim, masked to the keys the query may see (causal, sliding window), then
    the online-softmax update m' = max(m, max s), p = exp(s - m'), l' = l exp(m - m') + sum p,
    acc' = acc exp(m - m') + sum p v; out = acc / l.

`TiledReferenceAttention` is the mode's reference backend (eager torch, any device); the Triton backend
gets `TritonAttention.batch_invariant()` (inference/layers/triton_attention.py). `batch_invariant_backend`
maps a backend to its mode. Why the tiles give every path the same bits: `_attend`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from inference.batch import AttentionMetadata
from inference.core import InvalidRequestError
from inference.layers.attention import AttentionBackend, ReferenceAttention, store_kv

KEY_TILE = 16

# (start of a key tile) -> (keys, values) [R or 1, KEY_TILE, Hq, D] fp32, zero past the keys that exist
TileFetch = Callable[[int], tuple[torch.Tensor, torch.Tensor]]


def tiled_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                    scale: float, sliding_window: int | None) -> torch.Tensor:
    """q [R, Hq, D] at `positions` [R] (absolute, in the sequence) over one sequence's first keys/values
    [ctx, Hkv, D] (ctx > every position); returns fp32 [R, Hq, D]. See the module docstring."""
    ctx, hkv, _ = keys.shape
    group = q.shape[1] // hkv

    def fetch(start: int) -> tuple[torch.Tensor, torch.Tensor]:
        return _tile(keys, start, group)[None], _tile(values, start, group)[None]

    return _attend(q, positions, fetch, ctx, scale, sliding_window)


def paged_tiled_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                          positions: torch.Tensor, scale: float, sliding_window: int | None) -> torch.Tensor:
    """tiled_attention for rows of any sequences at once: row r reads its keys through its block table
    tables[r] [W] of the paged caches [blocks, block_size, Hkv, D]. Returns fp32 [R, Hq, D]."""
    _, block_size, hkv, dim = k_cache.shape
    group = q.shape[1] // hkv
    flat_k, flat_v = k_cache.view(-1, hkv, dim), v_cache.view(-1, hkv, dim)
    offsets = torch.arange(KEY_TILE, device=q.device)

    def fetch(start: int) -> tuple[torch.Tensor, torch.Tensor]:
        k_pos = start + offsets
        seen = k_pos[None, :] <= positions[:, None]  # [R, KEY_TILE]: keys that exist for the row
        block = tables.gather(1, (k_pos // block_size).clamp(max=tables.shape[1] - 1).expand(len(tables), -1))
        slots = torch.where(seen, block.long() * block_size + k_pos % block_size, 0)
        k_t = torch.where(seen[..., None, None], flat_k[slots].float(), 0.0)  # never stale (NaN) cache bytes
        v_t = torch.where(seen[..., None, None], flat_v[slots].float(), 0.0)
        return k_t.repeat_interleave(group, dim=2), v_t.repeat_interleave(group, dim=2)

    return _attend(q, positions, fetch, int(positions.max()) + 1, scale, sliding_window)


def _attend(q: torch.Tensor, positions: torch.Tensor, fetch: TileFetch, n_keys: int, scale: float,
            sliding_window: int | None) -> torch.Tensor:
    """The tile loop of the module docstring over keys [0, n_keys) for query rows q [R, Hq, D].

    A tile holding no key the query may see leaves its (m, l, acc) untouched, so a prefill query walks
    exactly the tiles a decode query at its position walks. Each tile's reductions have a fixed length
    (KEY_TILE keys, head_dim) over contiguous memory, which torch reduces serially per output element
    whatever the other dimensions hold (layers/invariant.py), and everything else is elementwise. The
    paged path reads a key past a query's position as zeros, masked to p = 0, so a prefill query (whose
    later keys exist) and a decode query (whose do not) sum the very same terms; `tiled_attention` over
    contiguous keys masks real keys there (p v = +-0), equal up to the sign of an exactly zero output."""
    rows, hq, dim = q.shape
    q32 = q.float()
    m = torch.full((rows, hq), float("-inf"), device=q.device)
    l_sum = torch.zeros(rows, hq, device=q.device)
    acc = torch.zeros(rows, hq, dim, device=q.device)
    # the first key any row may see (tiles before it would be skipped by every row anyway)
    lowest = 0 if sliding_window is None else max(0, int(positions.min()) - sliding_window + 1)
    offsets = torch.arange(KEY_TILE, device=q.device)
    for start in range(lowest // KEY_TILE * KEY_TILE, n_keys, KEY_TILE):
        k_t, v_t = fetch(start)  # [R or 1, KEY_TILE, Hq, D]
        k_pos = start + offsets
        allowed = (k_pos[None, :] <= positions[:, None]) & (k_pos[None, :] < n_keys)
        if sliding_window is not None:
            allowed &= k_pos[None, :] > positions[:, None] - sliding_window
        # [R, Hq, KEY_TILE]: one contiguous head_dim reduction per (row, head, key)
        s = (q32[:, :, None, :] * k_t.transpose(1, 2)).sum(-1) * scale
        s = s.masked_fill(~allowed[:, None, :], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        m_safe = torch.where(m_new == float("-inf"), 0.0, m_new)
        p = torch.exp(s - m_safe[..., None])
        alpha = torch.exp(m - m_safe)
        # [R, Hq, D]: one contiguous KEY_TILE reduction per (row, head, dim)
        pv = (p[:, :, None, :] * v_t.permute(0, 2, 3, 1)).sum(-1)
        live = allowed.any(-1)[:, None]  # rows with a visible key in this tile
        m = torch.where(live, m_new, m)
        l_sum = torch.where(live, l_sum * alpha + p.sum(-1), l_sum)
        acc = torch.where(live[..., None], acc * alpha[..., None] + pv, acc)
    return acc / l_sum[..., None]


def _tile(x: torch.Tensor, start: int, group: int) -> torch.Tensor:
    """x[start:start + KEY_TILE] in fp32 with its kv heads repeated to the query heads (HF's repeat_kv
    order), zero rows past the end: [KEY_TILE, Hq, D]."""
    part = x[start:start + KEY_TILE].float()
    if part.shape[0] < KEY_TILE:
        part = torch.cat((part, part.new_zeros(KEY_TILE - part.shape[0], *part.shape[1:])))
    return part.repeat_interleave(group, dim=1)


class TiledReferenceAttention:
    """The reference backend in the batch-invariant mode: ReferenceAttention's contract (store the new
    k/v, then each sequence's queries over its context), every query row of the step in one
    `paged_tiled_attention` (one tile loop per layer, not one per sequence)."""

    name = "reference"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                sliding_window: int | None) -> torch.Tensor:
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        seq_of_row: list[int] = []
        positions: list[int] = []
        for i, (q_len, ctx_len) in enumerate(zip(meta.query_lens, meta.context_lens_host)):
            assert 0 < q_len <= ctx_len, (i, q_len, ctx_len)
            seq_of_row += [i] * q_len
            positions += range(ctx_len - q_len, ctx_len)
        assert len(positions) == q.shape[0], (len(positions), q.shape)
        rows = torch.tensor(seq_of_row, device=q.device)
        pos = torch.tensor(positions, device=q.device)
        out = paged_tiled_attention(q, k_cache, v_cache, meta.block_tables.index_select(0, rows), pos, scale,
                                    sliding_window)
        return out.to(q.dtype)


def batch_invariant_backend(backend: AttentionBackend) -> AttentionBackend:
    """The batch-invariant form of an attention backend; InvalidRequestError naming attention_backend
    for a backend that has none."""
    if isinstance(backend, (ReferenceAttention, TiledReferenceAttention)):
        return TiledReferenceAttention()
    invariant = getattr(backend, "batch_invariant", None)
    if invariant is None:
        raise InvalidRequestError("attention_backend", f"the {backend.name!r} backend has no batch-invariant mode "
                                                       "(batch_invariant needs 'reference' or 'triton')")
    return invariant()
