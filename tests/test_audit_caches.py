"""The audit's per-layout caches: a device launch over the same tensors reuses its table (no per-tensor
Python) yet hashes what is there now, a moved tensor misses and is hashed at its new address, no tensor is
kept alive; finish compares a plain digest list directly and still names the tensor and rank that differ."""

from __future__ import annotations

import gc
import os
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from checksum import ChecksumMismatch, DeviceDigester, device_digest, digest_bytes, flat_bytes
from checksum.definition import DEVICE_ALGORITHM
from inference.models.tiny import make_tiny_model
from inference.weights import audit
from tests.helpers_weight_update import DIMS, Q1, RANK, Link, make_worker, perturbed


@pytest.fixture
def kernel() -> Iterator[DeviceDigester]:
    pytest.importorskip("triton")
    if not device_digest.interpreting():
        pytest.skip("Triton was imported without TRITON_INTERPRET=1")
    with device_digest.kernel_on_cpu():
        yield DeviceDigester()


def host(tensors: list[torch.Tensor]) -> list[str]:
    return [digest_bytes(flat_bytes(t).numpy().tobytes(), DEVICE_ALGORITHM) for t in tensors]


def counted_sources(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = device_digest._sources

    def counting(tensors: Any, device: torch.device) -> Any:
        calls.append(len(tensors))
        return real(tensors, device)

    monkeypatch.setattr(device_digest, "_sources", counting)
    return calls


@pytest.mark.slow
def test_a_cached_launch_hashes_the_bytes_there_now(kernel: DeviceDigester, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = counted_sources(monkeypatch)
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(n, generator=gen) for n in (4, 16384 + 4, 1000)]
    assert kernel.digest(tensors) == host(tensors) and calls == [3]
    tensors[1][5] += 1.0  # same address, other bytes: the cached table, a fresh hash
    assert kernel.digest(tensors) == host(tensors) and calls == [3], "the second launch hit the cache"


@pytest.mark.slow
def test_a_moved_tensor_misses_and_is_hashed_at_its_new_address(kernel: DeviceDigester,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    calls = counted_sources(monkeypatch)
    gen = torch.Generator().manual_seed(1)
    tensors = [torch.randn(n, generator=gen) for n in (64, 20000, 8)]
    before = kernel.digest(tensors)
    old = tensors[1]
    tensors[1] = old.clone()  # what a wake-up reallocation does: same shape, new address
    tensors[1][0] = -tensors[1][0]
    assert tensors[1].data_ptr() != old.data_ptr()
    after = kernel.digest(tensors)
    assert calls == [3, 3], "a moved tensor's launch rebuilt its sources"
    assert after == host(tensors) and after[1] != before[1] and after[0::2] == before[0::2]


@pytest.mark.slow
def test_a_view_needing_a_scratch_copy_is_never_served_from_the_cache(kernel: DeviceDigester,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    calls = counted_sources(monkeypatch)
    base = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    tensors = [base.t(), base[:, 0]]  # same address, not contiguous: copied to scratch every launch
    assert kernel.digest(tensors) == host(tensors)
    base.add_(1)
    assert kernel.digest(tensors) == host(tensors) and calls == [2, 2]


@pytest.mark.slow
def test_the_cache_keeps_no_tensor_alive(kernel: DeviceDigester) -> None:
    tensor = torch.randn(100)
    ref = weakref.ref(tensor)
    kernel.digest([tensor])
    del tensor
    gc.collect()
    assert ref() is None


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {"target": make_tiny_model(tmp_path_factory.mktemp("cache") / "target", "qwen2", **DIMS)}


def test_plain_digests_are_compared_without_building_the_expected_manifest(
        dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    link = Link(make_worker(dirs, draft=False))  # host rule on the CPU
    worker = link.worker
    built: list[int] = []
    real = audit.expected_manifest

    def counting(*args: Any, **kwargs: Any) -> Any:
        built.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(audit, "expected_manifest", counting)
    for version in (1, 2):
        state = perturbed(dirs["target"], 20 + version)
        worker.weights.start("target", version, link.sender.manifest(state, version))
        link.transfer(state)
        plain = [digest_bytes(flat_bytes(state[name]).numpy().tobytes()) for name in state]
        result = worker.weights.finish({"digests": plain})
        assert result.report.ok and result.report.tensors_checked == len(state)
        assert {r.name: r.digest for r in result.received.records} == dict(zip(state, plain))
    assert built == [], "equal lists need no expected manifest"
    # After cached compares, one differing digest still fails naming the tensor and the rank.
    state = perturbed(dirs["target"], 30)
    worker.weights.start("target", 3, link.sender.manifest(state, 3))
    link.transfer(state)
    plain = [digest_bytes(flat_bytes(state[name]).numpy().tobytes()) for name in state]
    i = list(state).index(Q1)
    plain[i] = f"{int(plain[i], 16) ^ 1:032x}"
    with pytest.raises(ChecksumMismatch, match=f"'{Q1}' on rank {RANK}") as err:
        worker.weights.finish({"digests": plain})
    first = err.value.report.first_tensor
    assert (first.kind, first.tensor, first.rank) == ("digest", Q1, RANK) and built == [1]
    assert worker.weights.torn["target"] and worker.weights.versions["target"] == 2
