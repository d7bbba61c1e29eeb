"""Tensor digests: the record, and the fast many-tensor path.

Definition (docs/checksums.md, checksum/definition.py): the bytes are the tensor's contiguous
row-major bytes in the machine's byte order (little-endian everywhere torch runs). Up to 64 MiB the
digest is the lowercase hex of xxh3-128 over them; a larger tensor is cut into 64 MiB segments and
its digest is xxh3-128 over the concatenated 16-byte digests of its segments. dtype and shape are
not hashed; the record carries them, and the comparison checks them. Segments are independent and
each is one streaming hasher, so the digest depends neither on chunking, nor on threads, nor on
the device, and one large tensor is hashed by many threads at once.

Every entry point takes `algorithm=` (default ALGORITHM, the rule above). With DEVICE_ALGORITHM
(64 KiB segments, checksum/definition.py) CUDA tensors are hashed on their GPU by one kernel launch
per device (checksum/device_digest.py) and CPU tensors on the host threads; where Triton is missing
CUDA tensors stream to the host as above, under the same rule and with the same digests.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

import torch

from checksum import definition, device_digest
from checksum.definition import ALGORITHM, DEVICE_ALGORITHM, digest_bytes, get_algorithm
from checksum.device_digest import DeviceDigester
from checksum.dtypes import dtype_name
from checksum.staging import Job, run_jobs
from checksum.staging_buffers import CudaStaging, HostStaging, Staging

DEFAULT_CHUNK_BYTES = 16 << 20  # big enough for full D2H bandwidth, small enough to pipeline; divides a segment
DEFAULT_MAX_QUEUED_COPIES = 6
MAX_DEFAULT_THREADS = 16

NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class TensorRecord:
    """What a manifest says about one tensor. `dtype` is torch's name without "torch."."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    digest: str


def digest_tensor(tensor: torch.Tensor, algorithm: str = ALGORITHM) -> str:
    """The digest of one tensor (CPU or CUDA). For many tensors, `digest_tensors` is much faster."""
    return digest_tensors([("tensor", tensor)], algorithm=algorithm)[0].digest


def digest_tensors(
    named_tensors: NamedTensors,
    *,
    threads: int | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    num_buffers: int | None = None,
    algorithm: str = ALGORITHM,
) -> list[TensorRecord]:
    """Records for every (name, tensor), in input order. Reuses a cached `Digester` per settings."""
    return _shared_digester(threads, chunk_bytes, num_buffers).digest(named_tensors, algorithm=algorithm)


@lru_cache(maxsize=4)
def _shared_digester(threads: int | None, chunk_bytes: int, num_buffers: int | None) -> Digester:
    return Digester(threads, chunk_bytes=chunk_bytes, num_buffers=num_buffers)


def default_threads() -> int:
    """Up to 16 threads, never more than the cores this process may run on."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(MAX_DEFAULT_THREADS, cores))


class Digester:
    """Digests many tensors with a persistent thread pool and reusable pinned staging buffers.

    Work is split into 64 MiB segments (the digest's own segments), so many threads share a large
    tensor; largest tensors go first. CPU tensors are hashed in place (contiguous ones are never
    copied). CUDA tensors stream through `num_buffers` pinned host buffers of `chunk_bytes`, filled
    by a dedicated copy stream; see checksum/staging.py for the ordering invariants. A chunk never
    crosses a segment boundary, and `chunk_bytes` above the segment size is lowered to it (a bigger
    buffer could never fill); a size dividing 64 MiB avoids a short last chunk per segment.
    `staging="always"` also streams CPU tensors through (host) buffers: it runs the device pipeline
    on machines without a GPU (tests) at the cost of one extra memcpy.

    With DEVICE_ALGORITHM, CUDA tensors skip all of that: one kernel launch per device hashes them
    where they are (`device_digest.DeviceDigester`), queued before the host work starts so both run
    at once, and only 8 bytes per 64 KiB come back.

    One digest runs at a time per Digester (calls from several threads are serialized). Pinned
    buffers are allocated on the first CUDA digest and kept until `close()`.
    """

    def __init__(
        self,
        threads: int | None = None,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        num_buffers: int | None = None,
        max_queued_copies: int = DEFAULT_MAX_QUEUED_COPIES,
        staging: Literal["device", "always"] = "device",
        rules: Iterable[definition.Algorithm] = (),
    ) -> None:
        self.threads = default_threads() if threads is None else threads
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        if max_queued_copies < 1:
            raise ValueError(f"max_queued_copies must be >= 1, got {max_queued_copies}")
        if staging not in ("device", "always"):
            raise ValueError(f"staging must be 'device' or 'always', got {staging!r}")
        # A buffer per hashing thread, one per queued copy, and slack so the copier rarely waits.
        self.num_buffers = num_buffers if num_buffers is not None else self.threads + max_queued_copies + 2
        if self.num_buffers < 1:
            raise ValueError(f"num_buffers must be >= 1, got {num_buffers}")
        self.chunk_bytes = min(chunk_bytes, definition.SEGMENT_BYTES)
        self.max_queued_copies = max_queued_copies
        self.staging_mode = staging
        # The rule objects by name: the definition's, or the given ones under their names (tests pass rules
        # of smaller segments to reach boundaries with small tensors).
        self.rules: dict[str, definition.Algorithm] = {**definition.ALGORITHMS, **{r.name: r for r in rules}}
        self._pool: ThreadPoolExecutor | None = None
        self._cuda: CudaStaging | None = None
        self._host: HostStaging | None = None
        self._device: DeviceDigester | None = None
        self._lock = threading.Lock()

    def digest(self, named_tensors: NamedTensors, *, algorithm: str = ALGORITHM) -> list[TensorRecord]:
        """Records in input order, whatever order the hashes finish in. Names need not be unique."""
        rule = self.rules[algorithm] if algorithm in self.rules else get_algorithm(algorithm)
        items = _named_items(named_tensors)
        records: list[TensorRecord | None] = [None] * len(items)
        groups: dict[str, list[Job]] = {}
        on_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
        for index, (name, tensor) in enumerate(items):
            prepared = _check_tensor(name, tensor)
            if algorithm == DEVICE_ALGORITHM and device_digest.can_hash_on(prepared.device):
                on_device.setdefault(prepared.device, []).append((index, prepared))
                continue
            nbytes = prepared.numel() * prepared.element_size()
            if nbytes == 0:  # empty tensors skip the pipeline: nothing to copy or hash
                records[index] = _record(name, prepared, digest_bytes(b"", algorithm))
                continue
            key = self._group_key(name, prepared)
            groups.setdefault(key, []).append(Job(index, prepared, nbytes, staged=key != "inplace"))
        with self._lock:
            launched = [(pairs, self._device_digester().launch([t for _, t in pairs]))
                        for pairs in on_device.values()]  # queued first: the host work runs meanwhile
            for key, jobs in groups.items():
                run_jobs(jobs, self._staging_for(key), self._executor(), self.threads,
                         self.chunk_bytes, self.max_queued_copies, rule)
                for job in jobs:
                    assert job.digest is not None, "run_jobs returned without digesting every job"
                    records[job.index] = _record(items[job.index][0], job.tensor, job.digest)
            for pairs, pending in launched:
                for (index, tensor), digest in zip(pairs, pending.result()):
                    records[index] = _record(items[index][0], tensor, digest)
        assert all(r is not None for r in records)
        return records  # type: ignore[return-value]

    def close(self) -> None:
        """Stop the threads and drop the staging buffers; the Digester can be used again after."""
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            self._pool, self._cuda, self._host, self._device = None, None, None, None

    def __enter__(self) -> Digester:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _group_key(self, name: str, tensor: torch.Tensor) -> str:
        if tensor.device.type == "cpu":
            return "host" if self.staging_mode == "always" else "inplace"
        if tensor.device.type == "cuda":
            return str(tensor.device)
        raise TypeError(f"tensor {name!r}: cannot digest tensors on {tensor.device} (only cpu and cuda)")

    def _staging_for(self, key: str) -> tuple[Staging, torch.device | None] | None:
        if key == "inplace":
            return None
        if key == "host":
            if self._host is None:
                self._host = HostStaging(self.chunk_bytes, self.num_buffers)
            return self._host, None
        if self._cuda is None:
            self._cuda = CudaStaging(self.chunk_bytes, self.num_buffers)
        return self._cuda, torch.device(key)

    def _device_digester(self) -> DeviceDigester:
        if self._device is None:
            self._device = DeviceDigester()
        return self._device

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="checksum-digest")
        return self._pool


def _named_items(named_tensors: NamedTensors) -> list[tuple[str, torch.Tensor]]:
    pairs = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    items = []
    for pair in pairs:
        try:
            name, tensor = pair
        except (TypeError, ValueError):
            raise TypeError(f"expected (name, tensor) pairs, got {type(pair).__name__}") from None
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str, got {type(name).__name__} ({name!r})")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensor {name!r}: expected a torch.Tensor, got {type(tensor).__name__}")
        items.append((name, tensor))
    return items


def _check_tensor(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Refuse what has no well-defined dense bytes; return a detached tensor."""
    if tensor.layout != torch.strided:
        raise TypeError(f"tensor {name!r}: cannot digest layout {tensor.layout} (only dense tensors)")
    if tensor.is_quantized:
        raise TypeError(f"tensor {name!r}: cannot digest quantized tensors")
    if tensor.device.type == "meta":
        raise TypeError(f"tensor {name!r}: a meta tensor has no bytes to digest")
    return tensor.detach()


def _record(name: str, tensor: torch.Tensor, digest: str) -> TensorRecord:
    return TensorRecord(name, dtype_name(tensor.dtype), tuple(int(s) for s in tensor.shape), digest)
