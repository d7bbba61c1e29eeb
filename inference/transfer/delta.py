"""Delta syncs of full weights: only the elements that changed since the version every rank holds.

A session negotiated with `InitInfo.delta` starts every sync with the OFFER: one all-max of two values
(`offer_values`): the sender offers its base (the version of its kept copy, -1 for none), each
receiver the version it holds intact (-1 when torn, not loaded, released at a level-2 sleep, or when
some tensor has no held region to apply into: TP shards, casts, a tied lm_head). Only when every end
offered the same version does the sync move a delta, and a second all-max carries its codes (per
tensor: encoding and counts); otherwise it moves the full tensors: the fallback is automatic.
A delta travels as ONE uint8 tensor ("delta") through the ordinary plan and backend, and the rank
applies it in place (`apply_delta`) before the audit digests the FULL held tensors under the sync's
rule, so a delta is proven against the trainer's full weights exactly as a full sync is.
Per tensor the smallest encoding wins (elements compared bitwise): UNCHANGED, INDEX (changed indices,
then values), RUNS (start and length per run, gaps cheaper than a run header merged in, then values),
DENSE (the whole tensor). Indices are int32 below 2**31 elements, else int64; sections 8-aligned.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from checksum import flat_bytes
from inference.transfer.plan import ParsedManifest, TensorSpec

UNCHANGED, DENSE, INDEX, RUNS = 0, 1, 2, 3
ENCODINGS = ("unchanged", "dense", "index", "runs")
CODES = 3  # offer values per tensor: (encoding, count a, count b)
WIRE_NAME = "delta"
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class DeltaError(RuntimeError):
    """A delta that cannot be applied (names the tensor); the model stays torn until a full sync."""


def _pad8(n: int) -> int:
    return (n + 7) // 8 * 8


def index_width(numel: int) -> int:
    return 4 if numel < 1 << 31 else 8


def payload_bytes(spec: TensorSpec, enc: int, a: int, b: int) -> int:
    """Bytes of one tensor's payload (a, b: INDEX (k changed, -); RUNS (r runs, m elements in them))."""
    item, w = spec.torch_dtype.itemsize, index_width(spec.numel)
    if enc == UNCHANGED:
        return 0
    if enc == DENSE:
        return _pad8(spec.nbytes)
    if enc == INDEX:
        return _pad8(a * w) + _pad8(a * item)
    if enc == RUNS:
        return _pad8(2 * a * w) + _pad8(b * item)
    raise DeltaError(f"{spec.name}: unknown delta encoding {enc}")


@dataclass(frozen=True)
class Entry:
    enc: int
    a: int
    b: int
    offset: int  # in the payload
    nbytes: int


@dataclass(frozen=True)
class DeltaLayout:
    """Where each tensor's payload sits in the one wire tensor; both ends derive it from the codes."""

    entries: tuple[Entry, ...]
    total: int

    @classmethod
    def from_codes(cls, specs: Sequence[TensorSpec], codes: Sequence[int]) -> DeltaLayout:
        assert len(codes) == CODES * len(specs), (len(codes), len(specs))
        entries, offset = [], 0
        for i, spec in enumerate(specs):
            enc, a, b = codes[CODES * i:CODES * i + CODES]
            if not 0 <= enc < len(ENCODINGS) or a < 0 or b < 0:
                raise DeltaError(f"{spec.name}: bad delta codes {(enc, a, b)}")
            n = payload_bytes(spec, enc, a, b)
            entries.append(Entry(enc, a, b, offset, n))
            offset += n
        return cls(tuple(entries), max(offset, 8))  # never an empty wire tensor

    @property
    def codes(self) -> list[int]:
        return [v for e in self.entries for v in (e.enc, e.a, e.b)]

    def wire_specs(self) -> ParsedManifest:
        return ParsedManifest([TensorSpec(WIRE_NAME, "uint8", (self.total,))])

    def counts(self) -> dict[str, int]:
        """Tensors per encoding (for logs and the benchmark)."""
        out = dict.fromkeys(ENCODINGS, 0)
        for e in self.entries:
            out[ENCODINGS[e.enc]] += 1
        return out


# ---- the offer: one all-max decides delta or full, a second carries the codes -----------------
def offer_values(version: int) -> list[int]:
    """One end's offer: its version (the sender's base; a receiver's intact version; -1 for none)."""
    return [version, -version]


def offer_agreed(got: Sequence[int]) -> bool:
    """Every end offered the same version (max == min), and it is one (>= 0): the sync is a delta. A
    rank that could not even parse the start offers -1, so the codes' collective, whose length follows
    the manifest, only runs where every end parsed it."""
    return got[0] >= 0 and got[0] == -got[1]


# ---- both ends: apply ----------------------------------------------------------------------------
def bits(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's elements as integers of its width, flat (bitwise compares and writes)."""
    return t.detach().reshape(-1).view(_BITS[t.element_size()])


def apply_delta(regions: Sequence[torch.Tensor | None], specs: Sequence[TensorSpec], layout: DeltaLayout,
                payload: torch.Tensor) -> None:
    """Write every tensor's payload into its region, in place, on the region's device. DeltaError naming
    the tensor on a payload that does not fit it (bounds are checked before any index is written)."""
    for i, (spec, entry) in enumerate(zip(specs, layout.entries)):
        if entry.enc == UNCHANGED:
            continue
        region = regions[i]
        if region is None:
            raise DeltaError(f"{spec.name}: no held region to apply a delta into")
        dst = bits(region)
        part = payload[entry.offset:entry.offset + entry.nbytes].to(dst.device)
        if entry.enc == DENSE:
            dst.copy_(part[:spec.nbytes].view(dst.dtype))
            continue
        idx, values = _indices(spec, entry, part)
        dst.index_copy_(0, idx, values.view(dst.dtype))


def _indices(spec: TensorSpec, entry: Entry, part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int64 element indices, their values' bytes) of an INDEX or RUNS payload, bounds checked."""
    w, item, numel = index_width(spec.numel), spec.torch_dtype.itemsize, spec.numel
    itype = torch.int32 if w == 4 else torch.int64
    if entry.enc == INDEX:
        k = entry.a
        idx = part[:k * w].view(itype).long()
        values = part[_pad8(k * w):_pad8(k * w) + k * item]
        bad = bool(((idx < 0) | (idx >= numel)).any()) if k else False
        if bad:
            raise DeltaError(f"{spec.name}: a delta index lies outside its {numel} elements")
        return idx, values
    r, m = entry.a, entry.b
    heads = part[:2 * r * w].view(itype).long()
    starts, lens = heads[:r], heads[r:]
    values = part[_pad8(2 * r * w):_pad8(2 * r * w) + m * item]
    if r and (bool(((starts < 0) | (lens <= 0) | (starts + lens > numel)).any()) or int(lens.sum()) != m):
        raise DeltaError(f"{spec.name}: a delta run lies outside its {numel} elements or the runs do not hold "
                         f"{m} values")
    first = torch.cumsum(lens, 0) - lens  # each run's first position among the values
    idx = torch.arange(m, device=part.device) + torch.repeat_interleave(starts - first, lens)
    return idx, values


# ---- the sender: encode against the kept copy ----------------------------------------------------
@dataclass
class Encoded:
    """One tensor's delta: its encoding, counts and what its payload holds."""

    enc: int
    a: int = 0
    b: int = 0
    idx: torch.Tensor | None = None  # INDEX: changed indices; RUNS: starts
    lens: torch.Tensor | None = None  # RUNS: run lengths
    run_idx: torch.Tensor | None = None  # RUNS: every element index the runs cover


def encode(spec: TensorSpec, new: torch.Tensor, old: torch.Tensor) -> tuple[Encoded, dict[str, int]]:
    """The smallest encoding of `new` against `old` (flat integer views, same device), and the bytes each
    candidate would take (the benchmark reports them)."""
    item, w = spec.torch_dtype.itemsize, index_width(spec.numel)
    changed = torch.nonzero(new != old).view(-1)
    k = changed.numel()
    sizes = {"dense": payload_bytes(spec, DENSE, 0, 0)}
    if k == 0:
        return Encoded(UNCHANGED), {**sizes, "index": 0, "runs": 0, "changed": 0}
    # a gap of g unchanged elements joins two runs when writing it (g * item bytes) costs less than a run
    # header; the runs' sizes come from reductions, their bounds only when they are chosen
    gaps = changed[1:] - changed[:-1] - 1
    joined = gaps * item < 2 * w
    n_joined, gap_elements = torch.stack([joined.sum(), (gaps * joined).sum()]).tolist()  # one host sync
    r, m = k - n_joined, k + gap_elements
    sizes.update(index=payload_bytes(spec, INDEX, k, 0), runs=payload_bytes(spec, RUNS, r, m), changed=k)
    best = min(("index", "runs", "dense"), key=lambda name: sizes[name])
    if best == "dense":
        return Encoded(DENSE), sizes
    if best == "index":
        return Encoded(INDEX, k, 0, idx=changed), sizes
    breaks = torch.nonzero(~joined).view(-1)
    starts = torch.cat([changed[:1], changed[1:][breaks]])
    lens = torch.cat([changed[:-1][breaks], changed[-1:]]) - starts + 1
    first = torch.cumsum(lens, 0) - lens
    run_idx = torch.arange(m, device=new.device) + torch.repeat_interleave(starts - first, lens)
    return Encoded(RUNS, r, m, idx=starts, lens=lens, run_idx=run_idx), sizes


def write_payload(spec: TensorSpec, enc: Encoded, new: torch.Tensor, part: torch.Tensor) -> None:
    """Fill one tensor's payload bytes `part` (uint8, 8-aligned) from `new` (its flat integer view)."""
    w, item = index_width(spec.numel), spec.torch_dtype.itemsize
    itype = torch.int32 if w == 4 else torch.int64
    if enc.enc == DENSE:
        part[:spec.nbytes].copy_(flat_bytes(new))
    elif enc.enc == INDEX:
        assert enc.idx is not None
        k = enc.a
        part[:k * w].view(itype).copy_(enc.idx)
        part[_pad8(k * w):_pad8(k * w) + k * item].view(new.dtype).copy_(new[enc.idx])
    elif enc.enc == RUNS:
        assert enc.idx is not None and enc.lens is not None and enc.run_idx is not None
        r, m = enc.a, enc.b
        heads = part[:2 * r * w].view(itype)
        heads[:r].copy_(enc.idx)
        heads[r:].copy_(enc.lens)
        part[_pad8(2 * r * w):_pad8(2 * r * w) + m * item].view(new.dtype).copy_(new[enc.run_idx])


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
        """The delta of `tensors` against the copy: its layout and the wire tensor (a view of a reused buffer)."""
        encoded, self.sizes = [], []
        copies = self._copies[specs.layout_key][1]
        for spec, t, old in zip(specs, tensors, copies):
            enc, sizes = encode(spec, bits(t.contiguous()), old)
            encoded.append(enc)
            self.sizes.append(sizes)
        layout = DeltaLayout.from_codes(specs, [v for e in encoded for v in (e.enc, e.a, e.b)])
        payload = self._buffer(layout.total, tensors[0].device if tensors else torch.device("cpu"))
        for spec, t, enc, entry in zip(specs, tensors, encoded, layout.entries):
            if enc.enc != UNCHANGED:
                write_payload(spec, enc, bits(t.contiguous()), payload[entry.offset:entry.offset + entry.nbytes])
        return layout, payload

    def commit(self, version: int, specs: ParsedManifest, tensors: Sequence[torch.Tensor],
               delta: tuple[DeltaLayout, torch.Tensor] | None) -> None:
        """Every rank wrote this sync: the copy becomes it (the delta applied to the copy as the ranks
        applied it, or a fresh copy of a full sync)."""
        kept = self._copies.get(specs.layout_key)
        if delta is not None and kept is not None:
            apply_delta(kept[1], specs, *delta)
            copies = kept[1]
        else:
            self._copies.pop(specs.layout_key, None)  # the old copy goes before the new one is made
            copies = [bits(t.contiguous()).clone() for t in tensors]
        self._copies[specs.layout_key] = (version, copies)

    def forget(self) -> None:
        self._copies.clear()

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
class DeltaSink:
    """The sink of a delta sync: the wire tensor lands in a buffer on the rank's device, and once every
    byte is there (`landed`) it is applied into the real sink's held regions, which are then reported
    written (their digests come from the held regions) before the real sink's own `landed`."""

    def __init__(self, sink: object, specs: Sequence[TensorSpec], layout: DeltaLayout, device: torch.device) -> None:
        self._sink, self._specs, self.layout = sink, specs, layout
        self._regions = sink.direct_destinations()  # type: ignore[attr-defined]
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
            apply_delta(self._regions, self._specs, self.layout, self._buffer)
        self._sink.mark_direct(range(len(self._specs)))  # type: ignore[attr-defined]
        self._sink.landed()  # type: ignore[attr-defined]


def can_apply(sink: object) -> bool:
    """Whether every tensor of the sink has a held region a delta can be applied into."""
    return all(d is not None for d in sink.direct_destinations())  # type: ignore[attr-defined]
