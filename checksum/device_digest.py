"""DEVICE_ALGORITHM digests hashed where the bytes are: one kernel launch per device for many tensors.

A launch hashes every 64 KiB segment of every tensor (checksum/device_kernels.py) into one int64 each,
its canonical 8-byte xxh3-64 digest; those come to the host in one copy, and each tensor's digest is the
xxh3-128 of its segments' digests and its length (definition.combine_seg64k_runs, streamed from that
buffer). No byte of a tensor leaves the device; nothing waits on the device before `result()`.

Invariants:
- A tensor the kernel cannot read in place (not contiguous, address or size not a multiple of 16, a
  conjugate or negative view) is first copied on the device into a zeroed, aligned scratch buffer.
- Segment tables are built once per layout (device, addresses, sizes) and kept (LRU, `max_layouts`); the
  keys hold ints only, so a moved tensor misses and is hashed where it is now, and none is kept alive.
- Work runs on the caller's current stream; tensors must stay alive and unchanged until `result()`.
- Triton is imported on first use, never at `import checksum` (a leaf: torch + xxhash); without it
  `can_hash_on` is False and callers hash on the host. CPU tensors reach the kernel only inside
  `kernel_on_cpu()`, under Triton's interpreter (tests).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import operator
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from types import ModuleType

import torch

from checksum.definition import (
    ALGORITHM,
    DEVICE_ALGORITHM,
    SEG64K_BYTES,
    combine_seg64k_runs,
)
from checksum.tensor_bytes import flat_bytes, host_view

# Set only inside kernel_on_cpu(): an Event, not a ContextVar, so a sender's or receiver's worker thread
# sees it too.
_ON_CPU = threading.Event()
PAIR_BYTES = 16  # the segment table's unit (see device_kernels._segments_kernel)
_PAIRS_PER_SEGMENT = SEG64K_BYTES // PAIR_BYTES
_NBYTES = operator.attrgetter("nbytes")
_DEVICE = operator.attrgetter("device")


@dataclass(frozen=True)
class KernelConfig:
    """Launch shape: segments per program (a power of 2) and warps per program. The defaults suit an
    H200 (scripts/bench_checksum.py --device-configs sweeps them); they never change a digest."""

    block_s: int = 32
    num_warps: int = 4

    def __post_init__(self) -> None:
        if self.block_s < 1 or self.block_s & (self.block_s - 1):
            raise ValueError(f"block_s must be a power of 2, got {self.block_s}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps}")


@functools.lru_cache(maxsize=1)
def _kernels() -> ModuleType | None:
    """checksum.device_kernels with Triton imported, or None where Triton is missing."""
    module = importlib.import_module("checksum.device_kernels")
    return module if module.triton is not None else None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@contextlib.contextmanager
def kernel_on_cpu(on: bool = True) -> Iterator[None]:
    """Inside (process-wide, every thread): CPU tensors can be hashed by the kernel, in Triton's
    interpreter (TRITON_INTERPRET=1 before Triton is imported): how tests run it without a GPU.
    on=False: not even there (a test's end that must hash on the host). The previous state comes back."""
    was = _ON_CPU.is_set()
    _set_on_cpu(on)
    try:
        yield
    finally:
        _set_on_cpu(was)


def _set_on_cpu(on: bool) -> None:
    if on:
        _ON_CPU.set()
    else:
        _ON_CPU.clear()


def can_hash_on(device: torch.device) -> bool:
    """Whether tensors on `device` can be hashed by the kernel: CUDA with Triton (CPU only inside
    kernel_on_cpu() under Triton's interpreter)."""
    if device.type == "cuda":
        return _kernels() is not None
    return device.type == "cpu" and _ON_CPU.is_set() and interpreting() and _kernels() is not None


def pick_algorithm(tensors: Iterable[torch.Tensor]) -> str:
    """The algorithm to digest `tensors` with: DEVICE_ALGORITHM when any is on a device that can hash
    it where it is (no byte crosses to the host), else ALGORITHM (fewer, larger host segments: the
    faster rule for CPU tensors). Both ends of a comparison must use the same one: pick it where the
    tensors are sent from and let the manifest carry it."""
    devices = {t.device for t in tensors if t.device.type != "cpu"}
    return DEVICE_ALGORITHM if any(can_hash_on(d) for d in devices) else ALGORITHM


@dataclass(frozen=True)
class _Packing:
    """How one layout's segment digests become its tensors' digests on the host: `runs` holds, per
    source, the byte range of its segment digests in the launch's output (they lie back to back, in
    source order) and its length as 8 big-endian bytes (`combine_seg64k_runs` streams both, copying
    nothing)."""

    runs: tuple[tuple[int, int, bytes], ...]


@dataclass(frozen=True)
class _Layout:
    """The segment table of one list of (address, nbytes) sources on one device."""

    table: torch.Tensor  # int64 [2, n_segments] on the device (row 0 offsets, row 1 lengths, in pairs)
    packing: _Packing
    n_segments: int


class PendingDigests:
    """One launch's digests in flight; `result()` waits for them (once) and finishes on the host."""

    def __init__(self, host: torch.Tensor, event: torch.cuda.Event | None, packing: _Packing,
                 keep_alive: tuple[object, ...]) -> None:
        self._host, self._event, self._packing = host, event, packing
        self._keep_alive: tuple[object, ...] | None = keep_alive  # device buffers the launch uses
        self._digests: list[str] | None = None

    def done(self) -> bool:
        return self._digests is not None or self._event is None or self._event.query()

    def segment_bytes(self) -> bytes:
        """Every segment's canonical 8-byte digest, in launch order (waits for them)."""
        self.result()
        return bytes(host_view(self._host.view(torch.uint8)))

    def result(self) -> list[str]:
        """Each tensor's digest, in launch order."""
        if self._digests is None:
            if self._event is not None:
                self._event.synchronize()
            self._digests = combine_seg64k_runs(host_view(self._host.view(torch.uint8)), self._packing.runs)
            self._keep_alive = None
        return self._digests


class DeviceDigester:
    """Launches DEVICE_ALGORITHM digests; keeps per-device key tables and the recent segment tables.

    Not thread-safe (the layout cache): one caller at a time, e.g. under `Digester`'s lock.
    """

    def __init__(self, config: KernelConfig | None = None, *, max_layouts: int = 8) -> None:
        self.config = config or KernelConfig()
        self.max_layouts = max_layouts
        self._keys: dict[torch.device, torch.Tensor] = {}
        self._layouts: OrderedDict[tuple, _Layout] = OrderedDict()
        self._launches: OrderedDict[tuple, _Layout] = OrderedDict()  # see _launch_key

    def digest(self, tensors: Sequence[torch.Tensor]) -> list[str]:
        return self.launch(tensors).result()

    def launch(self, tensors: Sequence[torch.Tensor], device: torch.device | None = None) -> PendingDigests:
        """Queue the hashing of `tensors` (all on one device) on the current stream. `device`: their one
        device (with its index) when the caller checked that already, sparing a pass over them."""
        if not tensors:
            return PendingDigests(torch.empty(0, dtype=torch.int64), None, _packing([], [], []), ())
        kernels = _kernels()
        if device is None or (device.type == "cuda" and device.index is None):
            device = _one_device(tensors)
        if kernels is None or not can_hash_on(device):
            raise RuntimeError(f"cannot hash tensors on {device} on the device (can_hash_on is False)")
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            return self._launch(kernels, device, tensors)

    def _launch(self, kernels: ModuleType, device: torch.device, tensors: Sequence[torch.Tensor]) -> PendingDigests:
        keys = self._keys_on(device, kernels)
        launch_key = _launch_key(device, keys.data_ptr(), tensors)
        layout = self._launches.get(launch_key)
        scratch = None
        if layout is not None:
            self._launches.move_to_end(launch_key)
        else:
            sources, scratch = _sources(tensors, device)
            layout = self._layout(device, keys.data_ptr(), sources)
            if scratch is None:  # a scratch copy is made afresh every launch: such launches stay uncached
                self._launches[launch_key] = layout
                while len(self._launches) > self.max_layouts:
                    self._launches.popitem(last=False)
        out = torch.empty(layout.n_segments, dtype=torch.int64, device=device)
        if layout.n_segments:
            if device.type == "cuda":  # the cached tables may be freed while this launch still runs
                stream = torch.cuda.current_stream(device)
                keys.record_stream(stream)
                layout.table.record_stream(stream)
            copies = keys if scratch is None else scratch.view(torch.int64)
            kernels.launch(keys, copies, layout.table, keys, out, self._block_s(layout.n_segments),
                           self.config.num_warps)
        if device.type != "cuda":
            return PendingDigests(out, None, layout.packing, ())
        host = torch.empty(layout.n_segments, dtype=torch.int64, pin_memory=True)
        host.copy_(out, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return PendingDigests(host, event, layout.packing, (out, scratch, tensors))

    @property
    def cached_layouts(self) -> int:
        """How many segment tables are kept (at most `max_layouts`)."""
        return len(self._layouts)

    def clear(self) -> None:
        """Drop the key and segment tables (they are rebuilt on the next launch)."""
        self._keys.clear()
        self._layouts.clear()
        self._launches.clear()

    def _block_s(self, n_segments: int) -> int:
        if not interpreting():
            return self.config.block_s
        # The interpreter's cost is per program, not per segment: one program for a test's launch.
        return min(256, 1 << max(0, n_segments - 1).bit_length())

    def _keys_on(self, device: torch.device, kernels: ModuleType) -> torch.Tensor:
        keys = self._keys.get(device)
        if keys is None:
            keys = torch.tensor(kernels.key_table(), dtype=torch.int64).to(device)
            self._keys[device] = keys
        return keys

    def _layout(self, device: torch.device, base: int, sources: list[Source]) -> _Layout:
        key = (device, base, tuple(sources))
        layout = self._layouts.get(key)
        if layout is None:
            layout = _build_layout(device, base, sources)
            self._layouts[key] = layout
            while len(self._layouts) > self.max_layouts:
                self._layouts.popitem(last=False)
        else:
            self._layouts.move_to_end(key)
        return layout


def _segments(nbytes: int) -> int:
    return -(-nbytes // SEG64K_BYTES)


def _launch_key(device: torch.device, base: int, tensors: Sequence[torch.Tensor]) -> tuple:
    """What decides a launch's sources: per tensor its address, byte count, contiguity and lazy conj/neg
    bits (the dtype does not: the kernel hashes bytes). Ints and bools only: no tensor is kept alive."""
    return (device, base, tuple(map(torch.Tensor.data_ptr, tensors)), tuple(map(_NBYTES, tensors)),
            tuple(map(torch.Tensor.is_contiguous, tensors)), tuple(map(torch.Tensor.is_conj, tensors)),
            tuple(map(torch.Tensor.is_neg, tensors)))


def _one_device(tensors: Sequence[torch.Tensor]) -> torch.device:
    devices = set(map(_DEVICE, tensors))
    if len(devices) != 1:
        raise ValueError(f"one launch hashes tensors of one device, got {sorted(map(str, devices))}")
    device = devices.pop()
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


# (where, nbytes, in_scratch): `where` is the bytes' address, or their offset in the launch's scratch
# buffer; a layout is keyed by these, so copies made afresh each launch still find their table.
Source = tuple[int, int, bool]


def _sources(tensors: Sequence[torch.Tensor], device: torch.device) -> tuple[list[Source], torch.Tensor | None]:
    """Each tensor's bytes as the kernel reads them, and the scratch buffer (or None) holding
    aligned, zero-padded copies of those it cannot read in place."""
    sources: list[Source] = []
    copies: list[torch.Tensor] = []
    total = 0
    for t in tensors:  # per tensor per launch: kept to a few C calls (290 tensors a sync)
        nbytes = t.nbytes
        if nbytes == 0:
            sources.append((0, 0, False))
            continue
        ptr = t.data_ptr()
        # read in place: address and size in whole pairs, contiguous, no lazy conjugate/negative bit
        if not (nbytes | ptr) % PAIR_BYTES and t.is_contiguous() and not t.is_conj() and not t.is_neg():
            sources.append((ptr, nbytes, False))
        else:
            sources.append((total, nbytes, True))
            copies.append(t)
            total += -(-nbytes // PAIR_BYTES) * PAIR_BYTES
    if not copies:
        return sources, None
    scratch = torch.zeros(total, dtype=torch.uint8, device=device)
    for (offset, nbytes, _), t in zip((s for s in sources if s[2]), copies):
        scratch[offset : offset + nbytes].copy_(flat_bytes(t))
    return sources, scratch


def _build_layout(device: torch.device, base: int, sources: list[Source]) -> _Layout:
    """Segment k of a source with n bytes at address a: offset (a - base) / 16 + 4096 k pairs, length
    min(4096, ceil(n / 16) - 4096 k) pairs (past n only a scratch copy's zero padding); a source in
    the scratch buffer counts its offset from the buffer and negates its lengths. Per-source values
    go to the device in one small copy and the per-segment table is expanded there, without a sync."""
    counts = [_segments(n) for _, n, _ in sources]
    firsts = [0] * len(sources)
    for i in range(1, len(sources)):
        firsts[i] = firsts[i - 1] + counts[i - 1]
    n_segments = sum(counts)
    assert all(n == 0 or copied or (w - base) % PAIR_BYTES == 0 for w, n, copied in sources), "unaligned"
    per_source = torch.tensor([
        counts,
        firsts,
        [(w if copied else w - base) // PAIR_BYTES if n else 0 for w, n, copied in sources],
        [-(-n // PAIR_BYTES) for _, n, _ in sources],
        [-1 if copied else 1 for _, _, copied in sources],
    ], dtype=torch.int64)
    if device.type == "cuda":
        per_source = per_source.pin_memory().to(device, non_blocking=True)
    count, first, start, pairs, sign = per_source
    owner = torch.repeat_interleave(torch.arange(len(sources), device=device), count, output_size=n_segments)
    k = torch.arange(n_segments, device=device) - first[owner]
    lengths = (pairs[owner] - _PAIRS_PER_SEGMENT * k).clamp(max=_PAIRS_PER_SEGMENT) * sign[owner]
    table = torch.stack([start[owner] + _PAIRS_PER_SEGMENT * k, lengths])
    return _Layout(table, _packing(counts, firsts, [n for _, n, _ in sources]), n_segments)


def _packing(counts: list[int], firsts: list[int], nbytes: list[int]) -> _Packing:
    """Source i's segment digests are the output's words firsts[i] .. firsts[i] + counts[i]."""
    return _Packing(tuple((8 * first, 8 * (first + count), n.to_bytes(8, "big"))
                          for count, first, n in zip(counts, firsts, nbytes)))
