"""The bucket plan both ends derive, and packing/unpacking along it (CPU, no processes)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from checksum import flat_bytes
from inference.core import InvalidRequestError
from inference.transfer import plan as plan_module
from inference.transfer.buckets import Packer, Unpacker
from inference.transfer.plan import (
    ALIGN,
    TensorSpec,
    dtype_from_name,
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
def test_every_byte_is_covered_exactly_once_within_bucket_limits(seed: int, bucket_bytes: int) -> None:
    specs = random_specs(seed)
    plan = plan_buckets(specs, bucket_bytes)
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
