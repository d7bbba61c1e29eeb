"""Tensor digests: the definition (xxh3-128 of the contiguous bytes, per 64 MiB segment above 64 MiB),
and the many-tensor path giving the same answer whatever the layout, chunking, threads or staging (the
device path: tests/test_checksum_digest_cuda.py)."""

from __future__ import annotations

import contextlib
import queue
import random
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import xxhash

import checksum.staging_buffers
from checksum import Digester, TensorRecord, digest_bytes, digest_tensor, digest_tensors
from checksum.staging import Job, run_jobs
from tests.helpers_checksum import (
    DTYPES,
    MIB,
    SEGMENT,
    SMALL_SEGMENT,
    mixed_tensors,
    random_tensor,
    small_segments_rule,
    storage_bytes,
    xxh,
)


def test_float32_digest_is_xxh3_128_of_numpy_bytes() -> None:
    t = random_tensor((17, 33), torch.float32)
    assert digest_tensor(t) == xxh(t.numpy().tobytes())


def test_bfloat16_digest_is_xxh3_128_of_raw_bytes() -> None:
    t = random_tensor((5, 7, 3), torch.bfloat16)
    assert digest_tensor(t) == xxh(storage_bytes(t))
    # bf16 is the top half of the float32 with the same value: a third route to the same bytes.
    top_halves = (t.float().numpy().view(np.uint32) >> 16).astype("<u2").tobytes()
    assert digest_tensor(t) == xxh(top_halves)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_hashes_its_bytes(dtype: torch.dtype) -> None:
    t = random_tensor((3, 11), dtype, seed=1)
    [record] = digest_tensors({"w": t})
    assert record == TensorRecord("w", str(dtype).removeprefix("torch."), (3, 11), xxh(storage_bytes(t)))


@pytest.mark.parametrize("tensor", [torch.tensor(2.5, dtype=torch.bfloat16), torch.empty(0, 4)],
                         ids=["0-dim", "empty"])
def test_zero_dim_and_empty_tensors(tensor: torch.Tensor) -> None:
    [record] = digest_tensors([("t", tensor)])
    assert record.shape == tuple(tensor.shape)
    assert record.digest == xxh(storage_bytes(tensor))


def test_non_contiguous_views_hash_like_their_contiguous_copy() -> None:
    base = random_tensor((12, 20), torch.bfloat16)
    views = {
        "transposed": base.t(),
        "column_slice": base[:, 3:17],
        "strided": base[::3, ::2],
        "offset_rows": base[5:9],
        "expanded": base[0].expand(4, 20),
        "permuted": base.reshape(3, 4, 20).permute(2, 0, 1),
    }
    for name, record in zip(views, digest_tensors(views)):
        assert record.name == name
        assert record.digest == xxh(storage_bytes(views[name].contiguous())), name


def test_conjugate_view_hashes_its_visible_values() -> None:
    z = random_tensor((4, 4), torch.complex64)
    assert digest_tensor(z.conj()) == digest_tensor(z.conj().resolve_conj())
    assert digest_tensor(z.conj()) != digest_tensor(z)


@pytest.mark.parametrize("staging", ["device", "always"])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("chunk_bytes", [1, 100, 300, SMALL_SEGMENT, 4096])  # 300 does not divide a segment
def test_digests_do_not_depend_on_threads_chunks_or_staging(
    staging: str, threads: int, chunk_bytes: int
) -> None:
    tensors = mixed_tensors()
    assert tensors["big"].nbytes > 6 * SMALL_SEGMENT and tensors["strided"].nbytes > SMALL_SEGMENT
    expected = [TensorRecord(n, str(t.dtype).removeprefix("torch."), tuple(t.shape),
                             xxh(storage_bytes(t), SMALL_SEGMENT)) for n, t in tensors.items()]
    digester = Digester(threads, chunk_bytes=chunk_bytes, staging=staging,  # type: ignore[arg-type]
                        num_buffers=2 if chunk_bytes == 1 else None, max_queued_copies=2,
                        rules=[small_segments_rule()])
    assert digester.digest(tensors) == expected
    assert digester.digest(list(tensors.items())) == expected  # reused buffers, same answer
    digester.close()


def test_segments_are_hashed_in_order_and_each_byte_counts() -> None:
    digester = Digester(1, rules=[small_segments_rule()])

    def digest(t: torch.Tensor) -> str:
        return digester.digest({"t": t})[0].digest

    a = random_tensor((SMALL_SEGMENT,), torch.uint8, 20)
    b = random_tensor((SMALL_SEGMENT,), torch.uint8, 21)
    tail = random_tensor((7,), torch.uint8, 22)
    ab, ba = digest(torch.cat([a, b, tail])), digest(torch.cat([b, a, tail]))
    assert ab == xxh(a.numpy().tobytes() + b.numpy().tobytes() + tail.numpy().tobytes(), SMALL_SEGMENT)
    assert ab != ba
    for position in (0, SMALL_SEGMENT + 3, 2 * SMALL_SEGMENT + 6):  # first, middle, last segment
        flipped = torch.cat([a, b, tail])
        flipped[position] ^= 0x10
        assert digest(flipped) != ab, position


# -- the real 64 MiB segment, on CPU (shrinking it in the tests above could hide a wrong constant) --


@pytest.fixture(scope="module")
def random_bytes() -> torch.Tensor:
    """Two segments and three bytes of random uint8; tests take prefixes (contiguous views)."""
    return torch.randint(0, 256, (2 * SEGMENT + 3,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("nbytes", [SEGMENT - 1, SEGMENT, SEGMENT + 1, 65 * MIB, 2 * SEGMENT + 3],
                         ids=["below", "at", "above", "65MiB", "2seg+3"])
def test_real_segment_boundaries(random_bytes: torch.Tensor, nbytes: int) -> None:
    t = random_bytes[:nbytes]
    data = t.numpy().tobytes()
    got = digest_tensor(t)
    assert got == xxh(data)
    # One stream up to a segment, a hash of segment hashes above: the two rules really differ there.
    assert (got == xxhash.xxh3_128(data).hexdigest()) == (nbytes <= SEGMENT)
    assert digest_bytes(data) == got


@pytest.mark.parametrize(("staging", "threads", "chunk_bytes"),
                         [("device", 1, 16 * MIB), ("device", 3, 16 * MIB), ("always", 2, 16 * MIB),
                          ("always", 3, 24 * MIB), ("always", 2, 256 * MIB)])
def test_real_multi_segment_tensor_same_for_any_threads_or_chunks(
    random_bytes: torch.Tensor, staging: str, threads: int, chunk_bytes: int
) -> None:
    weight = random_bytes[: SEGMENT + 4 * MIB].view(torch.bfloat16).reshape(-1, 1024)  # 68 MiB
    tensors = {"weight": weight, "transposed": weight.t(), "bias": weight[0]}
    expected = [xxh(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()) for t in tensors.values()]
    with Digester(threads, chunk_bytes=chunk_bytes, num_buffers=4,
                  staging=staging) as digester:  # type: ignore[arg-type]
        assert digester.chunk_bytes == min(chunk_bytes, SEGMENT)  # a chunk never spans two segments
        assert [r.digest for r in digester.digest(tensors)] == expected


def test_one_flipped_byte_changes_the_digest() -> None:
    t = random_tensor((256, 64), torch.bfloat16)
    before = digest_tensor(t)
    t.view(torch.uint8).view(-1)[12345] ^= 0x01
    assert digest_tensor(t) != before


def test_same_bytes_other_dtype_or_shape_same_digest_different_record() -> None:
    """The digest covers bytes only; the record's dtype and shape are what tell these apart."""
    t = random_tensor((8, 6), torch.bfloat16)
    [a, b, c] = digest_tensors([("w", t), ("w", t.view(torch.int16)), ("w", t.reshape(6, 8))])
    assert a.digest == b.digest == c.digest
    assert (a.dtype, b.dtype) == ("bfloat16", "int16")
    assert (a.shape, c.shape) == ((8, 6), (6, 8))
    assert len({a, b, c}) == 3


def test_parameters_that_require_grad_are_digested() -> None:
    layer = torch.nn.Linear(5, 3)
    records = digest_tensors(layer.named_parameters())
    assert [r.name for r in records] == ["weight", "bias"]
    assert records[0].digest == xxh(layer.weight.detach().numpy().tobytes())


def test_bad_inputs_name_the_tensor() -> None:
    with pytest.raises(TypeError, match="'w'"):
        digest_tensors({"w": [1, 2, 3]})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="'sparse'"):
        digest_tensors({"sparse": torch.eye(3).to_sparse()})
    with pytest.raises(TypeError, match="'m'"):
        digest_tensors({"m": torch.empty(3, device="meta")})


def test_a_failing_copy_raises_and_the_digester_still_works(monkeypatch: pytest.MonkeyPatch) -> None:
    """An error in the staging pipeline surfaces in the caller (no hang), and the next run is clean."""
    tensors = mixed_tensors()
    digester = Digester(3, chunk_bytes=64, num_buffers=3, max_queued_copies=2, staging="always")
    real_copy = checksum.staging_buffers.HostStaging.copy
    calls = {"n": 0}

    def failing_copy(self: checksum.staging_buffers.HostStaging, buf: int, src: torch.Tensor) -> None:
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("simulated copy failure")
        real_copy(self, buf, src)

    monkeypatch.setattr(checksum.staging_buffers.HostStaging, "copy", failing_copy)
    with pytest.raises(RuntimeError, match="simulated copy failure"):
        digester.digest(tensors)
    monkeypatch.setattr(checksum.staging_buffers.HostStaging, "copy", real_copy)
    assert digester.digest(tensors) == Digester(1).digest(tensors)


def test_small_tensors_are_staged_in_packs_yet_digested_one_by_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hundreds of small tensors cost a few staged copies, and each keeps its own digest."""
    tensors = {f"t{i}": random_tensor((i % 7 + 1, 13), torch.float32, i) for i in range(60)}
    tensors["strided"] = random_tensor((40, 30), torch.float32, 99).t()
    tensors["large"] = random_tensor((3000,), torch.float32, 98)  # over half a chunk: staged on its own
    expected = [xxh(storage_bytes(t.contiguous())) for t in tensors.values()]
    copies: list[int] = []
    real_copy = checksum.staging_buffers.HostStaging.copy

    def counting_copy(self: checksum.staging_buffers.HostStaging, buf: int, src: torch.Tensor) -> None:
        copies.append(src.numel())
        real_copy(self, buf, src)

    monkeypatch.setattr(checksum.staging_buffers.HostStaging, "copy", counting_copy)
    with Digester(3, chunk_bytes=4096, staging="always") as digester:
        assert [r.digest for r in digester.digest(tensors)] == expected
    assert len(copies) <= 10 and sum(copies) == sum(t.numel() * 4 for t in tensors.values())
    assert [r.digest for r in Digester(2, chunk_bytes=4096).digest(tensors)] == expected  # packed in place


class AsyncHostStaging:
    """Like a CUDA copy stream: copies land later, in issue order, on another thread. A pipeline that
    read a buffer before its copy landed, or refilled it while it was being hashed, would hash wrong
    bytes here."""

    def __init__(self, chunk_bytes: int, num_buffers: int) -> None:
        self.num_buffers = num_buffers
        self._buffers = [torch.empty(chunk_bytes, dtype=torch.uint8) for _ in range(num_buffers)]
        self._landed = [threading.Event() for _ in range(num_buffers)]
        self._queue: queue.Queue[tuple[int, torch.Tensor] | None] = queue.Queue()
        self._rng = random.Random(0)
        self._open = False

    @contextlib.contextmanager
    def session(self, device: torch.device | None) -> Iterator[None]:
        engine = threading.Thread(target=self._engine)
        engine.start()
        self._open = True
        try:
            yield
        finally:
            self._queue.put(None)
            engine.join()
            self._open = False  # like CudaStaging: events and stream belong to the session

    def _engine(self) -> None:
        while (item := self._queue.get()) is not None:
            buf, src = item
            time.sleep(self._rng.random() * 1e-4)
            self._buffers[buf][: src.numel()].copy_(src)
            self._landed[buf].set()

    def copy(self, buf: int, src: torch.Tensor) -> None:
        assert self._open, "copy() outside the session"
        self._buffers[buf].fill_(0xAB)  # garbage until the copy lands
        self._landed[buf].clear()
        self._queue.put((buf, src))

    def wait(self, buf: int) -> None:
        time.sleep(self._rng.random() * 5e-4)  # a slow hasher: the copier may finish issuing first
        assert self._open, "wait() after the session ended"
        self._landed[buf].wait()

    def view(self, buf: int, nbytes: int) -> memoryview:
        assert self._open, "view() after the session ended"
        return memoryview(self._buffers[buf].numpy())[:nbytes]


@pytest.mark.parametrize(("threads", "chunk_bytes", "num_buffers", "max_queued"),
                         [(1, 64, 1, 1), (3, 100, 4, 2), (4, 997, 9, 6), (3, SMALL_SEGMENT, 5, 3)])
def test_pipeline_with_asynchronous_copies(threads: int, chunk_bytes: int, num_buffers: int,
                                           max_queued: int) -> None:
    tensors = [*mixed_tensors().items(), ("long", random_tensor((5000,), torch.int16, 11))]
    rule = small_segments_rule()
    expected = Digester(1, rules=[rule]).digest(tensors)
    assert expected != Digester(1).digest(tensors), "the small rule cuts the larger tensors otherwise"
    jobs = [Job(i, t, t.numel() * t.element_size(), staged=True)
            for i, (_, t) in enumerate(tensors) if t.numel()]
    with ThreadPoolExecutor(threads) as pool:
        run_jobs(jobs, (AsyncHostStaging(chunk_bytes, num_buffers), None), pool, threads, chunk_bytes, max_queued,
                 rule)
    assert {j.index: j.digest for j in jobs} == {i: r.digest for i, r in enumerate(expected) if tensors[i][1].numel()}


def test_digester_rejects_bad_settings() -> None:
    for kwargs in ({"threads": 0}, {"chunk_bytes": 0}, {"num_buffers": 0}, {"staging": "sometimes"}):
        with pytest.raises(ValueError):
            Digester(**kwargs)  # type: ignore[arg-type]
