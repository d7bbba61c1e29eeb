"""CUDA IPC for the `ipc` backend: a storage is exported once, opened once, reused every sync.

"direct" mode: when every tensor the trainer sends is a contiguous CUDA tensor on the sender's
device, the receivers copy straight from the trainer's own (IPC-mapped) storages into their
parameters: one device copy of the bytes, no packing, a handful of kernel launches (`CopyPlan`).
Otherwise ("packed") the sender packs the plan's buckets into two shared bucket buffers that the
receivers unpack. The steps of both modes: inference/transfer/backends/ipc.py.

Handles: the exporter keys storages by their device address and keeps a reference to each (so an
address cannot be reused while a receiver may still hold its mapping); a storage gets an integer
id and its handle travels once. Each sync's layout lists the live ids; storages not used by a sync
are dropped by both ends after it. Handles are plain JSON (no pickle on the wire); the GPU is named
by UUID, since the two processes may number devices differently. The storages of the last sync stay
alive until the next one, so a trainer that gathers temporary full tensors per sync (FSDP-style)
should pass ipc_mode="packed": then only the two shared buckets stay alive.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from inference.transfer.buckets import as_tensor
from inference.transfer.plan import TensorSpec

LARGE_COPY_BYTES = 32 << 20  # above this a tensor gets its own copy_ (a memcpy at full bandwidth)


def device_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def local_device_index(uuid: str) -> int:
    for i in range(torch.cuda.device_count()):
        if device_uuid(torch.device("cuda", i)) == uuid:
            return i
    raise RuntimeError(f"GPU {uuid} is not visible to this process: the ipc backend needs the sender's "
                       "GPU (use nccl between distinct GPUs)")


def _b64(b: bytes | None) -> str | None:
    return None if b is None else base64.b64encode(b).decode()


def _unb64(s: str | None) -> bytes | None:
    return None if s is None else base64.b64decode(s)


def export_storage(storage: torch.UntypedStorage) -> dict[str, Any]:
    """A JSON-able handle to the whole storage (its allocation, offset and ref counter)."""
    flat = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),), (1,))
    _, args = reduce_tensor(flat)
    (_cls, _size, _stride, _offset, _scls, _dtype, device, handle, size_bytes, offset_bytes, _rg,
     ref_handle, ref_offset, event_handle, event_sync) = args
    return {"uuid": device_uuid(torch.device("cuda", device)), "handle": _b64(handle), "size": size_bytes,
            "offset": offset_bytes, "ref_handle": _b64(ref_handle), "ref_offset": ref_offset,
            "event_handle": _b64(event_handle), "event_sync": event_sync}


def import_storage(h: dict[str, Any]) -> torch.Tensor:
    """Open an exported storage in this process: a 1-D uint8 tensor over all of it."""
    return rebuild_cuda_tensor(
        torch.Tensor, torch.Size([h["size"]]), (1,), 0, torch.storage.TypedStorage, torch.uint8,
        local_device_index(h["uuid"]), _unb64(h["handle"]), h["size"], h["offset"], False,
        _unb64(h["ref_handle"]), h["ref_offset"], _unb64(h["event_handle"]), h["event_sync"])


@dataclass(frozen=True)
class LayoutOffer:
    """One sync's layout as the sender offers it: the JSON message, and its key (`layout_key`), or 0
    when the message carries new handles and so must be sent whatever the receivers hold."""

    payload: bytes
    key: int
    mode: str


def layout_key(layout: dict[str, Any]) -> int:
    """A non-zero 62-bit key of what a receiver keeps from an applied layout (mode, live ids,
    placements, buffer ids). Equal keys on both ends: the receiver's cached layout is the sender's."""
    text = json.dumps([layout["mode"], layout["live"], layout["tensors"], layout["buffers"]])
    value = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
    return (value & ((1 << 62) - 1)) or 1


class IpcExporter:
    """Sender side: ids and handles for storages, exported once each (see the module docstring).

    `offer` stages what it exports: `commit` once the receivers got the layout, `rollback` when the
    sync stopped before it was sent (the receivers never opened those handles)."""

    def __init__(self) -> None:
        self._by_ptr: dict[int, tuple[int, torch.UntypedStorage]] = {}
        self._next_id = 0
        self._live: set[int] = set()
        self._last: tuple[tuple[str, list[int], list[int]], LayoutOffer] | None = None
        self._undo: tuple[Any, ...] | None = None
        self.exported_total = 0  # handles ever exported (tests check reuse with it)

    def offer(self, mode: str, tensors: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor] = ()) -> LayoutOffer:
        """This sync's layout: new handles, live ids, (id, byte offset) per tensor, buffer ids.

        The same addresses as the last layout give the same offer without a storage lookup: the
        storages behind them are still referenced here, so no other allocation can sit at them.
        """
        ptrs = (mode, [t.data_ptr() for t in tensors], [b.data_ptr() for b in buffers])
        if self._last is not None and self._last[0] == ptrs:
            self._undo = None
            return self._last[1]
        self._undo = (dict(self._by_ptr), self._next_id, self._live, self._last)
        layout = {**self._build_layout(tensors, buffers), "mode": mode}
        steady = {**layout, "new": {}}
        key = layout_key(steady)
        self._last = (ptrs, LayoutOffer(json.dumps(steady).encode(), key, mode))
        return LayoutOffer(json.dumps(layout).encode(), 0 if layout["new"] else key, mode)

    def commit(self) -> None:
        self._undo = None

    def rollback(self) -> None:
        """Forget what the last offer exported; its layout never reached the receivers."""
        if self._undo is not None:
            self._by_ptr, self._next_id, self._live, self._last = self._undo
            self._undo = None

    def _build_layout(self, tensors: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor]) -> dict[str, Any]:
        new: dict[str, dict[str, Any]] = {}
        live: set[int] = set()

        def ref(t: torch.Tensor) -> int:
            storage = t.untyped_storage()
            entry = self._by_ptr.get(storage.data_ptr())
            if entry is None or entry[1].nbytes() != storage.nbytes():
                entry = (self._next_id, storage)
                self._next_id += 1
                self._by_ptr[storage.data_ptr()] = entry
                new[str(entry[0])] = export_storage(storage)
                self.exported_total += 1
            live.add(entry[0])
            return entry[0]

        placed = [[ref(t), t.storage_offset() * t.element_size()] for t in tensors]
        buffer_ids = [ref(b) for b in buffers]
        self._live = live
        return {"new": new, "live": sorted(live), "tensors": placed, "buffers": buffer_ids}

    def retire(self) -> None:
        """After a sync was acknowledged: forget storages it did not use (receivers dropped them)."""
        self._by_ptr = {p: e for p, e in self._by_ptr.items() if e[0] in self._live}


class IpcImporter:
    """Receiver side: storages opened once by id, views built per layout (cached while unchanged)."""

    def __init__(self) -> None:
        self._storages: dict[int, torch.Tensor] = {}
        self._views_key: tuple[Any, ...] | None = None
        self._views_specs: Sequence[TensorSpec] | None = None  # held, not its id: an id can be reused
        self._views: list[torch.Tensor] = []
        self._views_layout: dict[str, Any] | None = None
        self.opened_total = 0  # handles ever opened (tests check reuse with it)

    def apply(self, layout: dict[str, Any]) -> None:
        self._views_layout = None
        live = set(layout["live"])
        for sid in [s for s in self._storages if s not in live]:
            del self._storages[sid]  # the sender stopped using it: release the mapping
        for sid, handle in layout["new"].items():
            self._storages[int(sid)] = import_storage(handle)
            self.opened_total += 1
        missing = live - set(self._storages)
        if missing:
            raise RuntimeError(f"ipc layout refers to storages {sorted(missing)} that were never exported "
                               "to this rank")

    def storage(self, sid: int) -> torch.Tensor:
        return self._storages[sid]

    def views(self, layout: dict[str, Any], specs: Sequence[TensorSpec]) -> list[torch.Tensor]:
        """The sender's tensors, in manifest order, as views of the opened storages."""
        if layout is self._views_layout and specs is self._views_specs:
            return self._views  # the receiver's cached layout: nothing was applied since
        self._views_layout = layout if not layout["new"] else None
        key = (tuple(map(tuple, layout["tensors"])), tuple(layout["live"]))
        if key != self._views_key or specs is not self._views_specs or layout["new"]:
            self._views = [as_tensor(self._storages[sid][off:off + spec.nbytes], spec)
                           for (sid, off), spec in zip(layout["tensors"], specs, strict=True)]
            self._views_key, self._views_specs = key, specs
        return self._views

    def close(self) -> None:
        self._storages.clear()
        self._views, self._views_key, self._views_specs, self._views_layout = [], None, None, None


@dataclass(frozen=True)
class CopyPlan:
    """dst.copy_(src) for many pairs in as few launches as possible, checked once, run every sync:
    one `_foreach_copy_` per dtype for the small tensors, a plain copy for each large one."""

    foreach: tuple[tuple[list[torch.Tensor], list[torch.Tensor]], ...]
    large: tuple[tuple[torch.Tensor, torch.Tensor], ...]

    @classmethod
    def build(cls, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> CopyPlan:
        small: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        large = []
        for dst, src in pairs:
            assert dst.shape == src.shape and dst.dtype == src.dtype, (dst.shape, src.shape, dst.dtype, src.dtype)
            if dst.numel() * dst.element_size() >= LARGE_COPY_BYTES:
                large.append((dst, src))
            else:
                dsts, srcs = small.setdefault(dst.dtype, ([], []))
                dsts.append(dst)
                srcs.append(src)
        return cls(tuple(small.values()), tuple(large))

    def run(self) -> None:
        for dst, src in self.large:
            dst.copy_(src)
        for dsts, srcs in self.foreach:
            torch._foreach_copy_(dsts, srcs)


def copy_pairs(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """dst.copy_(src) for every pair (same shapes and dtypes), in as few launches as possible."""
    CopyPlan.build(pairs).run()
