"""The bucket plan both ends of the weight wire derive from (manifest, bucket size).

Nothing but bytes travels per bucket: sender and receivers compute the same plan from the manifest
sent at start and the bucket size agreed at init. Tensors are laid out in manifest order, each start
aligned to ALIGN bytes; a tensor that does not fit in the space left starts a new bucket; a tensor
larger than a bucket is split over consecutive buckets at element boundaries, never dropped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from inference.core import InvalidRequestError

ALIGN = 256

_DTYPES = {
    name: getattr(torch, name)
    for name in ("float32", "float16", "bfloat16", "float64", "int8", "uint8", "int16", "int32", "int64", "bool",
                 "float8_e4m3fn", "float8_e5m2")
    if hasattr(torch, name)
}


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name.replace("torch.", "")]
    except KeyError:
        raise InvalidRequestError("dtype", f"unsupported dtype {name!r}; known: {sorted(_DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_from_name(self.dtype).itemsize

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
        dtype_from_name(dtype)
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


def plan_buckets(specs: list[TensorSpec], bucket_bytes: int) -> list[Bucket]:
    """Deterministic layout of `specs` into buckets of at most bucket_bytes."""
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
    return buckets


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN
