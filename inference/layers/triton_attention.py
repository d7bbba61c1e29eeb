"""The "triton" attention backend: flash-attention style kernels over the paged KV cache.

Same contract as ReferenceAttention (see inference/layers/attention.py and inference/batch.py); this
module imports triton, so import it only where triton is installed (attention.py registers it lazily).

Kernels:
  _store_kv_kernel          one program per token: writes its k/v at slot_mapping[t]; slot < 0 (the
                            padded rows of CUDA-graph batches) is skipped. Prefill only (decode fuses it).
  _paged_attention_kernel   one program per (query tile, kv head, kv split). A tile holds BLOCK_Q
                            tokens x GROUP_PAD query heads of one kv head group (GQA), so each KV tile
                            is loaded once for the whole group; online softmax in fp32 (base 2).
  _combine_splits_kernel    the unfused split-KV merge (tiles.fused_combine False; benchmarks compare).

Decode, one launch: a split takes at least `decode_split_tiles` KV tiles, so a context that fits in one
split is computed by split 0 alone, which normalizes and stores the output (single pass; the other
splits exit at once). A longer context spreads over several splits that write fp32 partials; the last
of them to finish (an acq_rel counter per (sequence, kv head), reset by that split) merges them. The
choice is made per sequence on the device, so one graph captured for max_model_len serves both.
Decode also stores the new token's k/v itself (split 0 writes them; every split takes key ctx - 1 from
k/v rather than from the cache), so a decode layer is one launch instead of store + attention + merge.
On an H200 (0.5B heads, batch 1) one pass over 4 KV tiles was slower than 4 splits of one tile each,
over 2 tiles faster: hence decode_split_tiles = 2; scripts/bench_decode_parts.py compares.

Invariants:
- Decode (meta.is_decode) reads only device tensors and static shapes (T, heads, block_tables.shape[1]),
  so it can be captured in a CUDA graph; its split count depends only on those shapes.
- The merge counters are one int32 buffer per backend and device, zero between launches (the merging
  split resets its counter); decode launches sharing a backend run on one stream at a time.
- Prefill finds each tile's sequence on the device from cu_query_lens (grid = T // BLOCK_Q + B), so it
  needs no host list either.
- A row whose context is empty (a padded row: context_lens 0) gets an all-zero output and reads nothing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache

import torch
import triton
import triton.language as tl

from inference.batch import AttentionMetadata
from inference.core import StateError

LOG2E = 1.4426950408889634
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_cs, stride_ch,
                     NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                     HEAD_DIM_PAD: tl.constexpr, PAGE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    # The slot is loaded once per head row: a scalar term in a load mask trips Triton's interpreter.
    slot = tl.load(slot_ptr + t + h * 0).to(tl.int64)[:, None]
    mask = (h[:, None] < NUM_HEADS) & (d[None, :] < HEAD_DIM) & (slot >= 0)
    dst = (slot // PAGE) * stride_cb + (slot % PAGE) * stride_cs + h[:, None] * stride_ch + d[None, :]
    kk = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask, other=0.0)
    tl.store(kc_ptr + dst, kk.to(kc_ptr.dtype.element_ty), mask=mask)
    vv = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask, other=0.0)
    tl.store(vc_ptr + dst, vv.to(vc_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b with fp32 accumulation. UPCAST (interpreter only): Triton's CPU interpreter gets bf16
    tl.dot wrong, so operands go to fp32 there; compiled kernels never set it."""
    if UPCAST:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        c = tl.dot(a, b, input_precision=PRECISION)
    return c


@triton.jit
def _paged_attention_kernel(
    q_ptr, kc_ptr, vc_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, counter_ptr,
    k_ptr, v_ptr, slot_ptr, cu_q_ptr, ctx_ptr, bt_ptr, num_seqs, qk_scale, window,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_bt,
    stride_kt, stride_kh, stride_vt, stride_vh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr,
    NUM_SPLITS: tl.constexpr, SPLIT_TILES: tl.constexpr, FUSED_COMBINE: tl.constexpr, FUSED_STORE: tl.constexpr,
    IS_DECODE: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    if IS_DECODE:  # one token per sequence: token index == sequence index
        seq = pid
        q_start = pid
        q_len = 1
        q_begin = 0
    else:  # sequence i owns tiles [cu[i] // BLOCK_Q + i, cu[i + 1] // BLOCK_Q + i + 1); spare tiles idle
        ids = tl.arange(0, BLOCK_B)
        ends = tl.load(cu_q_ptr + 1 + ids, mask=ids < num_seqs, other=0)
        next_starts = ends // BLOCK_Q + ids + 1
        seq = tl.sum(((next_starts <= pid) & (ids < num_seqs)).to(tl.int32), axis=0)
        q_start = tl.load(cu_q_ptr + seq)
        q_len = tl.load(cu_q_ptr + seq + 1) - q_start
        q_begin = (pid - q_start // BLOCK_Q - seq) * BLOCK_Q
    ctx = tl.load(ctx_ptr + seq)

    # Row r of the tile: query token q_begin + r // GROUP_PAD, head g = r % GROUP_PAD of this group.
    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    q_local = q_begin + rows // GROUP_PAD
    g = rows % GROUP_PAD
    row_valid = (q_local < q_len) & (g < GROUP)
    tok = (q_start + q_local).to(tl.int64)
    head = kvh * GROUP + g
    q_pos = ctx - q_len + q_local  # absolute position of the row's query in its sequence
    d = tl.arange(0, HEAD_DIM_PAD)
    d_valid = d < HEAD_DIM
    if FUSED_STORE:  # decode: the new token's k/v come from k_ptr/v_ptr, and split 0 writes them to the cache
        k_new, v_new = _store_new_kv(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, seq, kvh, d, d_valid, split,
                                     stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_cs, stride_ch,
                                     PAGE)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_valid[:, None] & d_valid[None, :], other=0.0)

    # Keys [lo, hi) cover every valid row of the tile; this split takes its share of the KV tiles.
    hi = ctx - q_len + tl.minimum(q_begin + BLOCK_Q, q_len)
    if HAS_WINDOW:
        lo = tl.maximum(ctx - q_len + q_begin - window + 1, 0) // BLOCK_N * BLOCK_N
    else:
        lo = 0
    n_tiles = tl.where(q_begin < q_len, tl.cdiv(tl.maximum(hi - lo, 0), BLOCK_N), 0)
    per_split = tl.maximum(tl.cdiv(n_tiles, NUM_SPLITS), SPLIT_TILES)
    t_begin = split * per_split
    t_end = tl.minimum(t_begin + per_split, n_tiles)

    m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    for t in range(t_begin, t_end):
        k_pos = lo + t * BLOCK_N + tl.arange(0, BLOCK_N)
        k_valid = k_pos < hi
        page = tl.load(bt_ptr + seq * stride_bt + k_pos // PAGE, mask=k_valid, other=0).to(tl.int64)
        kv_off = page * stride_cb + (k_pos % PAGE) * stride_cs + kvh * stride_ch
        # Masked loads return 0, never stale cache bytes (which may hold NaN) that p = 0 would not hide.
        k_t = tl.load(kc_ptr + kv_off[None, :] + d[:, None], mask=k_valid[None, :] & d_valid[:, None], other=0.0)
        if FUSED_STORE:  # the cache slot of key ctx - 1 may not be written yet: take the new key itself
            is_new = k_pos == ctx - 1
            k_t = tl.where(is_new[None, :], k_new[:, None], k_t)
        s = _dot(q, k_t, DOT_PRECISION, DOT_UPCAST) * qk_scale
        allowed = (k_pos[None, :] <= q_pos[:, None]) & k_valid[None, :]
        if HAS_WINDOW:
            allowed = allowed & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row with no allowed key yet keeps m = -inf; subtracting 0 instead avoids inf - inf = NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(vc_ptr + kv_off[:, None] + d[None, :], mask=k_valid[:, None] & d_valid[None, :], other=0.0)
        if FUSED_STORE:
            v = tl.where(is_new[:, None], v_new[None, :], v)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, DOT_UPCAST)
        m_i = m_new

    out_offs = tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    out_mask = row_valid[:, None] & d_valid[None, :]
    # partials laid out [T, Hq, NUM_SPLITS(, HEAD_DIM_PAD)]
    part = (tok * (tl.num_programs(1) * GROUP) + head) * NUM_SPLITS
    if NUM_SPLITS == 1:
        _store_normalized(out_ptr + out_offs, acc, l_i, out_mask)
    elif FUSED_COMBINE:
        n_active = tl.cdiv(n_tiles, per_split)
        if n_active <= 1:  # the whole context is in split 0 (or empty): single pass
            if split == 0:
                _store_normalized(out_ptr + out_offs, acc, l_i, out_mask)
        elif split < n_active:
            _store_partial(part_m_ptr, part_l_ptr, part_acc_ptr, part + split, d, m_i, l_i, acc, row_valid,
                           HEAD_DIM_PAD)
            # Every thread's partial is written before the release; the acquire orders the merge's loads.
            tl.debug_barrier()
            ticket = tl.atomic_add(counter_ptr + seq * tl.num_programs(1) + kvh, 1, sem="acq_rel", scope="gpu")
            if ticket == n_active - 1:
                _merge_partials(part_m_ptr, part_l_ptr, part_acc_ptr, part, d, n_active, row_valid,
                                out_ptr + out_offs, out_mask, BLOCK_Q * GROUP_PAD, NUM_SPLITS, HEAD_DIM_PAD)
                tl.store(counter_ptr + seq * tl.num_programs(1) + kvh, 0)
    else:  # every split writes, even an empty one; _combine_splits_kernel merges
        _store_partial(part_m_ptr, part_l_ptr, part_acc_ptr, part + split, d, m_i, l_i, acc, row_valid,
                       HEAD_DIM_PAD)


@triton.jit
def _store_new_kv(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, seq, kvh, d, d_valid, split,
                  stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_cs, stride_ch, PAGE: tl.constexpr):
    """The new token's k and v [HEAD_DIM_PAD] of one kv head, in the cache dtype; split 0 stores them at
    the token's slot (none for slot < 0). No program of the launch reads that slot's bytes."""
    tok = seq.to(tl.int64)
    k_new = tl.load(k_ptr + tok * stride_kt + kvh * stride_kh + d, mask=d_valid, other=0.0).to(kc_ptr.dtype.element_ty)
    v_new = tl.load(v_ptr + tok * stride_vt + kvh * stride_vh + d, mask=d_valid, other=0.0).to(vc_ptr.dtype.element_ty)
    # Vectors, not scalars, in the mask: a scalar term in a load/store mask trips Triton's interpreter.
    slot = tl.load(slot_ptr + tok + d * 0).to(tl.int64)
    mask = d_valid & (slot >= 0) & (d * 0 + split == 0)
    dst = (slot // PAGE) * stride_cb + (slot % PAGE) * stride_cs + kvh * stride_ch + d
    tl.store(kc_ptr + dst, k_new, mask=mask)
    tl.store(vc_ptr + dst, v_new, mask=mask)
    return k_new, v_new


@triton.jit
def _store_normalized(out_ptrs, acc, l_i, mask):
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out_ptrs, out.to(out_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _store_partial(part_m_ptr, part_l_ptr, part_acc_ptr, part, d, m_i, l_i, acc, row_valid,
                   HEAD_DIM_PAD: tl.constexpr):
    tl.store(part_m_ptr + part, m_i, mask=row_valid)
    tl.store(part_l_ptr + part, l_i, mask=row_valid)
    tl.store(part_acc_ptr + part[:, None] * HEAD_DIM_PAD + d[None, :], acc, mask=row_valid[:, None])


@triton.jit
def _merge_partials(part_m_ptr, part_l_ptr, part_acc_ptr, part, d, n_active, row_valid, out_ptrs, out_mask,
                    ROWS: tl.constexpr, NUM_SPLITS: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
    """Merge the partials of splits [0, n_active) of each row, in split order (the result does not
    depend on which split merges). Loads bypass L1 (.cg): the other splits wrote through L2."""
    s = tl.arange(0, NUM_SPLITS)
    live = row_valid[:, None] & (s[None, :] < n_active)
    ms = tl.load(part_m_ptr + part[:, None] + s[None, :], mask=live, other=float("-inf"), cache_modifier=".cg")
    ls = tl.load(part_l_ptr + part[:, None] + s[None, :], mask=live, other=0.0, cache_modifier=".cg")
    m_max = tl.max(ms, axis=1)
    m_ref = tl.where(m_max == float("-inf"), 0.0, m_max)
    denom = tl.sum(tl.exp2(ms - m_ref[:, None]) * ls, axis=1)
    total = tl.zeros([ROWS, HEAD_DIM_PAD], tl.float32)
    for j in tl.static_range(NUM_SPLITS):  # unrolled: the loads of all live splits are in flight at once
        live_j = row_valid & (part * 0 + j < n_active)  # a vector: scalar mask terms trip the interpreter
        m_j = tl.load(part_m_ptr + part + j, mask=live_j, other=float("-inf"), cache_modifier=".cg")
        a_j = tl.load(part_acc_ptr + (part + j)[:, None] * HEAD_DIM_PAD + d[None, :], mask=live_j[:, None],
                      other=0.0, cache_modifier=".cg")
        total += a_j * tl.exp2(m_j - m_ref)[:, None]
    _store_normalized(out_ptrs, total, denom, out_mask)


@triton.jit
def _combine_splits_kernel(part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, stride_ot, stride_oh,
                           NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    base = (t * tl.num_programs(1) + h) * NUM_SPLITS
    s = base + tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, HEAD_DIM_PAD)
    m = tl.load(part_m_ptr + s)
    l_s = tl.load(part_l_ptr + s)
    m_max = tl.max(m, axis=0)
    w = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # empty splits (m = -inf) weigh 0
    denom = tl.sum(w * l_s, axis=0)
    acc = tl.load(part_acc_ptr + s[:, None] * HEAD_DIM_PAD + d[None, :])
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(denom > 0.0, denom, 1.0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@dataclass(frozen=True)
class TritonAttentionTiles:
    """Kernel tiling. Powers of two; prefill_block_m >= 16 and block_n >= 16 (tl.dot's minimum).

    num_splits None picks the decode split count from static shapes (see decode_num_splits)."""

    prefill_block_m: int = 64  # rows (tokens x group heads) of one prefill tile
    prefill_block_n: int = 64
    # fp32 runs exact (ieee) FMA dots, not tensor cores; big fp32 tiles spill registers on sm_90.
    fp32_prefill_block_m: int = 16
    fp32_prefill_block_n: int = 32
    decode_block_n: int = 64
    # A decode split takes at least this many KV tiles: contexts up to decode_split_tiles * decode_block_n
    # keys run in one pass; longer ones split as the static split count allows.
    decode_split_tiles: int = 2
    fused_combine: bool = True  # False: every split writes partials and a second kernel merges them
    fused_decode_store: bool = True  # decode writes the new k/v inside the attention kernel (one launch)
    num_warps: int = 4
    num_stages: int = 2
    max_splits: int = 32
    num_splits: int | None = None

    def __post_init__(self) -> None:
        blocks = (self.prefill_block_m, self.prefill_block_n, self.fp32_prefill_block_m,
                  self.fp32_prefill_block_n, self.decode_block_n)
        assert all(b >= 16 and b & (b - 1) == 0 for b in blocks), blocks
        assert self.num_splits is None or (self.num_splits >= 1 and self.num_splits & (self.num_splits - 1) == 0)
        assert self.decode_split_tiles >= 1, self.decode_split_tiles


@dataclass(frozen=True)
class LaunchPlan:
    """Grid axis 0 and tile shape of one attention launch (axis 1: kv heads, axis 2: splits)."""

    grid0: int  # decode: sequences; prefill: T // block_q + sequences (spare tiles exit at once)
    group_pad: int  # query heads of one kv head, padded to a power of two
    block_q: int  # query tokens per tile; a tile has block_q * group_pad rows
    block_n: int  # keys per KV tile
    splits: int  # KV splits per (sequence, kv head); > 1 only in decode
    block_b: int  # power of two >= number of sequences (prefill's on-device tile -> sequence search)


def _pow2_at_least(n: int, floor: int = 1) -> int:
    return max(floor, triton.next_power_of_2(n))


@lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_blocks: int, block_size: int,
                      tiles: TritonAttentionTiles, num_sms: int) -> int:
    """Splits of the KV range per (sequence, kv head) in decode, a power of two.

    Aims at about two programs per SM, never more splits than KV tiles a full block table holds.
    Depends only on static shapes, so a captured CUDA graph keeps it; at run time each split takes
    max(cdiv(tiles of the actual context, splits), tiles.decode_split_tiles) tiles, so short contexts
    leave the later splits idle, and a context within one split runs in a single pass.
    """
    if tiles.num_splits is not None:
        return tiles.num_splits
    max_tiles = triton.cdiv(max_blocks * block_size, tiles.decode_block_n)
    want = triton.cdiv(2 * num_sms, max(1, num_seqs * num_kv_heads))
    cap = min(tiles.max_splits, max_tiles, want)
    return 1 << (max(1, cap).bit_length() - 1)  # the largest power of two <= cap


def store_kv_triton(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """Write token t's k/v [T, Hkv, D] at slot_mapping[t]; tokens with a negative slot are skipped."""
    num_tokens, heads, dim = k.shape
    assert k_cache.shape[2:] == (heads, dim) and v.shape == k.shape, (k.shape, v.shape, k_cache.shape)
    assert k.stride(-1) == v.stride(-1) == k_cache.stride(-1) == 1 and k_cache.stride() == v_cache.stride()
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_HEADS=heads, HEADS_PAD=_pow2_at_least(heads), HEAD_DIM=dim, HEAD_DIM_PAD=_pow2_at_least(dim),
        PAGE=k_cache.shape[1])


class TritonAttention:
    """The fast backend: forward(q, k, v, k_cache, v_cache, meta, scale, sliding_window) -> [T, Hq, D].

    Padded rows (slot -1, context_lens 0) are not written to the cache and come out as zeros.
    Needs CUDA tensors, or CPU tensors under TRITON_INTERPRET=1 (the tests' interpreter mode).
    """

    name = "triton"

    def __init__(self, tiles: TritonAttentionTiles | None = None) -> None:
        self.tiles = tiles or TritonAttentionTiles()
        # Per device, the merge counters; outgrown buffers stay alive (captured graphs may hold them).
        self._counters: dict[torch.device, list[torch.Tensor]] = {}

    def merge_counters(self, device: torch.device, size: int) -> torch.Tensor:
        """An int32 buffer of at least `size` zeros, reused by every decode launch on `device`."""
        buffers = self._counters.setdefault(device, [])
        if not buffers or buffers[-1].numel() < size:
            if device.type == "cuda":
                assert not torch.cuda.is_current_stream_capturing(), "run one decode step before capturing"
            buffers.append(torch.zeros(max(size, 2 * buffers[-1].numel() if buffers else 256),
                                       dtype=torch.int32, device=device))
        return buffers[-1]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                sliding_window: int | None) -> torch.Tensor:
        if not (q.is_cuda or _INTERPRET):
            raise StateError("the triton attention backend needs CUDA tensors (or TRITON_INTERPRET=1)")
        assert q.dtype == k_cache.dtype == v_cache.dtype, (q.dtype, k_cache.dtype, v_cache.dtype)
        assert q.shape[2] == k_cache.shape[3] and q.shape[1] % k_cache.shape[2] == 0, (q.shape, k_cache.shape)
        fused_store = meta.is_decode and self.tiles.fused_decode_store and q.shape[0] > 0
        if not fused_store:
            store_kv_triton(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if q.shape[0] == 0:
            return out
        self._launch(q, (k, v) if fused_store else None, k_cache, v_cache, out, meta, scale, sliding_window)
        return out

    def plan(self, q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata) -> LaunchPlan:
        """The launch shape; in decode it depends only on static shapes (CUDA-graph safe)."""
        num_tokens, num_heads, _ = q.shape
        num_kv_heads, page = k_cache.shape[2], k_cache.shape[1]
        group = num_heads // num_kv_heads
        num_seqs = meta.cu_query_lens.shape[0] - 1
        tiles = self.tiles
        if meta.is_decode:
            assert num_seqs == num_tokens, (num_seqs, num_tokens)
            sms = _num_sms(q.device.index or 0) if q.is_cuda else 4
            splits = decode_num_splits(num_seqs, num_kv_heads, meta.block_tables.shape[1], page, tiles, sms)
            # A decode tile is one token: its group's heads are padded to 16 rows for tl.dot.
            return LaunchPlan(num_seqs, _pow2_at_least(group, 16), 1, tiles.decode_block_n, splits, 1)
        fp32 = q.dtype == torch.float32
        block_m = tiles.fp32_prefill_block_m if fp32 else tiles.prefill_block_m
        block_n = tiles.fp32_prefill_block_n if fp32 else tiles.prefill_block_n
        group_pad = _pow2_at_least(group)
        block_q = max(1, block_m // group_pad)
        return LaunchPlan(num_tokens // block_q + num_seqs, group_pad, block_q, block_n, 1,
                          _pow2_at_least(num_seqs))

    def _launch(self, q: torch.Tensor, new_kv: tuple[torch.Tensor, torch.Tensor] | None, k_cache: torch.Tensor,
                v_cache: torch.Tensor, out: torch.Tensor, meta: AttentionMetadata, scale: float,
                sliding_window: int | None) -> None:
        """new_kv: the decode step's (k, v) [T, Hkv, D] when the kernel stores them itself."""
        num_tokens, num_heads, dim = q.shape
        k, v = new_kv if new_kv is not None else (q, q)  # (q, q): unused placeholders
        assert k.stride(-1) == v.stride(-1) == 1, (k.stride(), v.stride())
        assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and k_cache.stride() == v_cache.stride()
        assert meta.block_tables.shape[0] == meta.cu_query_lens.shape[0] - 1 and meta.block_tables.stride(1) == 1
        plan = self.plan(q, k_cache, meta)
        dim_pad = _pow2_at_least(dim, 16)
        if plan.splits > 1:
            part_m = torch.empty((num_tokens, num_heads, plan.splits), dtype=torch.float32, device=q.device)
            part_l = torch.empty_like(part_m)
            part_acc = torch.empty((*part_m.shape, dim_pad), dtype=torch.float32, device=q.device)
        else:
            part_m = part_l = part_acc = out  # unused by the kernel when NUM_SPLITS == 1
        fused = plan.splits > 1 and self.tiles.fused_combine
        counters = self.merge_counters(q.device, plan.grid0 * k_cache.shape[2]) if fused else out
        _paged_attention_kernel[(plan.grid0, k_cache.shape[2], plan.splits)](
            q, k_cache, v_cache, out, part_m, part_l, part_acc, counters, k, v, meta.slot_mapping,
            meta.cu_query_lens, meta.context_lens, meta.block_tables, meta.cu_query_lens.shape[0] - 1,
            scale * LOG2E, sliding_window if sliding_window is not None else 0,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), meta.block_tables.stride(0),
            k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            GROUP=num_heads // k_cache.shape[2], GROUP_PAD=plan.group_pad, HEAD_DIM=dim, HEAD_DIM_PAD=dim_pad,
            PAGE=k_cache.shape[1], BLOCK_Q=plan.block_q, BLOCK_N=plan.block_n, BLOCK_B=plan.block_b,
            NUM_SPLITS=plan.splits, SPLIT_TILES=self.tiles.decode_split_tiles, FUSED_COMBINE=fused,
            FUSED_STORE=new_kv is not None,
            IS_DECODE=meta.is_decode, HAS_WINDOW=sliding_window is not None,
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            DOT_UPCAST=_INTERPRET and q.dtype == torch.bfloat16,
            num_warps=self.tiles.num_warps, num_stages=self.tiles.num_stages)
        if plan.splits > 1 and not fused:
            _combine_splits_kernel[(num_tokens, num_heads)](
                part_m, part_l, part_acc, out, out.stride(0), out.stride(1),
                NUM_SPLITS=plan.splits, HEAD_DIM=dim, HEAD_DIM_PAD=dim_pad, num_warps=self.tiles.num_warps)
