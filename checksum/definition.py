"""The digest definitions in one place (docs/checksums.md, "The digest of a tensor").

ALGORITHM ("xxh3_128_seg64m"), the default rule; `.digest()` is XXH3-128's canonical big-endian form:
    nbytes <= SEGMENT_BYTES: digest = xxh3_128(bytes).hexdigest()
    otherwise:               digest = xxh3_128(d_0 + d_1 + ... + d_k).hexdigest(),
                             d_i = xxh3_128(bytes[i*SEGMENT_BYTES : (i+1)*SEGMENT_BYTES]).digest()
DEVICE_ALGORITHM ("xxh3_64_seg64k"), hashed where the bytes are (checksum/device_kernels.py):
    s_i    = xxh3_64(bytes[i*65536 : (i+1)*65536], zero-padded to 65536 bytes).digest()   (8 bytes)
    digest = xxh3_128(s_0 + s_1 + ... + s_k + nbytes.to_bytes(8, "big")).hexdigest()     (no s_i if empty)
Segments are independent: a digest depends neither on threads, nor on how a segment's bytes are
streamed, nor on the device. A segment size belongs to its definition (another size gives other
digests), so it changes only with the rule's name, which manifests carry. An `Algorithm` object takes
its sizes as constructor arguments whose defaults are these constants: ALGORITHMS holds those, and
tests build others to reach segment boundaries with small tensors.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Protocol

import xxhash

ALGORITHM = "xxh3_128_seg64m"  # the default rule: what every caller that names none gets
SEGMENT_BYTES = 64 << 20  # 64 MiB; part of ALGORITHM's definition, never a knob
DEVICE_ALGORITHM = "xxh3_64_seg64k"  # the rule a GPU hashes at memory speed (checksum/device_digest.py)
SEG64K_BYTES = 64 << 10  # 64 KiB; part of DEVICE_ALGORITHM's definition, never a knob
# DEVICE_ALGORITHM's host work item: 1024 segments hashed by one thread. Tuning only (any multiple of
# SEG64K_BYTES gives the same digests: items never split a segment).
SEG64K_ITEM_BYTES = 64 << 20

# Names manifests used for earlier definitions, and why a reader refuses them.
RETIRED_ALGORITHMS = {
    "xxh3_128": "the whole-tensor xxh3-128 stream of checksum versions before per-segment hashing; "
                "its digests of tensors over 64 MiB differ from today's, so they cannot be compared. "
                "Regenerate the manifest with this version",
}


def segment_spans(nbytes: int, segment: int = SEGMENT_BYTES) -> list[tuple[int, int]]:
    """The [start, end) byte ranges of the segments of `nbytes` bytes, in order.

    Invariants: at least one span (an empty tensor is one empty segment); spans tile [0, nbytes);
    every span but the last is exactly `segment` (SEGMENT_BYTES: ALGORITHM's definition) bytes long.
    """
    assert nbytes >= 0, f"negative byte count {nbytes}"
    assert segment > 0, f"segment of {segment} bytes"
    if nbytes <= segment:
        return [(0, nbytes)]
    return [(start, min(start + segment, nbytes)) for start in range(0, nbytes, segment)]


def combine(segment_digests: Sequence[bytes]) -> str:
    """The tensor's digest from its segments' 16-byte xxh3-128 digests, in segment order."""
    assert segment_digests and all(len(d) == 16 for d in segment_digests), "need 16-byte segment digests"
    if len(segment_digests) == 1:  # a tensor of one segment: its digest is that segment's hash
        return segment_digests[0].hex()
    return xxhash.xxh3_128(b"".join(segment_digests)).hexdigest()


def digest_bytes(data: bytes | bytearray | memoryview, algorithm: str = ALGORITHM) -> str:
    """The digest of a byte buffer, on the calling thread (e.g. a tensor read from a .safetensors file).

    For tensors use `digest_tensors`, which hashes segments in parallel and streams device memory.
    """
    view = memoryview(data).cast("B")
    rule = get_algorithm(algorithm)
    digests = []
    for start, end in rule.work_spans(len(view)):
        hasher = rule.hasher()
        hasher.update(view[start:end])
        digests.append(hasher.digest())
    return rule.combine(digests, len(view))


# -- the rules as objects the pipeline runs --------------------------------------------------------


class Hasher(Protocol):
    """Streams one work item's bytes; `digest()` is the item's digest, input to `Algorithm.combine`."""

    def update(self, data: bytes | bytearray | memoryview) -> object: ...

    def digest(self) -> bytes: ...


class Algorithm(Protocol):
    """A digest rule as the host pipeline runs it. A tensor of n bytes is cut into `work_spans(n)`
    (independent items, each hashed by one thread with one `hasher()`, chunk by chunk in byte order);
    `combine(item_digests, n)` gives the tensor's digest. Neither the chunking of an item nor the
    thread count may change a digest."""

    name: str

    def work_spans(self, nbytes: int) -> list[tuple[int, int]]: ...

    def hasher(self) -> Hasher: ...

    def combine(self, item_digests: Sequence[bytes], nbytes: int) -> str: ...


class Segments64M:
    """ALGORITHM: a work item is a 64 MiB segment, its digest the segment's 16-byte xxh3-128.
    `segment_bytes`: another size is another rule (tests use small ones under the same name)."""

    name = ALGORITHM

    def __init__(self, segment_bytes: int = SEGMENT_BYTES) -> None:
        assert segment_bytes > 0, f"segment of {segment_bytes} bytes"
        self.segment_bytes = segment_bytes

    def work_spans(self, nbytes: int) -> list[tuple[int, int]]:
        return segment_spans(nbytes, self.segment_bytes)

    def hasher(self) -> Hasher:
        return xxhash.xxh3_128()

    def combine(self, item_digests: Sequence[bytes], nbytes: int) -> str:
        return combine(item_digests)


class Segments64K:
    """DEVICE_ALGORITHM on the host: a work item is `item_bytes` (the last one shorter), its digest the
    concatenated 8-byte xxh3-64 digests of its 64 KiB segments (the tensor's last one zero-padded).
    The item size never changes a digest."""

    name = DEVICE_ALGORITHM

    def __init__(self, item_bytes: int = SEG64K_ITEM_BYTES) -> None:
        assert item_bytes > 0 and item_bytes % SEG64K_BYTES == 0, \
            f"work item {item_bytes} must be whole 64 KiB segments"
        self.item_bytes = item_bytes

    def work_spans(self, nbytes: int) -> list[tuple[int, int]]:
        assert nbytes >= 0, f"negative byte count {nbytes}"
        item = self.item_bytes
        return [(start, min(start + item, nbytes)) for start in range(0, nbytes, item)]

    def hasher(self) -> Hasher:
        return SegmentStream()

    def combine(self, item_digests: Sequence[bytes], nbytes: int) -> str:
        assert all(len(d) % 8 == 0 for d in item_digests), "need whole 8-byte segment digests"
        assert sum(len(d) for d in item_digests) == 8 * -(-nbytes // SEG64K_BYTES), "segment count"
        return combine_seg64k(item_digests, nbytes)


def combine_seg64k(segment_digests: Sequence[bytes | memoryview], nbytes: int) -> str:
    """DEVICE_ALGORITHM's digest from its segments' 8-byte canonical digests (in any grouping)."""
    hasher = xxhash.xxh3_128()
    for part in segment_digests:
        hasher.update(part)
    hasher.update(nbytes.to_bytes(8, "big"))
    return hasher.hexdigest()


def combine_seg64k_runs(segments: memoryview, runs: Sequence[tuple[int, int, bytes]]) -> list[str]:
    """DEVICE_ALGORITHM's digests of many tensors whose 8-byte segment digests lie back to back in
    `segments`: run (start, end, suffix) is one tensor's digests `segments[start:end]` and its length as
    8 big-endian bytes, i.e. exactly what `combine_seg64k` hashes, so the digests are the same. Streams
    from the buffer: no copy of it is made (hundreds of tensors, up to megabytes of digests a sync)."""
    return list(map(_run_digest, itertools.repeat(segments), runs))


def _run_digest(segments: memoryview, run: tuple[int, int, bytes]) -> str:
    start, end, suffix = run
    hasher = xxhash.xxh3_128(segments[start:end])
    hasher.update(suffix)
    return hasher.hexdigest()


class SegmentStream:
    """DEVICE_ALGORITHM's hasher: 8-byte xxh3-64 digests of whole 64 KiB segments, whatever the
    chunking; the bytes after the last whole segment are kept and, at `digest()`, zero-padded to one
    (only a tensor's last item may end inside a segment)."""

    def __init__(self) -> None:
        self._digests: list[bytes] = []
        self._tail = bytearray()

    def update(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        if self._tail:
            take = SEG64K_BYTES - len(self._tail)
            self._tail += view[:take]
            view = view[take:]
            if len(self._tail) < SEG64K_BYTES:
                return
            self._digests.append(xxhash.xxh3_64_digest(self._tail))
            self._tail = bytearray()
        whole = len(view) - len(view) % SEG64K_BYTES
        self._digests.extend(xxhash.xxh3_64_digest(view[i : i + SEG64K_BYTES])
                             for i in range(0, whole, SEG64K_BYTES))
        if whole < len(view):
            self._tail = bytearray(view[whole:])

    def digest(self) -> bytes:
        last = [xxhash.xxh3_64_digest(self._tail.ljust(SEG64K_BYTES, b"\0"))] if self._tail else []
        return b"".join(self._digests + last)


ALGORITHMS: dict[str, Algorithm] = {ALGORITHM: Segments64M(), DEVICE_ALGORITHM: Segments64K()}


def get_algorithm(name: str) -> Algorithm:
    """The rule named `name`; ValueError naming the supported ones otherwise."""
    try:
        return ALGORITHMS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown checksum algorithm {name!r} (supported: "
                         f"{', '.join(map(repr, ALGORITHMS))})") from None
