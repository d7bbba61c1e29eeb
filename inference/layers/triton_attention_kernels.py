"""Triton kernels of the "triton" attention backend (inference/layers/triton_attention.py plans and
launches them).

_store_kv_kernel writes each token's k/v at its slot (slot < 0, a padded row, is skipped): prefill only.
_paged_attention_kernel runs one program per (query tile, kv head, kv split); a tile holds BLOCK_Q tokens
x GROUP_PAD query heads of one kv head (GQA), so each KV tile is loaded once for the whole group; online
softmax in fp32, base 2. In decode it also stores the new token's k/v (split 0 writes them; every split
takes key ctx - 1 from k/v, not from the cache), rotates q and the new key with ROPE, and ends in
attention_splits._finish_splits: a context within one split is normalized by split 0 alone, a longer one
is merged by the last split to finish. SEGMENT > 0 (the batch-invariant mode): the keys are cut into fixed
segments of SEGMENT tiles from key 0; a decode split is one segment, and prefill folds the segments in order
as the decode merge does (attention_splits, FOLD), so split-KV decode and prefill agree bit for bit. Several
rows of one sequence in a launch (spec-decode verify, MULTI_ROW): no row reads another row's new key from the
cache; for keys ctx - max_rows .. ctx - 2 a program finds the launch row that writes each key (the rows of a
sequence are consecutive) and takes its k and v from the inputs. Every kernel takes PDL: nothing is read or
written before wait(PDL).
"""

from __future__ import annotations

import triton
import triton.language as tl

from inference.layers.attention_splits import _finish_splits, _fold
from inference.layers.pdl import launch_dependents, wait

LOG2E = 1.4426950408889634


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_cs, stride_ch,
                     NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                     HEAD_DIM_PAD: tl.constexpr, PAGE: tl.constexpr, PDL: tl.constexpr):
    launch_dependents(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    wait(PDL)
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


# stride_bt is the width of an eager step's block table (the longest context's blocks), so it changes with the
# batch: specialized, Triton would compile the kernel again whenever it moved into or out of its "multiple of
# 16" class (a longest prompt of 241-256 keys at 16-key pages). The start-up warm-up's short prompts never
# reach that class, so the first rollout batch would compile it for each of its prefill tiles (the likeliest
# part of the first batch's 1.76x on the H100, 2026-12-08; scripts/bench/first_batch.py names what it
# compiles). Only one load per KV tile reads through it: no hint pays for the compiles.
@triton.jit(do_not_specialize=["stride_bt"])
def _paged_attention_kernel(
    q_ptr, kc_ptr, vc_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, counter_ptr,
    k_ptr, v_ptr, slot_ptr, cu_q_ptr, ctx_ptr, bt_ptr, cs_ptr, pos_ptr, num_seqs, qk_scale, window, max_rows,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_bt,
    stride_kt, stride_kh, stride_vt, stride_vh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr,
    NUM_SPLITS: tl.constexpr, SPLIT_TILES: tl.constexpr, IS_DECODE: tl.constexpr, HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    MULTI_ROW: tl.constexpr, ROPE: tl.constexpr, SEGMENT: tl.constexpr, PDL: tl.constexpr,
):
    launch_dependents(PDL)  # the next kernel (o_proj) waits for this whole grid before it reads `out`
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    wait(PDL)  # q/k/v, the caches and the metadata are written by earlier kernels and copies
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
    if ROPE:  # decode with unrotated q/k (see _rope_table): this token's cos/sin, rounded to the dtype
        cos, sin = _rope_table(cs_ptr, tl.load(pos_ptr + seq), d, q_ptr.dtype.element_ty, HEAD_DIM)
    else:
        cos = d.to(tl.float32)  # unused
        sin = cos
    if IS_DECODE:  # the new token's k/v come from k_ptr/v_ptr, and split 0 writes them to the cache
        k_new, v_new = _store_new_kv(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, seq, kvh, d, d_valid, split,
                                     stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_cs, stride_ch,
                                     cos, sin, PAGE, ROPE, HEAD_DIM)
    else:  # placeholders: _attend_tile reads them only in decode
        k_new = cos
        v_new = cos
    q_rows = q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh
    q_mask = row_valid[:, None] & d_valid[None, :]
    q = tl.load(q_rows + d[None, :], mask=q_mask, other=0.0)
    if ROPE:
        q_partner = tl.load(q_rows + ((d + HEAD_DIM // 2) % HEAD_DIM)[None, :], mask=q_mask, other=0.0)
        q = _rotate(q, q_partner, cos[None, :], sin[None, :], (d < HEAD_DIM // 2)[None, :])

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
    # MULTI_ROW: keys ctx - max_rows .. ctx - 2 may be new keys of other rows of this launch, so the tiles
    # from t_near on check who writes each key. They run in a loop of their own: a branch inside the main
    # loop stops Triton pipelining its loads (1.5-1.8x the time per layer on the H200; docs/dev/benchmark-log.md). A row
    # whose neighbours in the launch do not write its key ctx - 2 holds the only row of its sequence (the
    # rows of one sequence are consecutive, in consecutive positions): a plain decode row with a draft
    # model takes every tile in the first loop. The tiles and their order are the same either way, so
    # are the bits.
    if MULTI_ROW:
        before = tl.maximum(ctx - 2, 0)
        slot_before = (tl.load(bt_ptr + seq * stride_bt + before // PAGE).to(tl.int64) * PAGE + before % PAGE)
        slot_prev = tl.load(slot_ptr + tl.maximum(seq - 1, 0)).to(tl.int64)
        slot_next = tl.load(slot_ptr + tl.minimum(seq + 1, num_seqs - 1)).to(tl.int64)
        shared = (ctx >= 2) & (((seq > 0) & (slot_prev == slot_before))
                               | ((seq + 1 < num_seqs) & (slot_next == slot_before)))
        t_near = tl.where(shared, tl.maximum(ctx - max_rows - lo, 0) // BLOCK_N, t_end)
        t_mid = tl.minimum(tl.maximum(t_near, t_begin), t_end)
    else:
        t_mid = t_end
    if SEGMENT > 0 and not IS_DECODE:
        # The batch-invariant mode's key segments (attention_splits, FOLD): each SEGMENT tiles from key 0
        # start a fresh online softmax and are folded in order, as decode's splits are merged.
        m_run = m_i
        l_run = l_i
        acc_run = acc
        for s0 in range(t_begin, t_mid, SEGMENT):
            m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
            acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM_PAD], tl.float32)
            for t in range(s0, tl.minimum(s0 + SEGMENT, t_mid)):
                m_i, l_i, acc = _attend_tile(
                    t, lo, hi, ctx, max_rows, num_seqs, seq, kvh, q, q_pos, m_i, l_i, acc, bt_ptr, stride_bt,
                    kc_ptr, vc_ptr, stride_cb, stride_cs, stride_ch, d, d_valid, k_new, v_new, slot_ptr, k_ptr,
                    v_ptr, cs_ptr, stride_kt, stride_kh, stride_vt, stride_vh, qk_scale, window, PAGE, BLOCK_N,
                    IS_DECODE, False, HAS_WINDOW, DOT_PRECISION, DOT_UPCAST, ROPE, HEAD_DIM)
            m_run, l_run, acc_run = _fold(m_run, l_run, acc_run, m_i, l_i, acc)
        m_i = m_run
        l_i = l_run
        acc = acc_run
    else:
        for t in range(t_begin, t_mid):
            m_i, l_i, acc = _attend_tile(
                t, lo, hi, ctx, max_rows, num_seqs, seq, kvh, q, q_pos, m_i, l_i, acc, bt_ptr, stride_bt,
                kc_ptr, vc_ptr, stride_cb, stride_cs, stride_ch, d, d_valid, k_new, v_new, slot_ptr, k_ptr, v_ptr,
                cs_ptr, stride_kt, stride_kh, stride_vt, stride_vh, qk_scale, window, PAGE, BLOCK_N, IS_DECODE,
                False, HAS_WINDOW, DOT_PRECISION, DOT_UPCAST, ROPE, HEAD_DIM)
    if MULTI_ROW:
        for t in range(t_mid, t_end):
            m_i, l_i, acc = _attend_tile(
                t, lo, hi, ctx, max_rows, num_seqs, seq, kvh, q, q_pos, m_i, l_i, acc, bt_ptr, stride_bt,
                kc_ptr, vc_ptr, stride_cb, stride_cs, stride_ch, d, d_valid, k_new, v_new, slot_ptr, k_ptr, v_ptr,
                cs_ptr, stride_kt, stride_kh, stride_vt, stride_vh, qk_scale, window, PAGE, BLOCK_N, IS_DECODE,
                True, HAS_WINDOW, DOT_PRECISION, DOT_UPCAST, ROPE, HEAD_DIM)

    out_offs = tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    out_mask = row_valid[:, None] & d_valid[None, :]
    # partials laid out [T, Hq, NUM_SPLITS(, HEAD_DIM_PAD)]
    part = (tok * (tl.num_programs(1) * GROUP) + head) * NUM_SPLITS
    _finish_splits(out_ptr + out_offs, out_mask, part_m_ptr, part_l_ptr, part_acc_ptr, part, counter_ptr,
                   seq * tl.num_programs(1) + kvh, m_i, l_i, acc, row_valid, d, split, tl.cdiv(n_tiles, per_split),
                   BLOCK_Q * GROUP_PAD, NUM_SPLITS, HEAD_DIM_PAD, SEGMENT > 0)


@triton.jit
def _attend_tile(t, lo, hi, ctx, max_rows, num_seqs, seq, kvh, q, q_pos, m_i, l_i, acc, bt_ptr, stride_bt,
                 kc_ptr, vc_ptr, stride_cb, stride_cs, stride_ch, d, d_valid, k_new, v_new, slot_ptr, k_ptr, v_ptr,
                 cs_ptr, stride_kt, stride_kh, stride_vt, stride_vh, qk_scale, window,
                 PAGE: tl.constexpr, BLOCK_N: tl.constexpr, IS_DECODE: tl.constexpr, CHECK_OWNERS: tl.constexpr,
                 HAS_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
                 ROPE: tl.constexpr, HEAD_DIM: tl.constexpr):
    """KV tile t of one program: its keys' scores against the tile's queries, folded into the online
    softmax (m_i, l_i, acc), which it returns. CHECK_OWNERS: keys written by other rows of this launch
    come from k/v (the multi-row tiles of _paged_attention_kernel)."""
    k_pos = lo + t * BLOCK_N + tl.arange(0, BLOCK_N)
    k_valid = k_pos < hi
    page = tl.load(bt_ptr + seq * stride_bt + k_pos // PAGE, mask=k_valid, other=0).to(tl.int64)
    kv_off = page * stride_cb + (k_pos % PAGE) * stride_cs + kvh * stride_ch
    # Masked loads return 0, never stale cache bytes (which may hold NaN) that p = 0 would not hide.
    k_t = tl.load(kc_ptr + kv_off[None, :] + d[:, None], mask=k_valid[None, :] & d_valid[:, None], other=0.0)
    if IS_DECODE:  # the cache slot of key ctx - 1 may not be written yet: take the new key itself
        is_new = k_pos == ctx - 1
        k_t = tl.where(is_new[None, :], k_new[:, None], k_t)
    if CHECK_OWNERS:
        owner = tl.full([BLOCK_N], -1, tl.int64)
        near = (lo + t * BLOCK_N + BLOCK_N > ctx - max_rows) & (lo + t * BLOCK_N < ctx - 1)
        if near:  # only the last tile or two
            owner = _launch_owners(slot_ptr, seq, k_pos, page, ctx, max_rows, num_seqs, PAGE)
            k_own = _owned_k(k_ptr, kc_ptr, cs_ptr, owner, k_pos, kvh, d, d_valid, stride_kt, stride_kh,
                             ROPE, HEAD_DIM)
            k_t = tl.where(owner[None, :] >= 0, k_own, k_t)
    s = _dot(q, k_t, DOT_PRECISION, DOT_UPCAST) * qk_scale
    allowed = (k_pos[None, :] <= q_pos[:, None]) & k_valid[None, :]
    if HAS_WINDOW:
        allowed = allowed & (k_pos[None, :] > q_pos[:, None] - window)
    s = tl.where(allowed, s, float("-inf"))
    m_new, l_i, p, alpha = _softmax_step(s, m_i, l_i)
    v = tl.load(vc_ptr + kv_off[:, None] + d[None, :], mask=k_valid[:, None] & d_valid[None, :], other=0.0)
    if IS_DECODE:
        v = tl.where(is_new[:, None], v_new[None, :], v)
    if CHECK_OWNERS:  # noqa: SIM102 - `near` exists only under the constexpr, so the two ifs stay apart
        if near:
            owned = owner >= 0
            v_own = tl.load(v_ptr + tl.maximum(owner, 0)[:, None] * stride_vt + kvh * stride_vh + d[None, :],
                            mask=owned[:, None] & d_valid[None, :], other=0.0)
            v = tl.where(owned[:, None], v_own.to(vc_ptr.dtype.element_ty), v)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, DOT_UPCAST)
    return m_new, l_i, acc


@triton.jit
def _softmax_step(s, m_i, l_i):
    """One KV tile's scores s [rows, keys] (base 2, -inf where not allowed) folded into the running max
    m_i and sum l_i: (new max, new sum, the tile's weights p, the rescale alpha of the old accumulator)."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # A row with no allowed key yet keeps m = -inf; subtracting 0 instead avoids inf - inf = NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    return m_new, l_i * alpha + tl.sum(p, axis=1), p, alpha


@triton.jit
def _launch_owners(slot_ptr, seq, k_pos, page, ctx, max_rows, num_rows, PAGE: tl.constexpr):
    """Per key of the tile: the row of this launch that writes it (stores its new k/v at its slot), or -1.

    Key p = ctx - 1 - j (1 <= j < max_rows) of row `seq` is written in this launch iff another row of the
    same sequence stands for position p; the rows of a sequence are consecutive (ascending or descending
    in position), so that is row seq - j or seq + j, and it is the one whose slot equals p's cache slot.
    Slots are unique, so rows of other sequences never match, nor do padded rows (slot -1)."""
    j = ctx - 1 - k_pos
    cand = (j >= 1) & (j < max_rows)
    slot = page * PAGE + k_pos % PAGE
    before = seq - j
    after = seq + j
    # Masked loads: no memory is read where no candidate row exists.
    slot_b = tl.load(slot_ptr + before, mask=cand & (before >= 0), other=-1).to(tl.int64)
    slot_a = tl.load(slot_ptr + after, mask=cand & (after < num_rows), other=-1).to(tl.int64)
    owner = tl.where(cand & (slot_b == slot), before, -1)
    owner = tl.where(cand & (slot_a == slot) & (owner < 0), after, owner)
    return owner.to(tl.int64)


@triton.jit
def _owned_k(k_ptr, kc_ptr, cs_ptr, owner, k_pos, kvh, d, d_valid, stride_kt, stride_kh,
             ROPE: tl.constexpr, HEAD_DIM: tl.constexpr):
    """K tile [HEAD_DIM_PAD, BLOCK_N] of the owner rows' new keys in the cache dtype (the bytes each owner
    row stores: with ROPE rotated at the key's position, which is the owner row's); zeros where owner < 0,
    which loads nothing."""
    owned = owner >= 0
    k_rows = k_ptr + tl.maximum(owner, 0)[None, :] * stride_kt + kvh * stride_kh
    mask = d_valid[:, None] & owned[None, :]
    k = tl.load(k_rows + d[:, None], mask=mask, other=0.0)
    if ROPE:
        partner = tl.load(k_rows + ((d + HEAD_DIM // 2) % HEAD_DIM)[:, None], mask=mask, other=0.0)
        at = cs_ptr + tl.maximum(k_pos, 0).to(tl.int64)[None, :] * HEAD_DIM + (d % (HEAD_DIM // 2))[:, None]
        cos = tl.load(at, mask=mask, other=0.0).to(k.dtype).to(tl.float32)
        sin = tl.load(at + HEAD_DIM // 2, mask=mask, other=0.0).to(k.dtype).to(tl.float32)
        k = _rotate(k, partner, cos, sin, (d < HEAD_DIM // 2)[:, None])
    return k.to(kc_ptr.dtype.element_ty)


@triton.jit
def _rope_table(cs_ptr, pos, d, dtype: tl.constexpr, HEAD_DIM: tl.constexpr):
    """cos and sin [HEAD_DIM] of position `pos` (both halves repeated, as HF's cos/sin), read from the
    fp32 table [positions, cos | sin] and rounded to `dtype` as the eager rotary path rounds them.

    ROPE launches take q and k before the rotation (decode only): each program rotates the q rows and the
    new k it reads, rounding where inference/layers/fused.py's rotary kernel rounds (compiled, FP contraction
    may fuse a product into the add differently there: one rounding apart in a few elements); one launch a
    layer fewer."""
    j = d % (HEAD_DIM // 2)
    row = cs_ptr + tl.maximum(pos, 0).to(tl.int64) * HEAD_DIM
    cos = tl.load(row + j).to(dtype).to(tl.float32)
    sin = tl.load(row + HEAD_DIM // 2 + j).to(dtype).to(tl.float32)
    return cos, sin


@triton.jit
def _rotate(x, partner, cos, sin, first_half):
    """x * cos + rotate_half(x) * sin in x's dtype, elementwise: partner is x with its halves swapped,
    negated in the first half. Each product and the sum round to the dtype, as eager torch rounds."""
    dt = x.dtype
    turned = tl.where(first_half, -partner.to(tl.float32), partner.to(tl.float32))
    out = (x.to(tl.float32) * cos).to(dt).to(tl.float32) + (turned * sin).to(dt).to(tl.float32)
    return out.to(dt)


@triton.jit
def _store_new_kv(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, seq, kvh, d, d_valid, split,
                  stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_cs, stride_ch, cos, sin,
                  PAGE: tl.constexpr, ROPE: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The new token's k and v [HEAD_DIM_PAD] of one kv head, in the cache dtype (k rotated first with
    ROPE); split 0 stores them at the token's slot (none for slot < 0). No row of the launch reads that
    slot's bytes: the other rows of its sequence take them from k/v too (_launch_owners, _owned_k)."""
    tok = seq.to(tl.int64)
    k_row = k_ptr + tok * stride_kt + kvh * stride_kh
    k_new = tl.load(k_row + d, mask=d_valid, other=0.0)
    if ROPE:
        partner = tl.load(k_row + (d + HEAD_DIM // 2) % HEAD_DIM, mask=d_valid, other=0.0)
        k_new = _rotate(k_new, partner, cos, sin, d < HEAD_DIM // 2)
    k_new = k_new.to(kc_ptr.dtype.element_ty)
    v_new = tl.load(v_ptr + tok * stride_vt + kvh * stride_vh + d, mask=d_valid, other=0.0).to(vc_ptr.dtype.element_ty)
    # Vectors, not scalars, in the mask: a scalar term in a load/store mask trips Triton's interpreter.
    slot = tl.load(slot_ptr + tok + d * 0).to(tl.int64)
    mask = d_valid & (slot >= 0) & (d * 0 + split == 0)
    dst = (slot // PAGE) * stride_cb + (slot % PAGE) * stride_cs + kvh * stride_ch + d
    tl.store(kc_ptr + dst, k_new, mask=mask)
    tl.store(vc_ptr + dst, v_new, mask=mask)
    return k_new, v_new
