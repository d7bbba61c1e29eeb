"""The sampler's noise, thresholds and race: Triton kernels and the torch twins they must equal.

Each torch twin is the definition, and its Triton kernel computes the same bits (the thresholds: the
same logit, up to the summation order at the top-p boundary); the tests hold each pair equal.
- Noise (`uniforms_torch`, `log_exponential_torch`): a counter-based generator. The uniform of (row
  seed, output position, vocabulary index) is a pure function of the three integers, so a row's draw
  depends on nothing else in the batch.
- Race (`race_torch`): the token is the first index of the max of x - log E over the kept entries,
  x the temperature-scaled logit. Programs cover fixed column chunks (_RACE_SPAN), so neither a row's
  token nor any bit of its processed logprob follows the batch.
- Thresholds (`thresholds_torch`): top-k and top-p as one logit threshold per row, ties kept, so the
  kept set depends on values only, never on an order; the kernel finds it without a sort.
"""

from __future__ import annotations

import math
import struct
from typing import NamedTuple

import torch

from inference.layers.invariant import row_sum  # the twins sum each row alone, whatever the batch

try:
    import triton
    import triton.language as tl
except ImportError:  # the sampler runs its torch twins
    triton = None

_M32 = 0xFFFFFFFF
_MUL0, _MUL1 = 0x7FEB352D, 0x846CA68B  # lowbias32's multipliers
_SALT0, _SALT1 = 0x9E3779B9, 0x85EBCA6B  # the position's salt in each key word
W_SCALE = 2.0 ** -32
W_MAX = 1.0 - 2.0 ** -24
SMALL_W = 2.0 ** -7
SERIES_C2 = 5.0 / 24.0
MAX_INV_TEMP = torch.finfo(torch.float32).max
_RACE_SPAN = 4096  # columns per race program: fixed, so a row's reduction order never follows the batch
_RACE_BLOCK = 1024
_CANDS = 16  # thresholds probed per pass of the search
_SEARCH_BLOCK = 256
_KEY_SHIFT = {torch.bfloat16: 16, torch.float16: 13, torch.float32: 0}  # low bits zero in every value


# ---- noise (torch twin) -------------------------------------------------------------------------------
def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32) held in int64, without a signed overflow."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def mix32_torch(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, _MUL0)
    x = x ^ (x >> 15)
    x = _mul32(x, _MUL1)
    return x ^ (x >> 16)


def row_keys_torch(seeds: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two 32-bit key words per row (int64 holding uint32) of (seed [B] int64 >= 0, position [B]),
    mixed by lowbias32-style 32-bit rounds (xor-shift, multiply). torch holds the uint32 words in int64
    (masked, multiplied in 16-bit halves so nothing overflows), so it computes the kernels' integers."""
    s0, s1, p = seeds & _M32, (seeds >> 32) & _M32, positions & _M32
    k0 = mix32_torch(s0 ^ mix32_torch(s1 ^ mix32_torch(p ^ _SALT0)))
    k1 = mix32_torch(s1 ^ mix32_torch(s0 ^ mix32_torch(p ^ _SALT1)))
    return k0, k1


def uniforms_torch(seeds: torch.Tensor, positions: torch.Tensor, n_cols: int) -> torch.Tensor:
    """w [B, n_cols] float32 in (0, 1): the uniform of (seed, position, column) per row.

    The column goes through two more rounds, h = mix(mix(column ^ k0) ^ k1): a bijection of the column
    for each key (a row's hashes never collide), and the outer round keeps two rows whose keys differ in
    few bits from drawing related noise. w = fl(fl(h) + 0.5) * 2^-32, clamped to 1 - 2^-24."""
    k0, k1 = row_keys_torch(seeds, positions)
    cols = torch.arange(n_cols, dtype=torch.int64, device=seeds.device)
    h = mix32_torch(mix32_torch(cols[None, :] ^ k0[:, None]) ^ k1[:, None])
    return ((h.float() + 0.5) * W_SCALE).clamp_max(W_MAX)


def log_exponential_torch(w: torch.Tensor) -> torch.Tensor:
    """log E with E = -log(1 - w) ~ Exp(1): log w + w/2 + 5w^2/24 for w < 2^-7 (error < 2^-24), else
    log(-log(1 - w)). A small E, the one that wins a race for a rare token, keeps its relative precision
    down to 2^-33 (a float32 uniform fed to -log(u) bottoms out at 6e-8)."""
    small = w < SMALL_W
    log_t = torch.log(torch.where(small, w, 1.0 - w))
    return torch.where(small, log_t + w * (0.5 + w * SERIES_C2), torch.log(-log_t))


# ---- thresholds and race (torch twins) ----------------------------------------------------------------
def thresholds_torch(logits: torch.Tensor, row_max: torch.Tensor, inv_temps: torch.Tensor, top_ks: torch.Tensor,
                     top_ps: torch.Tensor) -> torch.Tensor:
    """thr [B] float32, the definition by a sort (-inf where a row has neither filter).

    thr = max(top-k's: the k-th largest logit; top-p's: the smallest logit v of the top-k survivors whose
    mass strictly above v is < p times their total mass). Ties at a threshold all stay and the top token
    always stays (a top_p that underflows float32 keeps exactly the tokens tied at the max). A row keeps
    the entries with logit >= thr and x >= log(min_p) (`scaled_logits`)."""
    vals = logits.float().sort(dim=-1, descending=True).values
    n_cols = vals.shape[-1]
    ks = top_ks.long().clamp(1, n_cols)
    thr_k = vals.gather(1, (ks - 1)[:, None]).squeeze(1)
    thr_k = torch.where(top_ks.long() < n_cols, thr_k, float("-inf"))
    w = torch.exp((vals - row_max[:, None]) * inv_temps[:, None])
    w = torch.where(vals >= thr_k[:, None], w, 0.0)
    before = w.cumsum(-1) - w
    # mass strictly above a value: the exclusive sum at the first entry of its tie group
    group_start = torch.searchsorted(-vals, -vals, right=False)
    above = before.gather(1, group_start)
    kept = above < top_ps[:, None] * row_sum(w)[:, None]
    kept[:, 0] = True  # the top token always stays
    thr_p = vals.gather(1, kept.sum(-1, keepdim=True) - 1).squeeze(1)
    thr_p = torch.where(top_ps < 1.0, thr_p, float("-inf"))
    return torch.maximum(thr_k, thr_p)


def scaled_logits(logits: torch.Tensor, row_max: torch.Tensor, inv_temps: torch.Tensor,
                  thresholds: torch.Tensor | None, log_min_ps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, keep) [B, V]: x = (logit - row max) / T in float32 and the kept mask, as the race kernel has them."""
    lg = logits.float()
    x = (lg - row_max[:, None]) * inv_temps[:, None]
    keep = x >= log_min_ps[:, None]
    if thresholds is not None:
        keep &= lg >= thresholds[:, None]
    return x, keep


def race_torch(x: torch.Tensor, keep: torch.Tensor, seeds: torch.Tensor,
               positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(token [B] int64, mass [B] float32): the race's winner and the sum of exp(x) over kept entries.

    x = (logit - row max) * (1 / T) in float32, so x <= 0 for every finite T > 0 (1/T is clamped to the
    largest float32): no temperature overflows, and the top token has x = 0. Kept entries score
    x - log E, others -inf; the token is the first index of the max score (argmax's tie rule). Its
    processed logprob is x - log(mass). The kernel reduces per (row, chunk of _RACE_SPAN columns)
    programs to (max score, first index, mass), a chunk geometry that does not depend on the batch."""
    log_e = log_exponential_torch(uniforms_torch(seeds, positions, x.shape[-1]))
    score = torch.where(keep, x - log_e, float("-inf"))
    return score.argmax(dim=-1), row_sum(torch.where(keep, x.exp(), 0.0))


# ---- Triton ----------------------------------------------------------------------------------------------
def float_key(v: float) -> int:
    """The order-preserving int32 key of a float32 (the kernels' `_key`)."""
    bits = struct.unpack("<i", struct.pack("<f", v))[0]
    return bits if bits >= 0 else bits ^ 0x7FFFFFFF


def thresholds_triton(logits: torch.Tensor, row_max: torch.Tensor, inv_temps: torch.Tensor, top_ks: torch.Tensor,
                      top_ps: torch.Tensor) -> torch.Tensor:
    """thresholds_torch without a sort: one program per row finds the same logit by a 16-ary search over
    the order-preserving integer keys of the float32 logits (bf16 logits have 16-bit keys: 4 passes over
    the row per filter; float32: 8); a row without top-k and top-p runs no pass. Kernel and twin sum
    masses in different orders: they can disagree only for a token whose mass sits within rounding of
    the top-p boundary."""
    assert logits.dim() == 2 and logits.stride(1) == 1, (logits.shape, logits.stride())
    rows, cols = logits.shape
    shift = _KEY_SHIFT[logits.dtype]
    out = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        _threshold_kernel[(rows,)](logits, logits.stride(0), cols, row_max, inv_temps, top_ks, top_ps, out,
                                   float_key(-math.inf) >> shift, SHIFT=shift, CANDS=_CANDS, BLOCK=_SEARCH_BLOCK,
                                   num_warps=4)
    return out


def uniforms_triton(seeds: torch.Tensor, positions: torch.Tensor, n_cols: int) -> torch.Tensor:
    """uniforms_torch by the kernels' own code (the same bits): for tests, and for callers that need a
    row's uniforms themselves (rejection sampling)."""
    rows = seeds.shape[0]
    out = torch.empty(rows, n_cols, dtype=torch.float32, device=seeds.device)
    if rows and n_cols:
        _uniform_kernel[(rows, triton.cdiv(n_cols, _RACE_BLOCK))](seeds, positions, out, n_cols, BLOCK=_RACE_BLOCK)
    return out


class RaceRows(NamedTuple):
    """The per-row tensors the race reads, [B] each and contiguous."""

    inv_temps: torch.Tensor  # float32
    log_min_ps: torch.Tensor  # float32
    seeds: torch.Tensor  # int64
    positions: torch.Tensor  # int64
    greedy: torch.Tensor  # bool: take the raw argmax
    processed: torch.Tensor  # bool: report the processed logprob


def race_triton(logits: torch.Tensor, stats: tuple[torch.Tensor, torch.Tensor, torch.Tensor], rows: RaceRows,
                thresholds: torch.Tensor | None, need_mass: bool,
                pairs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [B] int64 and their logprobs [B] float32 (and the same into pairs [B, 2] float64 when given).

    stats: the raw logits' (max, first argmax, log-sum-exp offset). need_mass: some row reports its
    processed logprob (the chunks then also sum exp(x))."""
    assert logits.dim() == 2 and logits.stride(1) == 1, (logits.shape, logits.stride())
    assert pairs is None or pairs.is_contiguous(), "pairs rows must be 2 float64 apart"
    n, cols = logits.shape
    chunks = triton.cdiv(cols, _RACE_SPAN)
    dev = logits.device
    part_score, part_mass = torch.empty((2, n, chunks), dtype=torch.float32, device=dev)
    part_idx = torch.empty((n, chunks), dtype=torch.int32, device=dev)
    tokens = torch.empty(n, dtype=torch.int64, device=dev)
    logprobs = torch.empty(n, dtype=torch.float32, device=dev)
    if n == 0:
        return tokens, logprobs
    row_max, argmax, log_sum = stats
    has_thr = thresholds is not None
    _race_chunk_kernel[(n, chunks)](
        logits, logits.stride(0), cols, row_max, rows.inv_temps, thresholds if has_thr else row_max,
        rows.log_min_ps, rows.seeds, rows.positions, part_score, part_idx, part_mass, _RACE_SPAN,
        HAS_THR=has_thr, NEED_MASS=need_mass, BLOCK=_RACE_BLOCK, num_warps=4)
    _race_merge_kernel[(n,)](
        part_score, part_idx, part_mass, chunks, logits, logits.stride(0), row_max, argmax, log_sum,
        rows.inv_temps, rows.greedy, rows.processed, tokens, logprobs, pairs if pairs is not None else tokens,
        NEED_MASS=need_mass, WRITE_PAIRS=pairs is not None, CHUNKS_PAD=triton.next_power_of_2(chunks), num_warps=1)
    return tokens, logprobs


if triton is not None:
    _W_SCALE = tl.constexpr(W_SCALE)
    _W_MAX = tl.constexpr(W_MAX)
    _SMALL_W = tl.constexpr(SMALL_W)
    _SERIES_C2 = tl.constexpr(SERIES_C2)

    @triton.jit
    def _mix32(x):
        x ^= x >> 16
        x *= 0x7FEB352D
        x ^= x >> 15
        x *= 0x846CA68B
        x ^= x >> 16
        return x

    @triton.jit
    def _row_keys(seed, position):
        s0 = (seed & 0xFFFFFFFF).to(tl.uint32)
        s1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
        p = (position & 0xFFFFFFFF).to(tl.uint32)
        k0 = _mix32(s0 ^ _mix32(s1 ^ _mix32(p ^ 0x9E3779B9)))
        k1 = _mix32(s1 ^ _mix32(s0 ^ _mix32(p ^ 0x85EBCA6B)))
        return k0, k1

    @triton.jit
    def _uniform(cols, k0, k1):
        h = _mix32(_mix32(cols.to(tl.uint32) ^ k0) ^ k1)
        return tl.minimum((h.to(tl.float32) + 0.5) * _W_SCALE, _W_MAX)

    @triton.jit
    def _uniform_kernel(seed_ptr, pos_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        k0, k1 = _row_keys(tl.load(seed_ptr + row), tl.load(pos_ptr + row))
        tl.store(out_ptr + row * n_cols + cols, _uniform(cols, k0, k1), mask=cols < n_cols)

    @triton.jit
    def _log_exponential(cols, k0, k1):
        w = _uniform(cols, k0, k1)
        small = w < _SMALL_W
        log_t = tl.log(tl.where(small, w, 1.0 - w))
        return tl.where(small, log_t + w * (0.5 + w * _SERIES_C2), tl.log(-log_t))

    @triton.jit
    def _race_chunk_kernel(x_ptr, stride_row, n_cols, max_ptr, inv_t_ptr, thr_ptr, min_p_ptr, seed_ptr, pos_ptr,
                           part_score_ptr, part_idx_ptr, part_mass_ptr, span, HAS_THR: tl.constexpr,
                           NEED_MASS: tl.constexpr, BLOCK: tl.constexpr):
        # Lane j keeps its best score and the first column holding it, so the loop has no cross-lane step.
        row = tl.program_id(0).to(tl.int64)
        chunk = tl.program_id(1)
        begin = chunk * span
        end = tl.minimum(begin + span, n_cols)
        m = tl.load(max_ptr + row)
        inv_t = tl.load(inv_t_ptr + row)
        log_min_p = tl.load(min_p_ptr + row)
        thr = tl.load(thr_ptr + row) if HAS_THR else float("-inf")
        k0, k1 = _row_keys(tl.load(seed_ptr + row), tl.load(pos_ptr + row))
        lanes = tl.arange(0, BLOCK)
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_i = tl.zeros([BLOCK], tl.int32)
        mass = tl.zeros([BLOCK], tl.float32)
        for off in range(begin, end, BLOCK):
            cols = off + lanes
            valid = cols < end
            logit = tl.load(x_ptr + row * stride_row + cols, mask=valid, other=float("-inf")).to(tl.float32)
            x = (logit - m) * inv_t
            keep = valid & (x >= log_min_p) & (logit >= thr)
            score = tl.where(keep, x - _log_exponential(cols, k0, k1), float("-inf"))
            if NEED_MASS:
                mass += tl.where(keep, tl.exp(x), 0.0)
            better = score > best
            best_i = tl.where(better, cols, best_i)
            best = tl.where(better, score, best)
        top = tl.max(best, axis=0)
        slot = row * tl.num_programs(1) + chunk
        tl.store(part_score_ptr + slot, top)
        tl.store(part_idx_ptr + slot, tl.min(tl.where(best == top, best_i, n_cols), axis=0))
        if NEED_MASS:
            tl.store(part_mass_ptr + slot, tl.sum(mass, axis=0))

    @triton.jit
    def _race_merge_kernel(part_score_ptr, part_idx_ptr, part_mass_ptr, n_chunks, x_ptr, stride_row, max_ptr,
                           argmax_ptr, log_sum_ptr, inv_t_ptr, greedy_ptr, processed_ptr, tok_ptr, lp_ptr, pairs_ptr,
                           NEED_MASS: tl.constexpr, WRITE_PAIRS: tl.constexpr, CHUNKS_PAD: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, CHUNKS_PAD)
        valid = c < n_chunks
        s_c = tl.load(part_score_ptr + row * n_chunks + c, mask=valid, other=float("-inf"))
        i_c = tl.load(part_idx_ptr + row * n_chunks + c, mask=valid, other=0)
        top = tl.max(s_c, axis=0)
        # chunks are in column order: the first chunk holding the max holds its first index
        first = tl.min(tl.where((s_c == top) & valid, c, CHUNKS_PAD), axis=0)
        raced = tl.sum(tl.where(c == first, i_c, 0), axis=0).to(tl.int64)
        greedy = tl.load(greedy_ptr + row) != 0
        tok = tl.where(greedy, tl.load(argmax_ptr + row), raced)
        m = tl.load(max_ptr + row)
        logit = tl.load(x_ptr + row * stride_row + tok).to(tl.float32)
        lp = (logit - m) - tl.load(log_sum_ptr + row)
        if NEED_MASS:
            mass = tl.sum(tl.load(part_mass_ptr + row * n_chunks + c, mask=valid, other=0.0), axis=0)
            processed = (logit - m) * tl.load(inv_t_ptr + row) - tl.log(mass)
            lp = tl.where(tl.load(processed_ptr + row) != 0, processed, lp)
        tl.store(tok_ptr + row, tok)
        tl.store(lp_ptr + row, lp)
        if WRITE_PAIRS:
            tl.store(pairs_ptr + 2 * row, tok.to(tl.float64))
            tl.store(pairs_ptr + 2 * row + 1, lp.to(tl.float64))

    @triton.jit
    def _key(v, SHIFT: tl.constexpr):
        bits = v.to(tl.int32, bitcast=True)
        return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64) >> SHIFT

    @triton.jit
    def _value(key, SHIFT: tl.constexpr):
        k32 = ((key << SHIFT) | tl.where(key < 0, (1 << SHIFT) - 1, 0)).to(tl.int32)
        return tl.where(k32 >= 0, k32, k32 ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)

    @triton.jit
    def _narrow(cands, ok, lo, hi, CANDS: tl.constexpr):
        # f is false below the answer and true from it on; cands are increasing, cands[0] == lo
        j = tl.arange(0, CANDS)
        first = tl.min(tl.where(ok, j, CANDS), axis=0)
        at = tl.sum(tl.where(j == first, cands, 0), axis=0)
        before = tl.sum(tl.where(j == first - 1, cands, 0), axis=0)
        new_hi = tl.where(first < CANDS, at, hi)
        new_lo = tl.where(first == 0, lo, tl.where(first < CANDS, before, tl.max(cands, axis=0)) + 1)
        return new_lo, new_hi

    @triton.jit
    def _threshold_kernel(x_ptr, stride_row, n_cols, max_ptr, inv_t_ptr, top_k_ptr, top_p_ptr, thr_ptr, lowest,
                          SHIFT: tl.constexpr, CANDS: tl.constexpr, BLOCK: tl.constexpr):
        # Search invariant: the answer key lies in [lo, hi]; each pass probes CANDS keys of it at once.
        row = tl.program_id(0).to(tl.int64)
        base = x_ptr + row * stride_row
        m = tl.load(max_ptr + row)
        inv_t = tl.load(inv_t_ptr + row)
        k = tl.load(top_k_ptr + row)
        p = tl.load(top_p_ptr + row)
        top = _key(m, SHIFT)
        lanes = tl.arange(0, BLOCK)
        j = tl.arange(0, CANDS).to(tl.int64)
        # top-k: the smallest key t with count(logit > t) < k
        lo = tl.where(k < n_cols, lowest, top)
        hi = top
        while lo < hi:
            cands = lo + ((hi - lo) * j) // CANDS
            t = _value(cands, SHIFT)
            count = tl.zeros([BLOCK, CANDS], tl.int32)
            for off in range(0, n_cols, BLOCK):
                cols = off + lanes
                logit = tl.load(base + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
                count += (logit[:, None] > t[None, :]).to(tl.int32)
            lo, hi = _narrow(cands, tl.sum(count, axis=0) < k, lo, hi, CANDS)
        thr_k = tl.where(k < n_cols, _value(lo, SHIFT), float("-inf"))
        # top-p: the smallest key t with (mass of the top-k survivors above t) < p * (their mass)
        lo = tl.where(p < 1.0, tl.where(k < n_cols, lo, lowest), top)
        hi = top
        while lo < hi:
            cands = lo + ((hi - lo) * j) // CANDS
            t = _value(cands, SHIFT)
            above = tl.zeros([BLOCK, CANDS], tl.float32)
            total = tl.zeros([BLOCK], tl.float32)
            for off in range(0, n_cols, BLOCK):
                cols = off + lanes
                logit = tl.load(base + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
                w = tl.where(logit >= thr_k, tl.exp((logit - m) * inv_t), 0.0)
                total += w
                above += tl.where(logit[:, None] > t[None, :], w[:, None], 0.0)
            ok = tl.sum(above, axis=0) < p * tl.sum(total, axis=0)
            lo, hi = _narrow(cands, ok, lo, hi, CANDS)
        thr_p = tl.where(p < 1.0, _value(lo, SHIFT), float("-inf"))
        tl.store(thr_ptr + row, tl.maximum(thr_k, thr_p))
