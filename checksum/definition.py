"""The digest definition in one place: how a tensor's bytes are cut into segments, and how the
segments' hashes make the digest (docs/checksums.md, "The digest of a tensor").

    nbytes <= SEGMENT_BYTES: digest = xxh3_128(bytes).hexdigest()
    otherwise:               digest = xxh3_128(d_0 + d_1 + ... + d_k).hexdigest(),
                             d_i = xxh3_128(bytes[i*SEGMENT_BYTES : (i+1)*SEGMENT_BYTES]).digest()

`.digest()` is XXH3-128's canonical 16-byte (big-endian) form, i.e. bytes.fromhex(hexdigest()).
Segments are independent, so any number of threads may hash one tensor, and the result depends
neither on threads, nor on how a segment's bytes are streamed into its hasher, nor on the device.

SEGMENT_BYTES belongs to the definition, not to tuning: another value gives other digests for every
tensor larger than it, so it may only change together with ALGORITHM (the name manifests carry).
The code reads it from this module at call time, which lets tests shrink it with monkeypatch.
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash

ALGORITHM = "xxh3_128_seg64m"
SEGMENT_BYTES = 64 << 20  # 64 MiB; part of ALGORITHM's definition, never a knob

# Names manifests used for earlier definitions, and why a reader refuses them.
RETIRED_ALGORITHMS = {
    "xxh3_128": "the whole-tensor xxh3-128 stream of checksum versions before per-segment hashing; "
                "its digests of tensors over 64 MiB differ from today's, so they cannot be compared. "
                "Regenerate the manifest with this version",
}


def segment_spans(nbytes: int) -> list[tuple[int, int]]:
    """The [start, end) byte ranges of the segments of `nbytes` bytes, in order.

    Invariants: at least one span (an empty tensor is one empty segment); spans tile [0, nbytes);
    every span but the last is exactly SEGMENT_BYTES long.
    """
    assert nbytes >= 0, f"negative byte count {nbytes}"
    segment = SEGMENT_BYTES
    if nbytes <= segment:
        return [(0, nbytes)]
    return [(start, min(start + segment, nbytes)) for start in range(0, nbytes, segment)]


def combine(segment_digests: Sequence[bytes]) -> str:
    """The tensor's digest from its segments' 16-byte xxh3-128 digests, in segment order."""
    assert segment_digests and all(len(d) == 16 for d in segment_digests), "need 16-byte segment digests"
    if len(segment_digests) == 1:  # a tensor of one segment: its digest is that segment's hash
        return segment_digests[0].hex()
    return xxhash.xxh3_128(b"".join(segment_digests)).hexdigest()


def digest_bytes(data: bytes | bytearray | memoryview) -> str:
    """The digest of a byte buffer, on the calling thread (e.g. a tensor read from a .safetensors file).

    For tensors use `digest_tensors`, which hashes segments in parallel and streams device memory.
    """
    view = memoryview(data).cast("B")
    return combine([xxhash.xxh3_128(view[start:end]).digest() for start, end in segment_spans(len(view))])
