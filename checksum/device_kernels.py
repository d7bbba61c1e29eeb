"""XXH3-64 of whole 64 KiB segments on the device (Triton), and its eager torch twin.

Both compute, for every segment (8192 little-endian u64 words, the tensor's last segment zero-padded),
XXH3_64bits(segment) with seed 0 and the default 192-byte secret, and write its canonical 8 bytes
(big-endian, what python-xxhash's `.digest()` gives), so the host appends them as they are
(checksum/definition.py, DEVICE_ALGORITHM). One length means one path of XXH3, its long-input loop:

    acc = INIT; for block b in 0..63, stripe s in 0..15 (64 bytes each), lane i in 0..7:
        v = word[128 b + 8 s + i];  k = v ^ key[s][i];  acc[i ^ 1] += v;  acc[i] += lo32(k) * hi32(k)
        after blocks 0..62: acc[i] = ((acc[i] ^ (acc[i] >> 47)) ^ scramble_key[i]) * PRIME32_1
    block 63's stripe 15 is XXH3's "last stripe": keys from secret offset 121, not 120.
    h = 65536 * PRIME64_1 + sum_j fold64(acc[2j] ^ merge_key[2j], acc[2j+1] ^ merge_key[2j+1]);
    digest = avalanche(h)                  (all arithmetic mod 2^64; fold64 = lo ^ hi of the 128-bit product)

Every key is read from the secret at a fixed offset, so `key_table()` holds them all (and the initial
accumulators) in one 160-entry table the host builds once per device. Checked against python-xxhash by
tests/test_checksum_device.py (through Triton's interpreter on CPU, compiled on a GPU).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the digests fall back to the host path (checksum/digest.py)
    triton = None

SEGMENT_WORDS = 8192  # 64 KiB of u64: DEVICE_ALGORITHM's segment
PAIRS_PER_SEGMENT = SEGMENT_WORDS // 2  # the segment table counts 16-byte pairs (see the kernel)
_M64 = (1 << 64) - 1
_PRIME32_1, _PRIME32_2, _PRIME32_3 = 0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D
_PRIME64 = (0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0x85EBCA77C2B2AE63, 0x27D4EB2F165667C5)
_AVALANCHE = 0x165667919E3779F9
_START = (65536 * _PRIME64[0]) & _M64  # the merge starts from len * PRIME64_1
# XXH3's default secret (kSecret), 192 bytes: a constant of the algorithm.
_SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e"
)
# Offsets into key_table(): 16 stripes x 8 lanes, then 8 entries each of the rest.
KEYS_LAST, KEYS_SCRAMBLE, KEYS_MERGE, KEYS_INIT, KEY_TABLE_LEN = 128, 136, 144, 152, 160


def _secret_u64(offset: int) -> int:
    return int.from_bytes(_SECRET[offset : offset + 8], "little")


def _signed(value: int) -> int:
    """The int64 with the bits of the u64 `value` (torch and Triton tables hold int64)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def key_table() -> list[int]:
    """The 160 u64 constants the kernel reads, as signed int64 values (layout: KEYS_* above)."""
    stripes = [_secret_u64(8 * s + 8 * i) for s in range(16) for i in range(8)]
    last = [_secret_u64(192 - 64 - 7 + 8 * i) for i in range(8)]  # XXH_SECRET_LASTACC_START = 7
    scramble = [_secret_u64(192 - 64 + 8 * i) for i in range(8)]
    merge = [_secret_u64(11 + 8 * i) for i in range(8)]  # XXH_SECRET_MERGEACCS_START = 11
    init = [_PRIME32_3, _PRIME64[0], _PRIME64[1], _PRIME64[2], _PRIME64[3], _PRIME32_2, _PRIME64[4], _PRIME32_1]
    table = [_signed(v) for v in stripes + last + scramble + merge + init]
    assert len(table) == KEY_TABLE_LEN
    return table


# ---- the eager twin: the same math on int64 tensors (wrapping), any device ----------------------------


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 holding u64 bits (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _fold64(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """lo64 ^ hi64 of the 128-bit product a * b, from 32-bit limbs (every partial product fits 64 bits)."""
    m32 = 0xFFFFFFFF
    al, ah, bl, bh = a & m32, _shr(a, 32), b & m32, _shr(b, 32)
    ll, lh, hl, hh = al * bl, al * bh, ah * bl, ah * bh
    cross = _shr(ll, 32) + (lh & m32) + (hl & m32)  # < 3 * 2^32: no wrap
    lo = (cross << 32) | (ll & m32)
    hi = hh + _shr(lh, 32) + _shr(hl, 32) + _shr(cross, 32)
    return lo ^ hi


def _byteswap(h: torch.Tensor) -> torch.Tensor:
    h = ((h & 0x00FF00FF00FF00FF) << 8) | (_shr(h, 8) & 0x00FF00FF00FF00FF)
    h = ((h & 0x0000FFFF0000FFFF) << 16) | (_shr(h, 16) & 0x0000FFFF0000FFFF)
    return (h << 32) | _shr(h, 32)


def segment_digests_torch(words: torch.Tensor) -> torch.Tensor:
    """[S, 8192] int64 (each row one zero-padded segment's little-endian words) -> [S] int64 whose
    bytes are each segment's canonical xxh3-64 digest. The kernel's twin: same keys, same order of
    wrapping additions (sums over stripes commute mod 2^64)."""
    assert words.dtype == torch.int64 and words.dim() == 2 and words.shape[1] == SEGMENT_WORDS
    table = torch.tensor(key_table(), dtype=torch.int64, device=words.device)
    keys = table[:KEYS_LAST].view(16, 8)
    last_keys = torch.cat([keys[:15], table[KEYS_LAST:KEYS_SCRAMBLE].view(1, 8)])
    swap = torch.tensor([1, 0, 3, 2, 5, 4, 7, 6], device=words.device)
    blocks = words.view(-1, 64, 16, 8)
    acc = table[KEYS_INIT:].expand(words.shape[0], 8).clone()
    for b in range(64):
        v = blocks[:, b]  # [S, 16 stripes, 8 lanes]
        k = v ^ (keys if b < 63 else last_keys)
        acc = acc + ((k & 0xFFFFFFFF) * _shr(k, 32) + v[:, :, swap]).sum(dim=1)
        if b < 63:
            acc = ((acc ^ _shr(acc, 47)) ^ table[KEYS_SCRAMBLE:KEYS_MERGE]) * _PRIME32_1
    acc = acc ^ table[KEYS_MERGE:KEYS_INIT]
    h = _fold64(acc[:, 0::2], acc[:, 1::2]).sum(dim=1) + _signed(_START)
    h = h ^ _shr(h, 37)
    h = h * _AVALANCHE
    return _byteswap(h ^ _shr(h, 32))


# ---- the kernel ----------------------------------------------------------------------------------------

if triton is not None:
    _LAST = tl.constexpr(KEYS_LAST)
    _SCRAMBLE = tl.constexpr(KEYS_SCRAMBLE)
    _MERGE = tl.constexpr(KEYS_MERGE)
    _INIT = tl.constexpr(KEYS_INIT)
    _START_K = tl.constexpr(_START)

    @triton.jit
    def _fold64_kernel(a, b):
        al = a & 0xFFFFFFFF
        ah = a >> 32
        bl = b & 0xFFFFFFFF
        bh = b >> 32
        ll = al * bl
        lh = al * bh
        hl = ah * bl
        cross = (ll >> 32) + (lh & 0xFFFFFFFF) + (hl & 0xFFFFFFFF)
        lo = (cross << 32) | (ll & 0xFFFFFFFF)
        hi = ah * bh + (lh >> 32) + (hl >> 32) + (cross >> 32)
        return lo ^ hi

    @triton.jit
    def _stripe(acc, ptrs, word, valid, offset, keys_ptr, key_offset):
        """One 64-byte stripe of every segment in the tile: acc [S, 4, 2] holds lanes (2j, 2j+1)."""
        v = tl.load(ptrs + offset, mask=(word + offset) < valid, other=0).to(tl.uint64, bitcast=True)
        k = v ^ tl.load(keys_ptr + key_offset + word).to(tl.uint64, bitcast=True)
        even, odd = tl.split(v)
        return acc + (k & 0xFFFFFFFF) * (k >> 32) + tl.join(odd, even)  # acc[i ^ 1] += v[i]

    # n_segments varies from launch to launch: one compiled kernel for all of them.
    @triton.jit(do_not_specialize=["n_segments"])
    def _segments_kernel(base_ptr, scratch_ptr, table_ptr, keys_ptr, out_ptr, n_segments,
                         BLOCK_S: tl.constexpr):
        """Program p hashes segments [p * BLOCK_S, (p + 1) * BLOCK_S) of the launch.

        table_ptr: int64 [2, n_segments]: row 0 the segment's offset in 16-byte pairs from base_ptr,
        row 1 its length in pairs (1..4096), negated when the offset counts from scratch_ptr (the
        launch's copies) instead, so a cached table never holds a per-launch address. Counting pairs
        makes every offset and bound even in words, which lets Triton load 16 bytes at a time (a pair
        is one thread's two lanes) under the mask; words past the length load as zero, which is the
        definition's padding.
        """
        seg = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
        live = seg < n_segments
        length = tl.load(table_ptr + n_segments + seg, mask=live, other=0)
        start = tl.load(table_ptr + seg, mask=live, other=0) * 2
        valid = (tl.abs(length) * 2).to(tl.int32)
        word = (tl.arange(0, 4)[:, None] * 2 + tl.arange(0, 2)[None, :])[None, :, :]  # [1, 4, 2]: lane
        valid = valid[:, None, None]
        # Both are 16-byte aligned (launch() checks): the hint keeps the loads 16 bytes wide.
        origin = tl.multiple_of(tl.where(length < 0, scratch_ptr, base_ptr), 16)
        ptrs = origin[:, None, None] + start[:, None, None] + word
        acc = tl.load(keys_ptr + _INIT + word).to(tl.uint64, bitcast=True) + tl.zeros([BLOCK_S, 4, 2], tl.uint64)
        scramble = tl.load(keys_ptr + _SCRAMBLE + word).to(tl.uint64, bitcast=True)
        for b in range(63):
            for s in tl.static_range(16):
                acc = _stripe(acc, ptrs, word, valid, b * 128 + s * 8, keys_ptr, s * 8)
            acc = ((acc ^ (acc >> 47)) ^ scramble) * 0x9E3779B1
        for s in tl.static_range(15):
            acc = _stripe(acc, ptrs, word, valid, 63 * 128 + s * 8, keys_ptr, s * 8)
        acc = _stripe(acc, ptrs, word, valid, 63 * 128 + 15 * 8, keys_ptr, _LAST)  # the last stripe
        acc = acc ^ tl.load(keys_ptr + _MERGE + word).to(tl.uint64, bitcast=True)
        even, odd = tl.split(acc)
        h = tl.sum(_fold64_kernel(even, odd), axis=1) + _START_K
        h = h ^ (h >> 37)
        h = h * 0x165667919E3779F9
        h = h ^ (h >> 32)
        h = ((h & 0x00FF00FF00FF00FF) << 8) | ((h >> 8) & 0x00FF00FF00FF00FF)  # canonical: big-endian
        h = ((h & 0x0000FFFF0000FFFF) << 16) | ((h >> 16) & 0x0000FFFF0000FFFF)
        h = (h << 32) | (h >> 32)
        tl.store(out_ptr + seg, h.to(tl.int64, bitcast=True), mask=live)


def launch(base: torch.Tensor, scratch: torch.Tensor, table: torch.Tensor, keys: torch.Tensor,
           out: torch.Tensor, block_s: int, num_warps: int) -> None:
    """Hash the segments `table` describes into `out`, on the current stream. `base` is any tensor on
    the device that the table's offsets count from, `scratch` the launch's copies (any tensor when
    there are none), both 16-byte aligned; `keys` is `key_table()` on the device."""
    assert triton is not None, "launch needs Triton"
    n_segments = out.numel()
    assert table.shape == (2, n_segments) and table.dtype == torch.int64 and keys.numel() == KEY_TABLE_LEN
    assert base.data_ptr() % 16 == 0 and scratch.data_ptr() % 16 == 0, "the table counts 16-byte pairs"
    grid = (triton.cdiv(n_segments, block_s),)
    _segments_kernel[grid](base, scratch, table, keys, out, n_segments, BLOCK_S=block_s, num_warps=num_warps)
