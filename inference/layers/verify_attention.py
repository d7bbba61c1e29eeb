"""Spec-decode verify attention that reads each key once per sequence (SIDECAR_VERIFY_KEYS_ONCE).

A verify launch holds k + 1 consecutive rows of each speculating sequence (inference/runner/decode_rows.py).
The decode kernel (triton_attention_kernels.py) gives every row its own programs, so each row reads its
whole context again: 8 sequences' 40 rows at 2,048 keys took 74 us a layer on the H200 against 19 us
for the same sequences' plain decode (session 14), and verify attention was the largest part of a tail
spec step. Here one program holds every row of one sequence and one kv head: each KV tile is loaded once
and multiplied against all the rows' query heads stacked ([ROWS_PAD x GROUP_PAD, head_dim] @ [head_dim,
BLOCK_N]), each row masked to its own causal range.

Layout, found on the device (graph-safe): rows of one sequence sit consecutively in the launch, their
positions ascending or descending. Row r continues row r - 1 when they are adjacent positions of one
sequence: ascending, row r's own table maps position ctx[r] - 2 to slot[r - 1]; descending, row r - 1's
table maps position ctx[r - 1] - 2 to slot[r] (both look up positions the sequence owns; slots are
unique). A row that continues no row leads a group: the run of rows continuing it in the same direction,
at most max_rows. Only leaders' programs work; the others return at once. A padded row (context 0) leads
a group of one and comes out zero.

The cached keys (positions below the group's first row, p_first) run in KV tiles split as the decode
kernel splits a context; the rows' new keys (p_first .. p_first + n - 1) are taken from the k/v inputs,
rotated at their positions with ROPE, never from the cache (split 0 writes them there in this launch),
and the split holding the last cached tile attends to them as one more small tile ([NEW_PAD, head_dim],
NEW_PAD = max(rows, 16) for tl.dot) after its cached ones. Gathering them into the last cached tile
instead, rotation included, cost the compiled kernel 255 registers and 6 KB of spills at 7B heads (ptxas,
sm_90). The last split to finish merges the splits (the decode kernel's counters and partials, per leader
row). A row's sums run in other dot shapes and tiles than the decode kernel's, so its output may differ
from the decode kernel's in the last bits (as verify rows with more KV splits already did): speculative
decoding stays exact in distribution; greedy output with a draft equals greedy without wherever the
top two logits are not within that rounding. Not for the batch-invariant mode (its tiles keep the
decode kernel).
"""

from __future__ import annotations

import triton
import triton.language as tl

from inference.layers.attention_splits import _finish_splits
from inference.layers.pdl import launch_dependents, wait
from inference.layers.triton_attention_kernels import _dot, _rotate, _softmax_step


@triton.jit
def _verify_attention_kernel(
    q_ptr, kc_ptr, vc_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, counter_ptr,
    k_ptr, v_ptr, slot_ptr, ctx_ptr, bt_ptr, cs_ptr, num_rows, qk_scale, window, max_rows,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_bt,
    stride_kt, stride_kh, stride_vt, stride_vh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    PAGE: tl.constexpr, ROWS_PAD: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    SPLIT_TILES: tl.constexpr, NEW_PAD: tl.constexpr, HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, ROPE: tl.constexpr, PDL: tl.constexpr,
):
    launch_dependents(PDL)
    lead = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    wait(PDL)
    n, step, p_lead = _group(slot_ptr, ctx_ptr, bt_ptr, stride_bt, lead, num_rows, max_rows, PAGE, ROWS_PAD)
    p_first = tl.where(step > 0, p_lead, p_lead - (n - 1))  # the group's positions: p_first .. p_first + n - 1

    # Row m of the tile: launch row lead + m // GROUP_PAD (position p_lead + step * i), query head m % GROUP_PAD.
    m = tl.arange(0, ROWS_PAD * GROUP_PAD)
    i = m // GROUP_PAD
    g = m % GROUP_PAD
    row_valid = (i < n) & (g < GROUP)
    tok = (lead + i).to(tl.int64)
    head = kvh * GROUP + g
    q_pos = tl.where(row_valid, p_lead + step * i, -1)  # -1: an unused row allows no key
    d = tl.arange(0, HEAD_DIM_PAD)
    d_valid = d < HEAD_DIM
    q_rows = q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh
    q_mask = row_valid[:, None] & d_valid[None, :]
    q = tl.load(q_rows + d[None, :], mask=q_mask, other=0.0)
    if ROPE:
        q_partner = tl.load(q_rows + ((d + HEAD_DIM // 2) % HEAD_DIM)[None, :], mask=q_mask, other=0.0)
        cos, sin = _rope_rows(cs_ptr, q_pos, d, q_mask, q_ptr.dtype.element_ty, HEAD_DIM)
        q = _rotate(q, q_partner, cos, sin, (d < HEAD_DIM // 2)[None, :])
    if HAS_WINDOW:  # the earliest row's window starts first; later rows mask the rest
        lo = tl.maximum(p_first - window + 1, 0) // BLOCK_N * BLOCK_N
    else:
        lo = 0
    # Cached keys [lo, p_first) in KV tiles, split as the decode kernel splits them; then the new keys.
    n_tiles = tl.where(n > 0, tl.cdiv(tl.maximum(p_first - lo, 0), BLOCK_N), 0)
    per_split = tl.maximum(tl.cdiv(n_tiles, NUM_SPLITS), SPLIT_TILES)
    t_begin = split * per_split
    t_end = tl.minimum(t_begin + per_split, n_tiles)
    m_i = tl.full([ROWS_PAD * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS_PAD * GROUP_PAD], tl.float32)
    acc = tl.zeros([ROWS_PAD * GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    for t in range(t_begin, t_end):
        m_i, l_i, acc = _verify_tile(t, lo, p_first, lead, kvh, q, q_pos, m_i, l_i, acc, bt_ptr, stride_bt, kc_ptr,
                                     vc_ptr, stride_cb, stride_cs, stride_ch, d, d_valid, qk_scale, window, PAGE,
                                     BLOCK_N, HAS_WINDOW, DOT_PRECISION, DOT_UPCAST)
    # The group's new keys and values (positions p_first + j, j < n, from launch row lead + (p - p_lead) * step),
    # formed after the loop so they hold no registers across it: split 0 stores them (no program of this launch
    # reads those slots); the split holding the last cached tile attends to them as one small tile.
    jn = tl.arange(0, NEW_PAD)
    new_pos = p_first + jn
    new_ok = (jn < n) & (new_pos >= 0)
    src = (lead + (new_pos - p_lead) * step).to(tl.int64)
    k_new, v_new = _new_kv(k_ptr, v_ptr, cs_ptr, src, new_pos, new_ok, kvh, d, d_valid, stride_kt, stride_kh,
                           stride_vt, stride_vh, kc_ptr.dtype.element_ty, ROPE, HEAD_DIM)
    slot = tl.load(slot_ptr + src, mask=new_ok & (jn * 0 + split == 0), other=-1).to(tl.int64)
    dst = (slot // PAGE)[:, None] * stride_cb + (slot % PAGE)[:, None] * stride_cs + kvh * stride_ch + d[None, :]
    store = (slot >= 0)[:, None] & d_valid[None, :]
    tl.store(kc_ptr + dst, k_new, mask=store)
    tl.store(vc_ptr + dst, v_new, mask=store)

    if split == tl.maximum(n_tiles - 1, 0) // per_split:  # the new keys come last, after every cached one
        s = _dot(q, tl.trans(k_new), DOT_PRECISION, DOT_UPCAST) * qk_scale
        allowed = (new_pos[None, :] <= q_pos[:, None]) & new_ok[None, :]
        if HAS_WINDOW:
            allowed = allowed & (new_pos[None, :] > q_pos[:, None] - window)
        m_i, l_i, p, alpha = _softmax_step(tl.where(allowed, s, float("-inf")), m_i, l_i)
        acc = acc * alpha[:, None] + _dot(p.to(v_new.dtype), v_new, DOT_PRECISION, DOT_UPCAST)
    n_tiles = tl.maximum(n_tiles, tl.where(n > 0, 1, 0))  # a group with new keys only is one split's work

    out_offs = tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    out_mask = row_valid[:, None] & d_valid[None, :]
    part = (tok * (tl.num_programs(1) * GROUP) + head) * NUM_SPLITS  # partials [T, Hq, NUM_SPLITS(, D)]
    _finish_splits(out_ptr + out_offs, out_mask, part_m_ptr, part_l_ptr, part_acc_ptr, part, counter_ptr,
                   lead * tl.num_programs(1) + kvh, m_i, l_i, acc, row_valid, d, split, tl.cdiv(n_tiles, per_split),
                   ROWS_PAD * GROUP_PAD, NUM_SPLITS, HEAD_DIM_PAD, False)


@triton.jit
def _group(slot_ptr, ctx_ptr, bt_ptr, stride_bt, lead, num_rows, max_rows, PAGE: tl.constexpr,
           ROWS_PAD: tl.constexpr):
    """(rows in the group `lead` leads: 0 when it continues the row before it; +1 or -1: the direction of
    the group's positions; the leader's position). See the module docstring."""
    j = tl.arange(0, ROWS_PAD)
    r = lead + j  # launch row lead + j, and the row before it, r - 1 (j = 0: the one before the leader)
    live = (r < num_rows) & (r >= 1)
    ctx_r = tl.load(ctx_ptr + r, mask=r < num_rows, other=0)
    ctx_b = tl.load(ctx_ptr + r - 1, mask=live, other=0)
    slot_r = tl.load(slot_ptr + r, mask=r < num_rows, other=-1).to(tl.int64)
    slot_b = tl.load(slot_ptr + r - 1, mask=live, other=-1).to(tl.int64)
    # ascending: row r's table maps ctx_r - 2 to the slot of row r - 1
    at_r = tl.maximum(ctx_r - 2, 0)
    page_r = tl.load(bt_ptr + r.to(tl.int64) * stride_bt + at_r // PAGE, mask=live & (ctx_r >= 2), other=0)
    up = live & (ctx_r >= 2) & (ctx_b == ctx_r - 1) & (slot_b == page_r.to(tl.int64) * PAGE + at_r % PAGE)
    # descending: row r - 1's table maps ctx_b - 2 to the slot of row r
    at_b = tl.maximum(ctx_b - 2, 0)
    page_b = tl.load(bt_ptr + (r - 1).to(tl.int64) * stride_bt + at_b // PAGE, mask=live & (ctx_b >= 2), other=0)
    down = live & (ctx_b >= 2) & (ctx_r == ctx_b - 1) & (slot_r == page_b.to(tl.int64) * PAGE + at_b % PAGE)
    leads = tl.sum(tl.where(j == 0, (up | down).to(tl.int32), 0), axis=0) == 0
    step = tl.where(tl.sum(tl.where(j == 1, down.to(tl.int32), 0), axis=0) > 0, -1, 1)
    same = tl.where(step > 0, up, down)
    n = tl.min(tl.where((j >= 1) & ((same == 0) | (j >= max_rows)), j, ROWS_PAD), axis=0)
    p_lead = tl.sum(tl.where(j == 0, ctx_r, 0), axis=0) - 1
    return tl.where(leads, n, 0), step, p_lead


@triton.jit
def _rope_rows(cs_ptr, pos, d, mask, dtype: tl.constexpr, HEAD_DIM: tl.constexpr):
    """cos and sin [rows, HEAD_DIM_PAD] at each row's position (both halves repeated), rounded to `dtype`
    as the decode kernel's _rope_table rounds them."""
    at = cs_ptr + tl.maximum(pos, 0).to(tl.int64)[:, None] * HEAD_DIM + (d % (HEAD_DIM // 2))[None, :]
    cos = tl.load(at, mask=mask, other=0.0).to(dtype).to(tl.float32)
    sin = tl.load(at + HEAD_DIM // 2, mask=mask, other=0.0).to(dtype).to(tl.float32)
    return cos, sin


@triton.jit
def _new_kv(k_ptr, v_ptr, cs_ptr, src, pos, ok, kvh, d, d_valid, stride_kt, stride_kh, stride_vt, stride_vh,
            dtype: tl.constexpr, ROPE: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The new k (rotated at `pos` with ROPE) and v [NEW_PAD, HEAD_DIM_PAD] of launch rows `src`, in the cache
    dtype: the bytes split 0 stores, rounded as the decode kernel's _store_new_kv rounds them; zeros where
    not `ok`."""
    mask = ok[:, None] & d_valid[None, :]
    k_rows = k_ptr + src[:, None] * stride_kt + kvh * stride_kh
    k = tl.load(k_rows + d[None, :], mask=mask, other=0.0)
    if ROPE:
        partner = tl.load(k_rows + ((d + HEAD_DIM // 2) % HEAD_DIM)[None, :], mask=mask, other=0.0)
        cos, sin = _rope_rows(cs_ptr, pos, d, mask, k_ptr.dtype.element_ty, HEAD_DIM)
        k = _rotate(k, partner, cos, sin, (d < HEAD_DIM // 2)[None, :])
    v = tl.load(v_ptr + src[:, None] * stride_vt + kvh * stride_vh + d[None, :], mask=mask, other=0.0)
    return k.to(dtype), v.to(dtype)


@triton.jit
def _verify_tile(t, lo, hi, lead, kvh, q, q_pos, m_i, l_i, acc, bt_ptr, stride_bt, kc_ptr, vc_ptr, stride_cb,
                 stride_cs, stride_ch, d, d_valid, qk_scale, window, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                 HAS_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """Cached KV tile t (keys below `hi`) against every row of the group, folded into the online softmax."""
    k_pos = lo + t * BLOCK_N + tl.arange(0, BLOCK_N)
    k_valid = k_pos < hi
    page = tl.load(bt_ptr + lead.to(tl.int64) * stride_bt + k_pos // PAGE, mask=k_valid, other=0).to(tl.int64)
    kv_off = page * stride_cb + (k_pos % PAGE) * stride_cs + kvh * stride_ch
    k_t = tl.load(kc_ptr + kv_off[None, :] + d[:, None], mask=k_valid[None, :] & d_valid[:, None], other=0.0)
    s = _dot(q, k_t, DOT_PRECISION, DOT_UPCAST) * qk_scale
    allowed = (k_pos[None, :] <= q_pos[:, None]) & k_valid[None, :]
    if HAS_WINDOW:
        allowed = allowed & (k_pos[None, :] > q_pos[:, None] - window)
    m_new, l_i, p, alpha = _softmax_step(tl.where(allowed, s, float("-inf")), m_i, l_i)
    v = tl.load(vc_ptr + kv_off[:, None] + d[None, :], mask=k_valid[:, None] & d_valid[None, :], other=0.0)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, DOT_UPCAST)
    return m_new, l_i, acc
