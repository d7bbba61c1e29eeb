"""The end of a decode attention program over KV splits (triton_attention_kernels.py): a single pass
normalizes and stores its rows; split programs write fp32 partials, and the last split to finish merges
them. The merge sums the splits in split order, so the result does not depend on which split merges.

FOLD (the batch-invariant mode's key segments, TritonAttentionTiles.segment_tiles): the splits are fixed
segments of the keys, and the merge folds them one at a time in segment order with `_fold`, which is
exactly what a prefill program does at each segment boundary, so decode at any batch and prefill give a
query the same bits."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _finish_splits(out_ptrs, out_mask, part_m_ptr, part_l_ptr, part_acc_ptr, part, counter_ptr, counter, m_i, l_i, acc,
                   row_valid, d, split, n_active, ROWS: tl.constexpr, NUM_SPLITS: tl.constexpr,
                   HEAD_DIM_PAD: tl.constexpr, FOLD: tl.constexpr):
    """A decode program's end: one split normalizes and stores its rows; several write partials
    ([T, Hq, NUM_SPLITS(, D)] at `part`) and the last of the n_active live splits to finish (an acq_rel
    ticket on counter_ptr[counter], reset by it) merges them."""
    if NUM_SPLITS == 1:
        _store_normalized(out_ptrs, acc, l_i, out_mask)
    else:
        if n_active <= 1:  # the whole context is in split 0 (or empty): single pass
            if split == 0:
                _store_normalized(out_ptrs, acc, l_i, out_mask)
        elif split < n_active:
            _store_partial(part_m_ptr, part_l_ptr, part_acc_ptr, part + split, d, m_i, l_i, acc, row_valid,
                           HEAD_DIM_PAD)
            # Every thread's partial is written before the release; the acquire orders the merge's loads.
            tl.debug_barrier()
            ticket = tl.atomic_add(counter_ptr + counter, 1, sem="acq_rel", scope="gpu")
            if ticket == n_active - 1:
                if FOLD:
                    _fold_partials(part_m_ptr, part_l_ptr, part_acc_ptr, part, d, n_active, row_valid, out_ptrs,
                                   out_mask, ROWS, NUM_SPLITS, HEAD_DIM_PAD)
                else:
                    _merge_partials(part_m_ptr, part_l_ptr, part_acc_ptr, part, d, n_active, row_valid, out_ptrs,
                                    out_mask, ROWS, NUM_SPLITS, HEAD_DIM_PAD)
                tl.store(counter_ptr + counter, 0)


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
    depend on which split merges). Loads bypass L1 (.cg): the other splits wrote through L2. The loads
    of all live splits are in flight at once (a split past n_active adds exact zeros)."""
    s = tl.arange(0, NUM_SPLITS)
    live = row_valid[:, None] & (s[None, :] < n_active)
    ms = tl.load(part_m_ptr + part[:, None] + s[None, :], mask=live, other=float("-inf"), cache_modifier=".cg")
    ls = tl.load(part_l_ptr + part[:, None] + s[None, :], mask=live, other=0.0, cache_modifier=".cg")
    m_max = tl.max(ms, axis=1)
    m_ref = tl.where(m_max == float("-inf"), 0.0, m_max)
    denom = tl.sum(tl.exp2(ms - m_ref[:, None]) * ls, axis=1)
    total = tl.zeros([ROWS, HEAD_DIM_PAD], tl.float32)
    for j in tl.static_range(NUM_SPLITS):
        total = _add_split(part_m_ptr, part_acc_ptr, part, d, j, n_active, row_valid, m_ref, total, HEAD_DIM_PAD)
    _store_normalized(out_ptrs, total, denom, out_mask)


@triton.jit
def _add_split(part_m_ptr, part_acc_ptr, part, d, j, n_active, row_valid, m_ref, total, HEAD_DIM_PAD: tl.constexpr):
    """total + split j's partial accumulator, rescaled to the rows' common max (nothing past n_active)."""
    live_j = row_valid & (part * 0 + j < n_active)  # a vector: scalar mask terms trip the interpreter
    m_j = tl.load(part_m_ptr + part + j, mask=live_j, other=float("-inf"), cache_modifier=".cg")
    a_j = tl.load(part_acc_ptr + (part + j)[:, None] * HEAD_DIM_PAD + d[None, :], mask=live_j[:, None],
                  other=0.0, cache_modifier=".cg")
    return total + a_j * tl.exp2(m_j - m_ref)[:, None]


@triton.jit
def _fold(m, total, acc, m_s, total_s, acc_s):
    """(m, total, acc) of the keys so far (running max, softmax sum, accumulator) with the next segment's
    (m_s, total_s, acc_s) added, both rescaled to the new max. Folding a segment with no allowed key
    ((-inf, 0, 0)) changes no bit, and folding the first into (-inf, 0, 0) gives its sums exactly."""
    m_new = tl.maximum(m, m_s)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    a = tl.exp2(m - m_safe)
    b = tl.exp2(m_s - m_safe)
    return m_new, total * a + total_s * b, acc * a[:, None] + acc_s * b[:, None]


@triton.jit
def _fold_partials(part_m_ptr, part_l_ptr, part_acc_ptr, part, d, n_active, row_valid, out_ptrs, out_mask,
                   ROWS: tl.constexpr, NUM_SPLITS: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
    """The FOLD merge: splits [0, n_active) folded one at a time in split order (loads bypass L1, as
    _merge_partials'), then normalized."""
    m = tl.full([ROWS], float("-inf"), tl.float32)
    l_sum = tl.zeros([ROWS], tl.float32)
    total = tl.zeros([ROWS, HEAD_DIM_PAD], tl.float32)
    for j in range(0, n_active):  # every split of the loop is live: only padded rows are masked
        m_j = tl.load(part_m_ptr + part + j, mask=row_valid, other=float("-inf"), cache_modifier=".cg")
        l_j = tl.load(part_l_ptr + part + j, mask=row_valid, other=0.0, cache_modifier=".cg")
        a_j = tl.load(part_acc_ptr + (part + j)[:, None] * HEAD_DIM_PAD + d[None, :], mask=row_valid[:, None],
                      other=0.0, cache_modifier=".cg")
        m, l_sum, total = _fold(m, l_sum, total, m_j, l_j, a_j)
    _store_normalized(out_ptrs, total, l_sum, out_mask)
