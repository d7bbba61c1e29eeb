"""Delta syncs of full weights: only the elements that changed since the version every rank holds.

A session negotiated with `InitInfo.delta` starts every sync with the OFFER: one all-max of three values
(`offer_values`): the sender offers its base (the version of its kept copy, -1 for none), each receiver
the version it holds intact (-1 when torn, not loaded, released at a level-2 sleep, or when some tensor
has no region to apply into: a cast, an FP8 weight, a tied lm_head sent), and whether it holds some
tensor as a SLICE (a TP shard: its rows, or its columns). Only when every end offered the same version
does the sync move a delta, and a second all-max carries its codes (per tensor: encoding and counts;
inference/transfer/delta_codec.py) and, when some rank holds slices, every receiver's slices (its row
of `SLICE_CODES` integers per tensor); otherwise it moves the full tensors: the fallback is automatic.
A delta travels as ONE uint8 tensor ("delta") through the ordinary plan and backend; the rank applies it
in place (`DeltaSink`), into the part of each tensor it holds, and its audit digests every region it
holds: whole tensors against the sender's digests of them, slices against the sender's digests of the
same slices (`SliceTable`: the sender digests each distinct slice of the sync and delivers them after
the full tensors' digests), so a delta is proven against the trainer's weights as a full sync is.
A rank that holds slices takes deltas only in syncs that deliver the digests in the sync (the
choreography's); otherwise it offers no base.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from inference.transfer.delta_codec import DeltaLayout, Encoded, Slice, apply_delta, bits, encode_all, write_payload
from inference.transfer.plan import ParsedManifest, TensorSpec

THREADS = min(4, os.cpu_count() or 1)  # a host's compare and apply: memory-bound, a few threads reach its bandwidth
SLICE_CODES = 3  # integers per tensor in a receiver's row: (dim + 1, start, length), or zeros (held whole)
Regions = list[tuple[torch.Tensor, Slice | None]]  # per tensor: the region a rank holds, and which part


# ---- the offer: one all-max decides delta or full, a second carries the codes and the slices ----
def offer_values(version: int, slices: bool = False) -> list[int]:
    """One end's offer: its version (the sender's base; a receiver's intact version; -1 for none), and
    whether it holds some tensor as a slice."""
    return [version, -version, int(slices)]


def offer_agreed(got: Sequence[int]) -> bool:
    """Every end offered the same version (max == min), and it is one (>= 0): the sync is a delta. A
    rank that could not even parse the start offers -1, so the codes' collective, whose length follows
    the manifest, only runs where every end parsed it."""
    return got[0] >= 0 and got[0] == -got[1]


def offer_slices(got: Sequence[int]) -> bool:
    """Some rank holds a slice: the codes' all-max carries every receiver's slices."""
    return got[2] > 0


def slice_values(slices: Sequence[Slice | None], group_rank: int, receivers: int) -> list[int]:
    """A receiver's share of the slices in the codes' all-max: its own row (group rank g: row g - 1) holds
    its slices, every other row zeros."""
    n = len(slices)
    out = [0] * (receivers * SLICE_CODES * n)
    base = (group_rank - 1) * SLICE_CODES * n
    for i, sl in enumerate(slices):
        if sl is not None:
            out[base + SLICE_CODES * i:base + SLICE_CODES * (i + 1)] = [sl.dim + 1, sl.start, sl.length]
    return out


@dataclass(frozen=True)
class SliceTable:
    """Every receiver's slices in one delta sync, as each end reads them from the codes' all-max.
    `distinct`: the slices the sender digests (after the full tensors, in this order) and delivers."""

    rows: tuple[tuple[Slice | None, ...], ...]  # per receiver (group rank 1..R), per tensor
    distinct: tuple[tuple[int, Slice], ...]  # (tensor index, slice), sorted

    @classmethod
    def from_values(cls, values: Sequence[int], n: int, receivers: int) -> SliceTable:
        assert len(values) == receivers * SLICE_CODES * n, (len(values), receivers, n)
        rows, seen = [], set()
        for g in range(receivers):
            row = []
            for i in range(n):
                dim1, start, length = values[SLICE_CODES * (g * n + i):SLICE_CODES * (g * n + i + 1)]
                sl = Slice(dim1 - 1, start, length) if dim1 else None
                if sl is not None:
                    seen.add((i, sl))
                row.append(sl)
            rows.append(tuple(row))
        return cls(tuple(rows), tuple(sorted(seen, key=lambda p: (p[0], p[1].dim, p[1].start, p[1].length))))

    def digest_indices(self, group_rank: int) -> list[int]:
        """Per tensor, where the digest of what receiver `group_rank` holds sits in the delivered list:
        its index (the full tensor's) or n + the slice's place in `distinct`."""
        row, n = self.rows[group_rank - 1], len(self.rows[group_rank - 1])
        place = {p: n + j for j, p in enumerate(self.distinct)}
        return [i if sl is None else place[(i, sl)] for i, sl in enumerate(row)]

    def items(self, specs: Sequence[TensorSpec],
              tensors: Sequence[torch.Tensor]) -> tuple[list[tuple[str, torch.Tensor]], list[TensorSpec]]:
        """The sender's (name, slice of the tensor) to digest, and their specs, in `distinct` order."""
        items, out = [], []
        for i, sl in self.distinct:
            spec = specs[i]
            items.append((spec.name, tensors[i].narrow(sl.dim, sl.start, sl.length)))
            out.append(TensorSpec(spec.name, spec.dtype, sl.shape(spec.shape)))
        return items, out


class KeptCopy:
    """The sender's copy of what every rank holds after the last sync it sent of each layout (a target
    and its draft are two), and its version.

    It lives where the trainer's tensors live, in their dtype (a GPU trainer pays one model's bytes of
    GPU memory, a CPU trainer as much host memory): the compare then reads both on one device. A copy
    is the base of the next offer only after a send whose status step passed (every rank wrote it); a
    rank whose audit failed is torn and refuses the base at the next offer, so the copy needs no
    acknowledgment of its own. Any failure forgets every copy: the next sync is full.
    """

    def __init__(self) -> None:
        self._copies: dict[str, tuple[int, list[torch.Tensor]]] = {}  # layout key -> (version, flat copies)
        self._pool: ThreadPoolExecutor | None = None  # the encode's helper threads (host tensors)
        self._payload: torch.Tensor | None = None  # reused while it fits (ipc exports its storage once)
        self.sizes: list[dict[str, int]] = []  # the last encode's candidate sizes per tensor (benchmark)

    def base_for(self, specs: ParsedManifest) -> int:
        """The version the next delta of this layout is against, or -1 (no copy)."""
        kept = self._copies.get(specs.layout_key)
        return kept[0] if kept is not None else -1

    def set_version(self, specs: ParsedManifest, version: int) -> None:
        """Say the copy of this layout is of `version` (tests make the sender's base differ from a rank's)."""
        self._copies[specs.layout_key] = (version, self._copies[specs.layout_key][1])

    def encode(self, specs: ParsedManifest, tensors: Sequence[torch.Tensor]) -> tuple[DeltaLayout, torch.Tensor]:
        """The delta of `tensors` against the copy: its layout and the wire tensor (a view of a reused
        buffer). The copy becomes `tensors` on the way (each changed element written once, by the compare
        that found it), so a sync that fails after this call must `forget` (the sender does)."""
        copies = self._copies[specs.layout_key][1]
        news = [bits(t.contiguous()) for t in tensors]
        if self._pool is None and THREADS > 1 and any(t.device.type == "cpu" for t in tensors):
            self._pool = ThreadPoolExecutor(THREADS - 1, thread_name_prefix="delta-encode")
        encoded: list[Encoded] = encode_all(specs, news, copies, update=True, pool=self._pool, threads=THREADS)
        self.sizes = [e.sizes for e in encoded]
        layout = DeltaLayout.from_codes(specs, [v for e in encoded for v in (e.enc, e.a, e.b)])
        payload = self._buffer(layout.total, tensors[0].device if tensors else torch.device("cpu"))
        for spec, new, enc, entry in zip(specs, news, encoded, layout.entries):
            if entry.nbytes:
                write_payload(spec, enc, new, payload[entry.offset:entry.offset + entry.nbytes])
        return layout, payload

    def commit(self, version: int, specs: ParsedManifest, tensors: Sequence[torch.Tensor],
               delta: tuple[DeltaLayout, torch.Tensor] | None) -> None:
        """Every rank wrote this sync: the copy is of `version` (a delta's encode made it the tensors sent;
        a full sync makes a fresh copy)."""
        kept = self._copies.get(specs.layout_key)
        if delta is not None and kept is not None:
            copies = kept[1]
        else:
            self._copies.pop(specs.layout_key, None)  # the old copy goes before the new one is made
            copies = [bits(t.contiguous()).clone() for t in tensors]
        self._copies[specs.layout_key] = (version, copies)

    def forget(self) -> None:
        self._copies.clear()

    def close(self) -> None:
        """Stop the encode's threads (the copies stay: a new session may start from them)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _buffer(self, nbytes: int, device: torch.device) -> torch.Tensor:
        buf = self._payload
        if buf is None or buf.numel() < nbytes or buf.device != device:
            self._payload = None
            self._payload = buf = torch.empty(nbytes + nbytes // 4, dtype=torch.uint8, device=device)
        return buf[:nbytes]

    @property
    def nbytes(self) -> int:
        """Memory the copies and the payload buffer hold (where the trainer's tensors are)."""
        held = sum(c.numel() * c.element_size() for _, copies in self._copies.values() for c in copies)
        return held + (self._payload.numel() if self._payload is not None else 0)


# ---- a receiver: the sink a delta lands in -------------------------------------------------------
@runtime_checkable
class DeltaTarget(Protocol):
    """What a rank's sink offers a delta (inference/weights/target.py UpdateTarget)."""

    def delta_regions(self) -> Regions | None:
        """Per manifest tensor, the region the rank holds of it and which part (None: all of it), or None
        when some tensor has none (the sync must be full)."""
        ...

    def mark_delta(self) -> None:
        """Every tensor was written into its delta region: the audit digests those regions."""
        ...

    def landed(self) -> None: ...


def delta_regions(sink: object) -> Regions | None:
    """The regions a delta applies into on this rank, or None (the sink takes no delta)."""
    return sink.delta_regions() if isinstance(sink, DeltaTarget) else None


class DeltaSink:
    """The sink of a delta sync: the wire tensor lands in a buffer on the rank's device, and once every
    byte is there (`landed`) it is applied into the target's regions, which are then reported written
    (the audit digests them) before the target's own `landed`."""

    def __init__(self, target: DeltaTarget, regions: Regions, specs: Sequence[TensorSpec], layout: DeltaLayout,
                 device: torch.device) -> None:
        self._sink, self._specs, self.layout = target, specs, layout
        self._regions = [r for r, _ in regions]
        self._slices = [sl for _, sl in regions]
        self._buffer = torch.empty(layout.total, dtype=torch.uint8, device=device)
        self._dests = (self._buffer,)
        self._applied = False

    def direct_destinations(self) -> Sequence[torch.Tensor | None]:
        return self._dests

    def mark_direct(self, indices: Sequence[int]) -> None:
        return None  # the only tensor is the payload, read at landed()

    def put(self, items: Sequence[tuple[int, torch.Tensor]]) -> None:
        for index, tensor in items:
            assert index == 0, index
            self._buffer.copy_(tensor.reshape(-1).view(torch.uint8))

    def landed(self) -> None:
        if self._applied:
            return
        self._applied = True
        with torch.no_grad():
            apply_delta(self._regions, self._specs, self.layout, self._buffer, self._slices, THREADS)
        self._sink.mark_delta()
        self._sink.landed()
