"""The bucket plan both ends derive, and packing/unpacking along it (CPU, no processes)."""

from __future__ import annotations

import itertools
import json
import random

import pytest
import torch

from checksum import flat_bytes
from checksum.dtypes import dtype_from_name
from inference.core import InvalidRequestError
from inference.transfer import ipc
from inference.transfer import plan as plan_module
from inference.transfer.buckets import Packer, Unpacker
from inference.transfer.plan import (
    ALIGN,
    ManifestCache,
    ParsedManifest,
    TensorSpec,
    plan_buckets,
    plan_fingerprint,
    specs_from_manifest,
)

DTYPES = ["float32", "bfloat16", "float16", "int8", "int64", "bool", "float64"]


def random_specs(seed: int, n: int = 40, max_numel: int = 5000) -> list[TensorSpec]:
    rng = random.Random(seed)
    specs = []
    for i in range(n):
        rank = rng.randint(0, 3)
        shape = tuple(rng.randint(0 if rank and rng.random() < 0.05 else 1, 24) for _ in range(rank))
        while shape and torch.Size(shape).numel() > max_numel:
            shape = shape[1:]
        specs.append(TensorSpec(f"t{i}", rng.choice(DTYPES), shape))
    specs.append(TensorSpec("big", "float32", (3000,)))  # 12000 bytes: larger than the small buckets below
    return specs


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("bucket_bytes", [ALIGN, 1024, 4096, 1 << 20])
@pytest.mark.parametrize("alone_bytes", [None, 512], ids=["packed", "alone"])
def test_every_byte_is_covered_exactly_once_within_bucket_limits(seed: int, bucket_bytes: int,
                                                                 alone_bytes: int | None) -> None:
    specs = random_specs(seed)
    plan = plan_buckets(specs, bucket_bytes, alone_bytes)
    if alone_bytes is not None:  # a tensor of alone_bytes or more never shares a bucket
        for bucket in plan:
            big = [s for s in bucket.segments if specs[s.tensor].nbytes >= alone_bytes]
            assert not big or len(bucket.segments) == 1, [specs[s.tensor].name for s in bucket.segments]
    covered: dict[int, list[tuple[int, int]]] = {i: [] for i in range(len(specs))}
    for k, bucket in enumerate(plan):
        assert bucket.index == k
        assert 0 < bucket.nbytes <= bucket_bytes or all(s.nbytes == 0 for s in bucket.segments)
        spans = sorted((s.dst_offset, s.dst_offset + s.nbytes) for s in bucket.segments)
        assert spans[-1][1] == bucket.nbytes
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert end <= start, "segments of one bucket overlap"
        for seg in bucket.segments:
            spec = specs[seg.tensor]
            item = dtype_from_name(spec.dtype).itemsize
            covered[seg.tensor].append((seg.src_offset, seg.nbytes))
            assert seg.src_offset % item == 0 and seg.nbytes % item == 0, "a piece splits an element"
            if seg.nbytes == spec.nbytes:
                assert seg.dst_offset % ALIGN == 0, "a whole tensor starts unaligned"
            else:
                assert seg.dst_offset == 0, "a piece of a split tensor must start its bucket"
    for i, spec in enumerate(specs):
        pieces = sorted(covered[i])
        assert pieces, f"{spec.name} dropped from the plan"
        offset = 0
        for start, n in pieces:
            assert start == offset, f"{spec.name}: gap or overlap at byte {offset}"
            offset += n
        assert offset == spec.nbytes


def test_large_tensor_is_split_over_consecutive_buckets_in_manifest_order() -> None:
    specs = [TensorSpec("a", "float32", (10,)), TensorSpec("big", "bfloat16", (5000,)),
             TensorSpec("c", "int64", (3,))]
    plan = plan_buckets(specs, 1024)
    order = [seg.tensor for b in plan for seg in b.segments]
    assert order == sorted(order), "tensors must be laid out in manifest order"
    big = [b.index for b in plan for seg in b.segments if seg.tensor == 1]
    assert big == list(range(big[0], big[0] + len(big))) and len(big) == -(-10000 // 1024)


def test_plan_is_deterministic_and_validates_bucket_size() -> None:
    specs = random_specs(7)
    first = plan_buckets(specs, 2048)
    plan_module._plan.cache_clear()  # computed afresh, not served from the cache
    assert plan_buckets(list(specs), 2048) == first
    for bad in (0, 100, ALIGN + 1, -ALIGN):
        with pytest.raises(InvalidRequestError, match="bucket_bytes"):
            plan_buckets(specs, bad)


def test_fingerprint_changes_with_anything_the_ends_must_agree_on() -> None:
    specs = random_specs(1)
    base = plan_fingerprint(3, specs, 4096, "gloo")
    assert base == plan_fingerprint(3, list(specs), 4096, "gloo") and 0 < base < 2**62
    changed = [
        plan_fingerprint(4, specs, 4096, "gloo"),
        plan_fingerprint(3, specs, 8192, "gloo"),
        plan_fingerprint(3, specs, 4096, "nccl"),
        plan_fingerprint(3, [TensorSpec("x", "float32", (1,)), *specs[1:]], 4096, "gloo"),
        plan_fingerprint(3, [TensorSpec(specs[0].name, "int8", specs[0].shape), *specs[1:]], 4096, "gloo"),
        plan_fingerprint(3, specs[::-1], 4096, "gloo"),
    ]
    assert base not in changed


def test_specs_from_manifest_accepts_the_sender_format_and_names_bad_fields() -> None:
    specs = random_specs(2, n=3)
    manifest = {"version": 5, "tensors": [s.to_dict() for s in specs]}
    assert specs_from_manifest(manifest) == (5, specs)
    assert specs_from_manifest([s.to_dict() for s in specs]) == (None, specs)
    with pytest.raises(InvalidRequestError, match="shape"):
        specs_from_manifest([{"name": "a", "dtype": "float32", "shape": [-1]}])
    with pytest.raises(InvalidRequestError, match="dtype"):
        specs_from_manifest([{"name": "a", "dtype": "float99", "shape": [1]}])
    with pytest.raises(InvalidRequestError, match=r"manifest\.extra"):
        specs_from_manifest({"tensors": [], "extra": 1})


def test_manifest_cache_parses_a_layout_once_and_anything_else_afresh() -> None:
    specs = random_specs(4, n=30)
    cache = ManifestCache(size=2)
    first_version, parsed = cache.parse({"version": 1, "tensors": [s.to_dict() for s in specs]})
    again_version, again = cache.parse({"version": 2, "tensors": [s.to_dict() for s in specs]})  # a fresh, equal dict
    assert (first_version, again_version) == (1, 2) and again is parsed and list(parsed) == specs
    assert (cache.parses, cache.hits) == (1, 1)
    changed = [s.to_dict() for s in specs]
    changed[3]["shape"] = [*changed[3]["shape"], 2]
    _, other = cache.parse(changed)
    assert other is not parsed and other[3].shape == (*specs[3].shape, 2) and cache.parses == 2
    typed = [s.to_dict() for s in specs]
    typed[0]["shape"] = [float(d) for d in typed[0]["shape"]] or [1.0]  # equal under ==, refused by parsing
    for _ in range(2):
        with pytest.raises(InvalidRequestError, match="shape"):
            cache.parse(typed)
    with pytest.raises(InvalidRequestError, match="version"):  # the version is checked on every call
        cache.parse({"version": -1, "tensors": [s.to_dict() for s in specs]})
    assert cache.parse([s.to_dict() for s in specs])[1] is parsed  # now the most recently used
    cache.parse([s.to_dict() for s in specs[:5]])  # a third layout evicts the least recently used
    assert cache.parse([s.to_dict() for s in specs])[1] is parsed and cache.parse(changed)[1] is not other


def test_parsed_manifest_memoizes_the_plan_and_fingerprint_of_its_specs() -> None:
    specs = random_specs(5)
    parsed = ParsedManifest(specs)
    assert parsed.plan(2048) is parsed.plan(2048) and list(parsed.plan(2048)) == plan_buckets(specs, 2048)
    assert plan_buckets(parsed, 2048) == plan_buckets(specs, 2048)
    for version, bucket, backend in ((3, 2048, "gloo"), (4, 2048, "gloo"), (3, 4096, "ipc")):
        assert parsed.fingerprint(version, bucket, backend) == plan_fingerprint(version, specs, bucket, backend)
    assert parsed.fingerprint(3, 2048, "gloo") != parsed.fingerprint(4, 2048, "gloo")


def _offer(exporter: ipc.IpcExporter, tensors: list[torch.Tensor], mode: str = "direct") -> tuple[int, dict]:
    offer = exporter.offer(mode, tensors)
    exporter.commit()
    return offer.key, json.loads(offer.payload)


def test_ipc_layout_is_reused_while_the_tensors_stay_put(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ipc, "export_storage", lambda storage: {"size": storage.nbytes()})  # no CUDA here
    exporter = ipc.IpcExporter()
    a, b = torch.zeros(10), torch.zeros(20)
    key, first = _offer(exporter, [a, b[5:]])
    assert exporter.exported_total == 2 and len(first["new"]) == 2 and first["tensors"][1][1] == 5 * 4
    assert key == 0, "new handles must be sent whatever the receivers hold"
    exporter.retire()
    key, again = _offer(exporter, [a, b[5:]])
    assert again == {**first, "new": {}} and exporter.exported_total == 2
    assert key == ipc.layout_key(again) != 0
    moved_key, moved = _offer(exporter, [torch.zeros(10), b[5:]])  # one tensor on a new storage
    assert exporter.exported_total == 3 and list(moved["new"]) == [str(first["tensors"][1][0] + 1)]
    assert moved["tensors"][1] == first["tensors"][1] and moved["tensors"][0] != first["tensors"][0]
    assert moved_key == 0
    shifted_key, shifted = _offer(exporter, [a, b[6:]])
    assert shifted["tensors"][1] == [first["tensors"][1][0], 6 * 4]
    assert shifted_key not in (0, key), "a moved tensor changes the key, so the layout is sent again"


def _random_tensor(spec: TensorSpec, gen: torch.Generator) -> torch.Tensor:
    dtype = dtype_from_name(spec.dtype)
    bits = torch.randint(0, 256, (spec.nbytes,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        bits = bits % 2
    return bits.view(dtype).view(spec.shape)


@pytest.mark.parametrize("bucket_bytes", [ALIGN, 2048, 1 << 20])
def test_pack_then_unpack_rebuilds_every_tensor_bit_exactly(bucket_bytes: int) -> None:
    gen = torch.Generator().manual_seed(0)
    specs = random_specs(3)
    tensors = [_random_tensor(s, gen) for s in specs]
    tensors[-1] = tensors[-1].view(100, 30).t()  # non-contiguous sources are packed in row-major order
    specs[-1] = TensorSpec("big", "float32", (30, 100))
    plan = plan_buckets(specs, bucket_bytes)
    packer, unpacker = Packer(tensors, plan), Unpacker(specs, torch.device("cpu"))
    rebuilt: dict[int, torch.Tensor] = {}
    buf = torch.empty(bucket_bytes, dtype=torch.uint8)
    for bucket in plan:
        buf.fill_(0xAB)  # stale bytes from the previous bucket must never leak into a tensor
        packer.pack(bucket, buf)
        for index, t in unpacker.tensors(bucket, buf):
            assert index not in rebuilt
            rebuilt[index] = t.clone()
    assert not unpacker.incomplete
    assert sorted(rebuilt) == list(range(len(specs)))
    for i, t in enumerate(tensors):
        assert rebuilt[i].dtype == t.dtype and rebuilt[i].shape == t.shape
        assert torch.equal(flat_bytes(rebuilt[i]), flat_bytes(t)), specs[i].name


def test_split_tensors_with_a_destination_are_written_there_piece_by_piece() -> None:
    gen = torch.Generator().manual_seed(1)
    specs = random_specs(4)
    tensors = [_random_tensor(s, gen) for s in specs]
    plan = plan_buckets(specs, 1024)
    split = {seg.tensor for b in plan for seg in b.segments if seg.nbytes != specs[seg.tensor].nbytes}
    assert split, "the plan must split some tensor for this test"
    dests = [torch.zeros(s.nbytes, dtype=torch.uint8) if i in split or i % 2 else None for i, s in enumerate(specs)]
    packer, unpacker = Packer(tensors, plan), Unpacker(specs, torch.device("cpu"), dests)
    buf = torch.empty(1024, dtype=torch.uint8)
    handed: set[int] = set()
    for bucket in plan:
        packer.pack(bucket, buf)
        handed.update(i for i, _ in unpacker.tensors(bucket, buf))
    assert sorted(unpacker.direct_done) == sorted(split), "every split tensor lands in its destination"
    assert not handed & split and handed | split == set(range(len(specs)))
    assert not unpacker.incomplete
    for i in split:
        assert torch.equal(dests[i], flat_bytes(tensors[i])), specs[i].name
