"""The audit's bulk fast paths (a sync of hundreds of tensors): the per-layout packed combine of segment
digests, and compare's one-pass check of equal manifests. Each must give exactly what the per-tensor
path gives, and still name the one tensor (and rank) that differs."""

from __future__ import annotations

import random

import pytest
import torch

from checksum import ChecksumMismatch, Manifest, TensorRecord, compare
from checksum.definition import combine_seg64k
from checksum.device_digest import PendingDigests, _packing

N_TENSORS = 290  # the Qwen2-0.5B layout


def records(n: int = N_TENSORS) -> list[TensorRecord]:
    rng = random.Random(0)
    return [TensorRecord(f"model.layers.{i}.w", "bfloat16", (8, i + 1), f"{rng.getrandbits(128):032x}")
            for i in range(n)]


def test_packed_combine_equals_per_tensor_combine() -> None:
    """Sources of 0, 1 and several segments (an empty one first and last), each with its own length."""
    nbytes = [0, 1, 3 * 65536, 65536, 65537, 0, 40000, 2 * 65536 + 16, 0]
    counts = [-(-n // 65536) for n in nbytes]
    firsts = [sum(counts[:i]) for i in range(len(counts))]
    segments = torch.randint(-(1 << 62), 1 << 62, (sum(counts),), dtype=torch.int64,
                             generator=torch.Generator().manual_seed(1))
    got = PendingDigests(segments, None, _packing(counts, firsts, nbytes), ()).result()
    raw = segments.numpy().tobytes()
    expected = [combine_seg64k([raw[8 * f : 8 * (f + c)]], n) for f, c, n in zip(firsts, counts, nbytes)]
    assert got == expected
    assert got[0] == got[5] == got[8] == "2c0a8a99dc147d5445c3b49d035665b2"  # the empty tensor's digest


def test_bulk_compare_of_equal_manifests_is_ok() -> None:
    report = compare(Manifest("target", 1, "dp0:pp0:tp0", tuple(records())),
                     Manifest("target", 1, "dp0:pp0:tp0", tuple(records())))
    assert report.ok and report.tensors_checked == N_TENSORS and report.ranks == ("dp0:pp0:tp0",)


@pytest.mark.parametrize("field", ["digest", "shape", "dtype"])
def test_bulk_compare_names_the_one_tensor_that_differs(field: str) -> None:
    expected, actual = records(), records()
    i = 217
    bad = {"digest": "0" * 32, "shape": (8, 9999), "dtype": "float16"}[field]
    r = actual[i]
    actual[i] = TensorRecord(r.name, *(bad if f == field else getattr(r, f) for f in ("dtype", "shape", "digest")))
    report = compare(Manifest("target", 1, "dp0:pp0:tp0", tuple(expected)),
                     Manifest("target", 1, "dp1:pp0:tp0", tuple(actual)))
    assert [(m.kind, m.tensor, m.rank) for m in report.mismatches] == [(field, r.name, "dp1:pp0:tp0")]
    with pytest.raises(ChecksumMismatch, match=rf"{field} of tensor '{r.name}' on rank dp1:pp0:tp0"):
        report.check()


def test_bulk_compare_with_a_missing_tensor_names_it() -> None:
    expected, actual = records(), records()
    gone = actual.pop(100)
    report = compare(Manifest("target", 1, "dp0:pp0:tp0", tuple(expected)),
                     Manifest("target", 1, "dp0:pp0:tp0", tuple(actual)))
    assert [(m.kind, m.tensor) for m in report.mismatches] == [("missing", gone.name)]
