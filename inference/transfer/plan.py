"""The bucket plan both ends of the weight wire derive from (manifest, bucket size).

Nothing but bytes travels per bucket: sender and receivers compute the same plan from the manifest
sent at start and the bucket size agreed at init. Tensors are laid out in manifest order, each start
aligned to ALIGN bytes; a tensor that does not fit in the space left starts a new bucket; a tensor
larger than a bucket is split over consecutive buckets at element boundaries, never dropped.

`ParsedManifest` holds a validated manifest's specs and memoizes the plan and the fingerprint;
`ManifestCache` hands the same ParsedManifest out for a manifest whose content was seen before, so
an RL loop that sends one layout every step parses and validates it once.

Invariants (tests/test_transfer_plan.py): every byte of every tensor lands in exactly one segment;
segments of one bucket never overlap and fit in `bucket_bytes`; whole tensors start on an ALIGN
boundary (so a bucket slice can be viewed as the tensor's dtype without a copy); the plan depends on
nothing but (specs, bucket_bytes). Both ends compare `plan_fingerprint` before the first byte moves.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import pickle
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import overload

import torch

from checksum.dtypes import UnknownDtypeError, dtype_from_name, dtype_name
from inference.core import InvalidRequestError

ALIGN = 256
DEFAULT_BUCKET_BYTES = 512 << 20
FINGERPRINT_BITS = 62  # fits an int64 with room to negate (see groups.TransferGroup.agree)

@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @functools.cached_property
    def numel(self) -> int:
        return math.prod(self.shape)

    @functools.cached_property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    @functools.cached_property
    def nbytes(self) -> int:
        return self.numel * self.torch_dtype.itemsize

    def to_dict(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def from_dict(cls, d: dict, where: str = "manifest") -> TensorSpec:
        try:
            name, dtype, shape = d["name"], d["dtype"], d["shape"]
        except (KeyError, TypeError):
            raise InvalidRequestError(where, f"each tensor needs name, dtype and shape, got {d!r}") from None
        if not isinstance(name, str) or not name:
            raise InvalidRequestError(f"{where}.name", f"must be a non-empty string, got {name!r}")
        if not isinstance(shape, (list, tuple)) or not all(isinstance(s, int) and s >= 0 for s in shape):
            raise InvalidRequestError(f"{where}[{name}].shape", f"must be a list of non-negative ints, got {shape!r}")
        try:
            dtype_from_name(dtype)
        except UnknownDtypeError as e:
            raise InvalidRequestError(f"{where}[{name}].dtype", str(e)) from None
        return cls(name, dtype, tuple(shape))

    @classmethod
    def of(cls, name: str, t: torch.Tensor) -> TensorSpec:
        return cls(name, dtype_name(t.dtype), tuple(t.shape))


@dataclass(frozen=True)
class Segment:
    tensor: int  # index into the manifest
    src_offset: int  # byte offset within the tensor
    dst_offset: int  # byte offset within the bucket
    nbytes: int


@dataclass(frozen=True)
class Bucket:
    index: int
    nbytes: int  # bytes used, including alignment gaps
    segments: tuple[Segment, ...]


def plan_buckets(specs: Sequence[TensorSpec], bucket_bytes: int, alone_bytes: int | None = None) -> list[Bucket]:
    """Deterministic layout of `specs` into buckets of at most bucket_bytes.

    `alone_bytes`: a tensor of at least this size never shares a bucket: its pieces (of at most
    bucket_bytes) are buckets of their own, so each can be written straight from and into the tensor;
    the smaller ones fill shared buckets in manifest order around them. None: tensors are laid out
    back to back, a large one split at the bucket boundaries.
    Cached on (specs, bucket_bytes, alone_bytes): an RL loop sends the same manifest every step.
    """
    if isinstance(specs, ParsedManifest):
        return list(specs.plan(bucket_bytes, alone_bytes))
    return list(_plan(tuple(specs), bucket_bytes, alone_bytes))


@functools.lru_cache(maxsize=8)
def _plan(specs: tuple[TensorSpec, ...], bucket_bytes: int, alone_bytes: int | None = None) -> tuple[Bucket, ...]:
    if bucket_bytes < ALIGN or bucket_bytes % ALIGN:
        raise InvalidRequestError("bucket_bytes", f"must be a positive multiple of {ALIGN}, got {bucket_bytes}")
    buckets: list[Bucket] = []
    current: list[Segment] = []
    used = 0

    def close() -> None:
        nonlocal current, used
        if current:
            buckets.append(Bucket(len(buckets), used, tuple(current)))
        current, used = [], 0

    for i, spec in enumerate(specs):
        size = spec.nbytes
        if alone_bytes is not None and size >= alone_bytes:
            piece = bucket_bytes - bucket_bytes % spec.torch_dtype.itemsize
            for off in range(0, size, piece):  # the open shared bucket stays open around them
                n = min(piece, size - off)
                buckets.append(Bucket(len(buckets), n, (Segment(i, off, 0, n),)))
            continue
        start = _align(used)
        if size <= bucket_bytes:
            if start + size > bucket_bytes:
                close()
                start = 0
            current.append(Segment(i, 0, start, size))
            used = start + size
            continue
        item = dtype_from_name(spec.dtype).itemsize
        piece = bucket_bytes - bucket_bytes % item
        for off in range(0, size, piece):
            n = min(piece, size - off)
            close()  # every piece of a large tensor starts a fresh bucket
            current.append(Segment(i, off, 0, n))
            used = n  # the last piece's bucket stays open for the tensors that follow
    close()
    return tuple(buckets)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def specs_from_manifest(manifest: object, where: str = "manifest") -> tuple[int | None, list[TensorSpec]]:
    """(version or None, specs in send order) from what WeightSender.manifest() returns.

    Accepts the dict {"version": v, "tensors": [...]} or a bare list of tensor dicts / TensorSpecs.
    """
    version, tensors = _split_manifest(manifest, where)
    return version, _parse_tensors(tensors, where)


# The fields of the start manifest's dict: "algorithm" (the sync's digest rule, read by the receiver's
# session: inference/transfer/digests.py) and "layout" (`ParsedManifest.layout_key`; alone, without
# "tensors", it names a layout this rank parsed before: ManifestCache.parse).
MANIFEST_FIELDS = ("version", "tensors", "algorithm", "layout")


def _split_manifest(manifest: object, where: str, *, layout_only: bool = False) -> tuple[int | None, list | tuple]:
    """(version or None, the tensors list), with the dict-level fields validated. `layout_only`: a dict
    naming a "layout" may leave "tensors" out (an empty tuple stands for them)."""
    version = None
    tensors = manifest
    if isinstance(manifest, dict):
        unknown = sorted(set(manifest) - set(MANIFEST_FIELDS))
        if unknown:
            raise InvalidRequestError(f"{where}.{unknown[0]}", f"unknown field (known: {', '.join(MANIFEST_FIELDS)})")
        if "tensors" not in manifest and not (layout_only and "layout" in manifest):
            raise InvalidRequestError(f"{where}.tensors", "missing field")
        version, tensors = manifest.get("version"), manifest.get("tensors", ())
        if version is not None and (not isinstance(version, int) or isinstance(version, bool) or version < 0):
            raise InvalidRequestError(f"{where}.version", f"must be an integer >= 0, got {version!r}")
    if not isinstance(tensors, (list, tuple)):
        raise InvalidRequestError(f"{where}.tensors", f"must be a list, got {type(tensors).__name__}")
    return version, tensors


def _parse_tensors(tensors: list | tuple, where: str) -> list[TensorSpec]:
    return [t if isinstance(t, TensorSpec) else TensorSpec.from_dict(t, f"{where}.tensors[{i}]")
            for i, t in enumerate(tensors)]


class ParsedManifest(Sequence[TensorSpec]):
    """A manifest's validated specs (in send order) and, memoized, the plan and the layout digest.

    Immutable: a cache may hand the same object to many sessions, so the per-sync cost of the plan
    and the fingerprint is a dictionary lookup.
    """

    def __init__(self, specs: Sequence[TensorSpec]) -> None:
        self.specs: tuple[TensorSpec, ...] = tuple(specs)
        self._plans: dict[tuple[int, int | None], tuple[Bucket, ...]] = {}
        self._digests: dict[tuple[int, str], bytes] = {}
        self._layout_key: str | None = None

    @overload
    def __getitem__(self, index: int) -> TensorSpec: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[TensorSpec, ...]: ...

    def __getitem__(self, index: int | slice) -> TensorSpec | tuple[TensorSpec, ...]:
        return self.specs[index]

    def __len__(self) -> int:
        return len(self.specs)

    def __iter__(self) -> Iterator[TensorSpec]:
        return iter(self.specs)

    def plan(self, bucket_bytes: int, alone_bytes: int | None = None) -> tuple[Bucket, ...]:
        plan = self._plans.get((bucket_bytes, alone_bytes))
        if plan is None:
            plan = self._plans[(bucket_bytes, alone_bytes)] = _plan(self.specs, bucket_bytes, alone_bytes)
        return plan

    @property
    def layout_key(self) -> str:
        """32 hex digits that name these specs (names, dtypes, shapes, order): a start manifest may send
        this instead of the tensors once the receivers have parsed them (ManifestCache.parse)."""
        if self._layout_key is None:
            text = json.dumps([[s.name, s.dtype, list(s.shape)] for s in self.specs])
            self._layout_key = hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
        return self._layout_key

    def fingerprint(self, version: int, bucket_bytes: int, backend: str) -> int:
        digest = self._digests.get((bucket_bytes, backend))
        if digest is None:
            digest = self._digests[(bucket_bytes, backend)] = _layout_digest(self.specs, bucket_bytes, backend)
        return _fingerprint(digest, version)


class ManifestCache:
    """The last few parsed manifests, keyed by their exact content (see the module docstring).

    The key is the pickled tensors list: computed in C, and type-exact (a shape of 2.0 or True
    differs from 2), so a manifest parses from the cache only if parsing it afresh would give the
    same specs; anything else is parsed and validated in full. `parses` and `hits` count both paths.
    A manifest dict may instead name a cached entry by its `layout` key alone (no "tensors"): the
    sender's layout repeats every sync, so its tensor list need not travel again. Keys are computed
    here from the parsed specs, never taken from a message: a "layout" sent beside the tensors is
    ignored, so a wrong one can only miss later, never name another layout.
    """

    def __init__(self, size: int = 4) -> None:
        assert size >= 1
        self.size = size
        self.parses = 0
        self.hits = 0
        self._entries: OrderedDict[bytes, ParsedManifest] = OrderedDict()

    def parse(self, manifest: object, where: str = "manifest") -> tuple[int | None, ParsedManifest]:
        """(version or None, parsed specs) like specs_from_manifest, served from the cache when it can.
        UnknownLayoutError when a layout key alone names nothing cached (the caller sends the tensors)."""
        version, tensors = _split_manifest(manifest, where, layout_only=True)
        layout = manifest.get("layout") if isinstance(manifest, dict) else None
        if layout is not None and not isinstance(layout, str):
            raise InvalidRequestError(f"{where}.layout", f"must be a string, got {type(layout).__name__}")
        if isinstance(manifest, dict) and "tensors" not in manifest:
            return version, self._by_layout(layout, where)
        return version, self._parse_tensors(tensors, where)

    def _by_layout(self, layout: str | None, where: str) -> ParsedManifest:
        for key, parsed in reversed(self._entries.items()):
            if parsed.layout_key == layout:
                self._entries.move_to_end(key)
                self.hits += 1
                return parsed
        raise UnknownLayoutError(f"{where}.layout", f"no manifest with layout {layout!r} was parsed here "
                                 "(or it left the cache): send the manifest's tensors")

    def _parse_tensors(self, tensors: list | tuple, where: str) -> ParsedManifest:
        key = _content_key(tensors)
        parsed = self._entries.get(key) if key is not None else None
        if parsed is not None:
            self._entries.move_to_end(key)  # type: ignore[arg-type]
            self.hits += 1
            return parsed
        parsed = ParsedManifest(_parse_tensors(tensors, where))
        self.parses += 1
        if key is not None:
            self._entries[key] = parsed
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)
        return parsed

    def clear(self) -> None:
        self._entries.clear()


class UnknownLayoutError(InvalidRequestError):
    """A start manifest named its layout by key alone, and this rank has no such layout cached."""


def _content_key(tensors: list | tuple) -> bytes | None:
    try:
        return pickle.dumps(tensors, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # not picklable: parse it every time
        return None


def plan_fingerprint(version: int, specs: Sequence[TensorSpec], bucket_bytes: int, backend: str) -> int:
    """A non-zero integer < 2**FINGERPRINT_BITS that differs whenever the plan or version would.

    Not a checksum of weights (those are the checksum package's job): it only guards the wire
    against two ends that derived different plans, which would otherwise hang or corrupt.
    """
    if isinstance(specs, ParsedManifest):
        return specs.fingerprint(version, bucket_bytes, backend)
    return _fingerprint(_layout_digest(tuple(specs), bucket_bytes, backend), version)


def _fingerprint(layout_digest: bytes, version: int) -> int:
    h = hashlib.blake2b(layout_digest, digest_size=8)
    h.update(str(version).encode())
    value = int.from_bytes(h.digest(), "little")
    return (value & ((1 << FINGERPRINT_BITS) - 1)) or 1


@functools.lru_cache(maxsize=8)
def _layout_digest(specs: tuple[TensorSpec, ...], bucket_bytes: int, backend: str) -> bytes:
    text = json.dumps([bucket_bytes, backend, [[s.name, s.dtype, list(s.shape)] for s in specs]])
    return hashlib.blake2b(text.encode(), digest_size=16).digest()
