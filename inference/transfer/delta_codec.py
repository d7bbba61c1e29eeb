"""The delta of one sync: its wire format, the encoder (the sender) and the decoder (both ends).

A delta is ONE uint8 payload holding, per tensor in manifest order, the smallest of four encodings
(elements compared bitwise, as integers of their width, so NaN patterns and -0.0 count as they are):
UNCHANGED (no bytes), INDEX (changed element indices, then their values), RUNS (start and length per run
of changed elements, gaps cheaper than a run header merged in, then the values the runs cover), DENSE
(the whole tensor). Indices are int32 below 2**31 elements, else int64; each section is 8-aligned.
Three integers per tensor (its codes: encoding, two counts) place every section: `DeltaLayout`.
Host tensors are compared with numpy in L2-sized chunks, each chunk's changes found 8 mask bytes at a
time (at RL learning rates most groups of 8 are unchanged), their values gathered (and, for the sender's
kept copy, written into it) while the chunk is in cache. Device tensors go through torch with two host
syncs per encode and one or two per apply, whatever the number of tensors. Both give the same bytes.
An apply writes a region that holds the whole tensor or a `Slice` of it (a TP shard): only the elements
inside the slice are written, and every index of the payload is checked before any element is written.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from inference.transfer.plan import ParsedManifest, TensorSpec

UNCHANGED, DENSE, INDEX, RUNS = 0, 1, 2, 3
ENCODINGS = ("unchanged", "dense", "index", "runs")
CODES = 3  # integers per tensor: (encoding, count a, count b)
WIRE_NAME = "delta"
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NUMPY = {torch.uint8: np.uint8, torch.int16: np.int16, torch.int32: np.int32, torch.int64: np.int64}
_CHUNK = 1 << 18  # host compare: elements per step (the chunk, its mask and its values stay in L2)
_GROUP = 8  # mask bytes tested at once, as one uint64


class DeltaError(RuntimeError):
    """A delta that cannot be applied (names the tensor); the model stays torn until a full sync."""


def _pad8(n: int) -> int:
    return (n + 7) // 8 * 8


def index_width(numel: int) -> int:
    return 4 if numel < 1 << 31 else 8


def _index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if index_width(numel) == 4 else torch.int64


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


def bits(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's elements as integers of its width, flat (bitwise compares and writes)."""
    assert t.is_contiguous(), "a delta reads and writes contiguous tensors only"
    return t.detach().reshape(-1).view(_BITS[t.element_size()])


@dataclass(frozen=True)
class Slice:
    """The part of a full tensor that a region holds: full.narrow(dim, start, length) (a TP shard)."""

    dim: int
    start: int
    length: int

    def shape(self, full: Sequence[int]) -> tuple[int, ...]:
        return tuple(self.length if d == self.dim else n for d, n in enumerate(full))

    def fits(self, full: Sequence[int]) -> bool:
        return 0 <= self.dim < len(full) and self.start >= 0 and self.length >= 0 \
            and self.start + self.length <= full[self.dim]


# ---- the sender: encode ------------------------------------------------------------------------
# Host work is numpy's (each call one thread: no intra-op pool spin-waiting on a loaded host; the encode
# spreads tensors over threads of its own), device work torch's.
Array = np.ndarray | torch.Tensor


class _Memory:
    """A contiguous CPU tensor's memory as numpy sees it (the array interface), keeping the tensor alive."""

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor = t
        self.__array_interface__ = {"data": (t.data_ptr(), False), "shape": (t.numel(),), "version": 3,
                                    "typestr": np.dtype(_NUMPY[t.dtype]).str}


def host_array(t: torch.Tensor) -> np.ndarray:
    """A writable numpy view of a flat CPU integer tensor (`bits`) that leaves the tensor as it was:
    Tensor.numpy() marks its storage not resizable for good, which would break what resizes storages
    (the memory arenas' sleep, FSDP freeing unsharded parameters)."""
    assert t.device.type == "cpu" and t.dim() == 1 and t.is_contiguous(), (t.device, t.shape)
    return np.asarray(_Memory(t))


@dataclass
class Encoded:
    """One tensor's delta: its encoding, counts, what its payload holds, and every candidate's size."""

    enc: int
    a: int = 0
    b: int = 0
    idx: Array | None = None  # INDEX: the changed indices; RUNS: the run starts
    lens: Array | None = None  # RUNS: the run lengths
    values: Array | None = None  # INDEX on the host: the changed values, gathered by the compare
    sizes: dict[str, int] = field(default_factory=dict)  # "dense", "index", "runs" bytes, and "changed"


def encode(spec: TensorSpec, new: torch.Tensor, old: torch.Tensor) -> Encoded:
    """The smallest encoding of one tensor (`new` against `old`: flat integer views, one device)."""
    return encode_all([spec], [new], [old])[0]


def encode_all(specs: Sequence[TensorSpec], news: Sequence[torch.Tensor], olds: Sequence[torch.Tensor],
               update: bool = False, pool: Executor | None = None, threads: int = 1) -> list[Encoded]:
    """The smallest encoding of every tensor (flat integer views, `new` and `old` on one device): host
    tensors in `threads` shares of about equal bytes, all but one on `pool` (numpy leaves the GIL in its
    loops), device tensors in one batch per device (two host syncs in all). `update`: `old` becomes `new`
    on the way, each changed element written once (on the host while its chunk is in cache)."""
    out: list[Encoded] = [Encoded(UNCHANGED)] * len(specs)
    on_device: dict[torch.device, list[int]] = {}
    host = []
    for i, new in enumerate(news):
        if new.device.type == "cpu":
            host.append(i)
        else:
            on_device.setdefault(new.device, []).append(i)

    def run(share: list[int]) -> None:
        for i in share:
            out[i] = _encode_host(specs[i], host_array(news[i]), host_array(olds[i]), update)

    mine, *others = _shares(host, [news[i].numel() for i in host], threads if pool is not None else 1)
    running = [pool.submit(run, share) for share in others if share]  # type: ignore[union-attr]
    try:
        run(mine)
    finally:
        for future in running:
            future.result()
    for items in on_device.values():
        batch = _encode_device([specs[i] for i in items], [news[i] for i in items], [olds[i] for i in items],
                               update)
        for i, enc in zip(items, batch):
            out[i] = enc
    return out


def _shares(items: list[int], sizes: list[int], n: int) -> list[list[int]]:
    """`items` in n shares of about equal total size (largest first, each to the lightest share)."""
    shares: list[list[int]] = [[] for _ in range(max(n, 1))]
    loads = [0] * len(shares)
    for size, item in sorted(zip(sizes, items), reverse=True):
        k = loads.index(min(loads))
        shares[k].append(item)
        loads[k] += size
    return shares


def _joinable_gap(spec: TensorSpec) -> int:
    """The longest gap of unchanged elements that joins two runs: writing it costs less than a run header."""
    return (2 * index_width(spec.numel) - 1) // spec.torch_dtype.itemsize


def _smallest(spec: TensorSpec, k: int, r: int, m: int) -> tuple[int, dict[str, int]]:
    """The smallest encoding of k changed elements that make r runs of m elements once the joinable gaps
    are merged, and every candidate's bytes (the benchmark reports them)."""
    sizes = {"dense": payload_bytes(spec, DENSE, 0, 0), "changed": k}
    if k == 0:
        return UNCHANGED, {**sizes, "index": 0, "runs": 0}
    sizes.update(index=payload_bytes(spec, INDEX, k, 0), runs=payload_bytes(spec, RUNS, r, m))
    best = min(("index", "runs", "dense"), key=sizes.__getitem__)
    return ENCODINGS.index(best), sizes


def _encode_host(spec: TensorSpec, new: np.ndarray, old: np.ndarray, update: bool) -> Encoded:
    idx, values = _host_changes(new, old, update)
    k, limit, n_joined, gap_elements = idx.size, _joinable_gap(spec), 0, 0
    if k > 1:  # one histogram of the gaps (capped past the limit) gives both sums
        steps = np.diff(idx)  # a gap of g unchanged elements is a step of g + 1
        np.minimum(steps, limit + 2, out=steps)
        counts = np.bincount(steps, minlength=limit + 3)[1:limit + 2]  # steps 1 .. limit + 1: joined
        n_joined, gap_elements = int(counts.sum()), int(np.dot(counts, np.arange(limit + 1)))
    r, m = k - n_joined, k + gap_elements
    enc, sizes = _smallest(spec, k, r, m)
    if enc == INDEX:
        return Encoded(INDEX, k, 0, idx=idx, values=values, sizes=sizes)
    if enc != RUNS:
        return Encoded(enc, sizes=sizes)
    breaks = np.flatnonzero(np.diff(idx) > limit + 1)
    starts = np.concatenate([idx[:1], idx[1:][breaks]])
    lens = np.concatenate([idx[:-1][breaks], idx[-1:]]) - starts + 1
    return Encoded(RUNS, r, m, idx=starts, lens=lens, sizes=sizes)


def _host_changes(new: np.ndarray, old: np.ndarray, update: bool) -> tuple[np.ndarray, np.ndarray]:
    """(the ascending indices where `new` and `old` differ, as the wire's index integers; new's values
    there); `update` writes those values into `old`."""
    n = new.size
    itype = np.int32 if index_width(n) == 4 else np.int64
    mask = np.empty(min(n, _CHUNK), dtype=np.bool_)
    hit = np.empty(min(n, _CHUNK) // _GROUP, dtype=np.bool_)
    idx_parts, value_parts = [], []
    for start in range(0, n, _CHUNK):
        end = min(start + _CHUNK, n)
        chunk, m = new[start:end], mask[:end - start]
        np.not_equal(chunk, old[start:end], out=m)
        local = _positions(m, hit)
        if local.size:
            values = chunk[local]
            if update:
                old[start:end][local] = values
            value_parts.append(values)
            found = local.astype(itype)
            found += start
            idx_parts.append(found)
    if not idx_parts:
        return np.empty(0, dtype=itype), new[:0]
    if len(idx_parts) == 1:
        return idx_parts[0], value_parts[0]
    return np.concatenate(idx_parts), np.concatenate(value_parts)


def _positions(mask: np.ndarray, hit: np.ndarray) -> np.ndarray:
    """The ascending positions of the True entries of `mask`: groups of 8 bytes tested as one uint64 (the
    bool path of flatnonzero then scans 1/8 of the entries), then the lanes of the groups that hold one;
    where most groups hold one (a dense change), flatnonzero over the mask itself is cheaper.
    `hit`: scratch of at least len(mask) // 8 bools."""
    whole = mask.size // _GROUP * _GROUP
    groups = mask[:whole].view(np.uint64)
    any_set = hit[:groups.size]
    np.not_equal(groups, 0, out=any_set)
    where = np.flatnonzero(any_set)
    if 2 * where.size > groups.size:
        return np.flatnonzero(mask)
    lanes = np.flatnonzero(groups[where].view(np.bool_))  # a True mask byte is 1: the lanes are bools
    pos = where[lanes >> 3]
    pos <<= 3
    pos += lanes & 7
    if whole < mask.size:
        tail = np.flatnonzero(mask[whole:])
        if tail.size:
            pos = np.concatenate([pos, tail + whole])
    return pos


def _encode_device(specs: Sequence[TensorSpec], news: Sequence[torch.Tensor], olds: Sequence[torch.Tensor],
                   update: bool) -> list[Encoded]:
    """The tensors of one device: the counts of changes come back in ONE host sync, nonzero_static finds
    the changes without another (the compare runs twice: it is memory-bound on a GPU, and a mask kept per
    tensor would cost a byte per element), and the runs' sizes come back in a second sync."""
    counts = torch.stack([torch.count_nonzero(n != o) for n, o in zip(news, olds)]).tolist()
    found, stats = [], []
    for spec, new, old, k in zip(specs, news, olds, counts):
        idx = torch.nonzero_static(new != old, size=k).view(-1) if k else new[:0].long()
        found.append(idx)
        if update and k:
            old.index_put_((idx,), new.index_select(0, idx))
        if k > 1:
            gaps = idx[1:] - idx[:-1] - 1
            joined = gaps <= _joinable_gap(spec)
            stats.append(torch.stack([joined.sum(), torch.where(joined, gaps, 0).sum()]))
    merged = iter(torch.stack(stats).tolist() if stats else [])
    out = []
    for spec, idx, k in zip(specs, found, counts):
        n_joined, gap_elements = next(merged) if k > 1 else (0, 0)
        r, m = k - n_joined, k + gap_elements
        enc, sizes = _smallest(spec, k, r, m)
        if enc == INDEX:
            out.append(Encoded(INDEX, k, 0, idx=idx, sizes=sizes))
        elif enc == RUNS:
            gaps = idx[1:] - idx[:-1] - 1
            breaks = torch.nonzero_static(gaps > _joinable_gap(spec), size=r - 1).view(-1) if r > 1 else idx[:0]
            starts = torch.cat([idx[:1], idx[1:][breaks]])
            lens = torch.cat([idx[:-1][breaks], idx[-1:]]) - starts + 1
            out.append(Encoded(RUNS, r, m, idx=starts, lens=lens, sizes=sizes))
        else:
            out.append(Encoded(enc, sizes=sizes))
    return out


def write_payload(spec: TensorSpec, enc: Encoded, new: torch.Tensor, part: torch.Tensor) -> None:
    """Fill one tensor's payload bytes `part` (uint8, 8-aligned, on new's device) from `new` (its flat
    integer view)."""
    if new.device.type == "cpu":
        _write_host(spec, enc, host_array(new), host_array(part))
    else:
        _write_device(spec, enc, new, part)


def _write_host(spec: TensorSpec, enc: Encoded, new: np.ndarray, part: np.ndarray) -> None:
    w, item = index_width(spec.numel), spec.torch_dtype.itemsize
    itype = np.int32 if w == 4 else np.int64
    if enc.enc == DENSE:
        part[:spec.nbytes] = new.view(np.uint8)
    elif enc.enc == INDEX:
        k = enc.a
        part[:k * w].view(itype)[:] = enc.idx
        values = part[_pad8(k * w):_pad8(k * w) + k * item].view(new.dtype)
        if enc.values is not None:
            values[:] = enc.values
        else:
            np.take(new, enc.idx, out=values)
    elif enc.enc == RUNS:
        r, m = enc.a, enc.b
        heads = part[:2 * r * w].view(itype)
        heads[:r] = enc.idx
        heads[r:] = enc.lens
        values = part[_pad8(2 * r * w):_pad8(2 * r * w) + m * item].view(new.dtype)
        np.take(new, _run_indices(np.asarray(enc.idx), np.asarray(enc.lens), m), out=values)


def _write_device(spec: TensorSpec, enc: Encoded, new: torch.Tensor, part: torch.Tensor) -> None:
    w, item, itype = index_width(spec.numel), spec.torch_dtype.itemsize, _index_dtype(spec.numel)
    if enc.enc == DENSE:
        part[:spec.nbytes].copy_(new.view(torch.uint8))
    elif enc.enc == INDEX:
        assert isinstance(enc.idx, torch.Tensor)
        k = enc.a
        part[:k * w].view(itype).copy_(enc.idx)
        torch.index_select(new, 0, enc.idx, out=part[_pad8(k * w):_pad8(k * w) + k * item].view(new.dtype))
    elif enc.enc == RUNS:
        assert isinstance(enc.idx, torch.Tensor) and isinstance(enc.lens, torch.Tensor)
        r, m = enc.a, enc.b
        heads = part[:2 * r * w].view(itype)
        heads[:r].copy_(enc.idx)
        heads[r:].copy_(enc.lens)
        values = part[_pad8(2 * r * w):_pad8(2 * r * w) + m * item].view(new.dtype)
        torch.index_select(new, 0, _run_indices(enc.idx, enc.lens, m), out=values)


def _run_indices(starts: Array, lens: Array, m: int) -> Array:
    """Every element index the runs cover, in order (int64; `m` = sum of lens, so no host sync)."""
    if isinstance(starts, np.ndarray):
        starts, lens = starts.astype(np.int64), lens.astype(np.int64)
        return np.repeat(starts - (np.cumsum(lens) - lens), lens) + np.arange(m)
    starts, lens = starts.long(), lens.long()
    first = torch.cumsum(lens, 0) - lens  # each run's first position among the values
    return torch.arange(m, device=starts.device) + torch.repeat_interleave(starts - first, lens, output_size=m)


# ---- both ends: apply ----------------------------------------------------------------------------
Part = tuple[int, Array, Array, Slice | None]  # (tensor index, region's flat integer view, payload bytes, slice)


def apply_delta(regions: Sequence[torch.Tensor | None], specs: Sequence[TensorSpec], layout: DeltaLayout,
                payload: torch.Tensor, slices: Sequence[Slice | None] | None = None, threads: int = 1) -> None:
    """Write every tensor's payload into its region, in place, on the region's device. `slices[i]`: the
    part of tensor i its region holds (None: the whole tensor). Every index and run is checked before
    any element is written (a DeltaError names the first tensor whose payload does not fit it); on a
    device that costs one host sync, and one more when some region holds a slice. `threads`: how many
    threads write the host regions."""
    host: list[Part] = []
    device: dict[torch.device, list[Part]] = {}
    for i, (spec, entry) in enumerate(zip(specs, layout.entries)):
        if entry.enc == UNCHANGED:
            continue
        region, sl = regions[i], slices[i] if slices is not None else None
        if region is None:
            raise DeltaError(f"{spec.name}: no held region to apply a delta into")
        want = sl.shape(spec.shape) if sl is not None else spec.shape
        if math.prod(want) != region.numel() or region.element_size() != spec.torch_dtype.itemsize:
            raise DeltaError(f"{spec.name}: the held region ({list(region.shape)}, {region.dtype}) does not "
                             f"hold {f'a slice {list(want)}' if sl is not None else 'the tensor'} of {spec.dtype}")
        if entry.enc == RUNS and entry.a == 0 and entry.b:
            raise DeltaError(f"{spec.name}: a delta of no runs holds {entry.b} values")
        dst, part = bits(region), payload[entry.offset:entry.offset + entry.nbytes]
        if dst.device.type == "cpu":
            host.append((i, host_array(dst), host_array(part.cpu()), sl))
        else:
            device.setdefault(dst.device, []).append((i, dst, part.to(dst.device), sl))
    for i, _, part, _ in host:
        _check_host(specs[i], layout.entries[i], part)
    for parts in device.values():
        _check_device(specs, layout, parts)
    _apply_host_shares(specs, layout, host, threads)
    for parts in device.values():
        _apply_device(specs, layout, parts)


def _apply_host_shares(specs: Sequence[TensorSpec], layout: DeltaLayout, host: Sequence[Part], threads: int) -> None:
    """The host parts in `threads` shares of about equal payload bytes, all but one on threads of their own
    (numpy leaves the GIL in its scatters), for this apply only."""
    def run(share: list[int]) -> None:
        for j in share:
            i, dst, part, sl = host[j]
            _apply_host(specs[i], layout.entries[i], dst, part, sl)  # type: ignore[arg-type]

    mine, *others = _shares(list(range(len(host))), [host[j][2].size for j in range(len(host))], threads)
    others = [share for share in others if share]
    if not others:
        run(mine)
        return
    with ThreadPoolExecutor(len(others), thread_name_prefix="delta-apply") as pool:
        running = [pool.submit(run, share) for share in others]
        try:
            run(mine)
        finally:
            for future in running:
                future.result()


def _outside(spec: TensorSpec, entry: Entry) -> DeltaError:
    what = "an index" if entry.enc == INDEX else f"a run (or the runs do not hold {entry.b} values)"
    return DeltaError(f"{spec.name}: {what} of its delta lies outside its {spec.numel} elements")


def _heads(spec: TensorSpec, entry: Entry, part: Array) -> Array:
    """The indices (INDEX) or starts then lengths (RUNS) of a payload, as its index integers."""
    count = (entry.a if entry.enc == INDEX else 2 * entry.a) * index_width(spec.numel)
    if isinstance(part, np.ndarray):
        return part[:count].view(np.int32 if index_width(spec.numel) == 4 else np.int64)
    return part[:count].view(_index_dtype(spec.numel))


def _values(spec: TensorSpec, entry: Entry, part: Array, dtype: Any) -> Array:
    heads = (entry.a if entry.enc == INDEX else 2 * entry.a) * index_width(spec.numel)
    count = entry.a if entry.enc == INDEX else entry.b
    return part[_pad8(heads):_pad8(heads) + count * spec.torch_dtype.itemsize].view(dtype)


def _check_host(spec: TensorSpec, entry: Entry, part: np.ndarray) -> None:
    if entry.enc == DENSE or entry.a == 0:
        return
    heads = _heads(spec, entry, part)
    if entry.enc == INDEX:
        if heads.min() < 0 or heads.max() >= spec.numel:
            raise _outside(spec, entry)
        return
    starts, lens = heads[:entry.a].astype(np.int64), heads[entry.a:].astype(np.int64)
    if starts.min() < 0 or lens.min() <= 0 or (starts + lens).max() > spec.numel or lens.sum() != entry.b:
        raise _outside(spec, entry)


def _apply_host(spec: TensorSpec, entry: Entry, dst: np.ndarray, part: np.ndarray, sl: Slice | None) -> None:
    if entry.enc == DENSE:
        dense = part[:spec.nbytes].view(dst.dtype)
        dst[:] = dense if sl is None else dense.reshape(spec.shape)[_slicer(spec, sl)].reshape(-1)
        return
    heads, values = _heads(spec, entry, part), _values(spec, entry, part, dst.dtype)
    idx = heads if entry.enc == INDEX else _run_indices(heads[:entry.a], heads[entry.a:], entry.b)
    if sl is not None:
        inside = _slice_mask(spec.shape, sl, idx)
        idx, values = _in_region(spec.shape, sl, idx[inside].astype(np.int64)), values[inside]
    dst[idx] = values


def _check_device(specs: Sequence[TensorSpec], layout: DeltaLayout, parts: Sequence[Part]) -> None:
    """DeltaError naming the first tensor whose indices or runs lie outside it (one host sync)."""
    flags = []
    for i, _, part, _ in parts:
        spec, entry = specs[i], layout.entries[i]
        if entry.enc == DENSE or entry.a == 0:
            continue
        heads = _heads(spec, entry, part)
        if entry.enc == INDEX:
            lo, hi = torch.aminmax(heads)
            flags.append((i, (lo < 0) | (hi >= spec.numel)))
        else:
            starts, lens = heads[:entry.a].long(), heads[entry.a:].long()
            flags.append((i, ((starts < 0) | (lens <= 0) | (starts + lens > spec.numel)).any()
                          | (lens.sum() != entry.b)))
    if flags:
        for (i, _), bad in zip(flags, torch.stack([b for _, b in flags]).tolist()):
            if bad:
                raise _outside(specs[i], layout.entries[i])


def _apply_device(specs: Sequence[TensorSpec], layout: DeltaLayout, parts: Sequence[Part]) -> None:
    """Every checked payload of one device into its region; the changes inside each slice are counted in
    one host sync (nonzero_static then selects them without another)."""
    sparse = []
    for i, dst, part, sl in parts:
        spec, entry = specs[i], layout.entries[i]
        if entry.enc == DENSE:
            dense = part[:spec.nbytes].view(dst.dtype)
            dst.copy_(dense if sl is None else dense.view(spec.shape)[_slicer(spec, sl)].reshape(-1))
            continue
        heads, values = _heads(spec, entry, part), _values(spec, entry, part, dst.dtype)
        idx = heads.long() if entry.enc == INDEX else _run_indices(heads[:entry.a], heads[entry.a:], entry.b)
        sparse.append((spec, dst, idx, values, sl))
    inside = [_slice_mask(spec.shape, sl, idx) if sl is not None else None for spec, _, idx, _, sl in sparse]
    masks = [m for m in inside if m is not None]
    counts = iter(torch.stack([torch.count_nonzero(m) for m in masks]).tolist() if masks else [])
    for (spec, dst, idx, values, sl), mask in zip(sparse, inside):
        if sl is not None and mask is not None:
            kept = next(counts)
            where = torch.nonzero_static(mask, size=kept).view(-1) if kept else idx[:0]
            idx, values = _in_region(spec.shape, sl, idx[where]), values[where]
        if idx.numel():
            dst.index_put_((idx,), values)


def _slicer(spec: TensorSpec, sl: Slice) -> tuple[slice, ...]:
    return tuple(slice(sl.start, sl.start + sl.length) if d == sl.dim else slice(None) for d in range(len(spec.shape)))


def _slice_mask(shape: Sequence[int], sl: Slice, idx: Array) -> Array:
    """Which of the full tensor's element indices fall inside the slice."""
    inner = math.prod(shape[sl.dim + 1:])
    if sl.dim == 0:
        return (idx >= sl.start * inner) & (idx < (sl.start + sl.length) * inner)
    row = (idx // inner) % shape[sl.dim]
    return (row >= sl.start) & (row < sl.start + sl.length)


def _in_region(shape: Sequence[int], sl: Slice, idx: Array) -> Array:
    """Full-tensor element indices inside the slice (int64) as indices into the region that holds it (C order)."""
    inner = math.prod(shape[sl.dim + 1:])
    if sl.dim == 0:
        return idx - sl.start * inner
    size = shape[sl.dim]
    outer, row, lane = idx // (inner * size), (idx // inner) % size, idx % inner
    return (outer * sl.length + (row - sl.start)) * inner + lane
