"""Shared pieces of the digest tests (tests/test_checksum_digest*.py, tests/test_checksum_device.py): the
documented rules written from scratch, a byte reader independent of the library, seeded tensors of every
dtype and a mixed set."""

from __future__ import annotations

import torch
import xxhash

from checksum.definition import Segments64M

MIB = 1 << 20
SEGMENT = 64 * MIB  # the documented segment size, written out here rather than imported
SMALL_SEGMENT = 1000  # tests that shrink the segment to reach boundaries cheaply
SEG64K = 64 * 1024  # the device rule's segment, written out here rather than imported

DTYPES = [
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
    torch.bfloat16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2, torch.complex64,
]


def xxh(data: bytes, segment: int = SEGMENT) -> str:
    """The documented rule, from scratch: one xxh3-128 up to a segment, else a hash of segment hashes."""
    if len(data) <= segment:
        return xxhash.xxh3_128(data).hexdigest()
    parts = [xxhash.xxh3_128(data[i : i + segment]).digest() for i in range(0, len(data), segment)]
    return xxhash.xxh3_128(b"".join(parts)).hexdigest()


def xxh64k(data: bytes) -> str:
    """The device rule ("xxh3_64_seg64k"), from scratch: xxh3-64 of each zero-padded 64 KiB segment,
    then xxh3-128 over their canonical digests and the byte count (8 bytes, big-endian)."""
    parts = [xxhash.xxh3_64(data[i : i + SEG64K].ljust(SEG64K, b"\0")).digest() for i in range(0, len(data), SEG64K)]
    return xxhash.xxh3_128(b"".join(parts) + len(data).to_bytes(8, "big")).hexdigest()


def small_segments_rule() -> Segments64M:
    """The default rule with SMALL_SEGMENT-byte segments, so small tensors have many segments (a
    Digester given it as `rules` hashes by it; the definition's own rule stays 64 MiB)."""
    assert Segments64M().segment_bytes == SEGMENT
    return Segments64M(SMALL_SEGMENT)


def storage_bytes(t: torch.Tensor) -> bytes:
    """A tensor's bytes read element by element from its untyped storage (slow, but independent)."""
    c = t.contiguous()
    start = c.storage_offset() * c.element_size()
    raw = c.untyped_storage().tolist()
    return bytes(raw[start : start + c.numel() * c.element_size()])


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point or dtype.is_complex:
        return (torch.randn(shape, generator=g) * 3).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=g).to(dtype)


def mixed_tensors(device: str = "cpu") -> dict[str, torch.Tensor]:
    """Sizes from 0 bytes to many chunks, strided views made on `device`, not sorted by size."""
    tensors = {
        "small": random_tensor((3,), torch.float32, 1),
        "big": random_tensor((64, 50), torch.bfloat16, 2),
        "scalar": torch.tensor(7, dtype=torch.int64),
        "empty": torch.empty(0, dtype=torch.float16),
        "mask": random_tensor((333,), torch.bool, 3),
        "fp8": random_tensor((40, 9), torch.float8_e4m3fn, 4),
        "strided": random_tensor((60, 30), torch.float32, 5),  # 1200 bytes once strided
        "medium": random_tensor((100, 7), torch.int32, 6),
        # Just below, at and just above SMALL_SEGMENT bytes (tests that shrink the segment).
        "below": random_tensor((SMALL_SEGMENT - 1,), torch.uint8, 12),
        "at": random_tensor((SMALL_SEGMENT // 4,), torch.float32, 13),
        "above": random_tensor((SMALL_SEGMENT + 1,), torch.int8, 14),
    }
    tensors = {n: t.to(device) for n, t in tensors.items()}
    tensors["strided"] = tensors["strided"][::2, 1::3]
    return tensors
