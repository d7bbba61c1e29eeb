"""The device digest ("xxh3_64_seg64k"): its definition, the kernel (Triton's interpreter on CPU, compiled on
a GPU) and its eager twin equal python-xxhash, and manifests and audits name their algorithm.

Without a GPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported)
on CPU tensors; each launch costs a second or two there, so each test makes one or two launches over many
tensors. With a GPU the same tests run compiled on CUDA tensors, and the `cuda` tests add larger sizes.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch
import xxhash

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from checksum import (
    ALGORITHM,
    DEVICE_ALGORITHM,
    DeviceDigester,
    Digester,
    KernelConfig,
    Manifest,
    ManifestError,
    compare,
    definition,
    device_digest,
    device_kernels,
    digest_bytes,
    manifest_from_tensors,
    pick_algorithm,
)
from tests.helpers_checksum import DTYPES, SEG64K, random_tensor, storage_bytes, xxh, xxh64k

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SIZES = [0, 1, 5, 8, 15, 16, 63, 64, 1000, 1023, 1024, 1025, SEG64K - 1, SEG64K, SEG64K + 1, 2 * SEG64K + 40]
EMPTY_DIGEST = "2c0a8a99dc147d5445c3b49d035665b2"  # xxh3_128 of eight zero bytes: the rule pinned


@pytest.fixture
def kernel() -> Iterator[DeviceDigester]:
    """A DeviceDigester whose kernel runs on DEVICE (CPU tensors through Triton's interpreter)."""
    pytest.importorskip("triton")
    with device_digest.kernel_on_cpu(DEVICE == "cpu"):
        assert device_digest.can_hash_on(torch.device(DEVICE))
        yield DeviceDigester()


def random_bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def host_bytes(t: torch.Tensor) -> bytes:
    """The bytes a user sees (conjugate views resolved), read independently of the library."""
    return storage_bytes(t.cpu().resolve_conj().resolve_neg())


# ---- the definition, on the host -------------------------------------------------------------------------


def test_host_rule_equals_the_rule_written_out() -> None:
    for n in [*SIZES, 3 * SEG64K + 17]:
        data = random_bytes(n, n).numpy().tobytes()
        assert digest_bytes(data, DEVICE_ALGORITHM) == xxh64k(data), n
    assert digest_bytes(b"", DEVICE_ALGORITHM) == EMPTY_DIGEST
    # Zero padding never hides a length: trailing zeros change the digest.
    assert len({digest_bytes(bytes(n), DEVICE_ALGORITHM) for n in (0, 1, 2, SEG64K, SEG64K + 1)}) == 5


def test_segment_stream_ignores_chunking() -> None:
    """The host pipeline may feed a segment in any chunks; work items (shrunk here) never split one."""
    data = random_bytes(5 * SEG64K + 333, 1).numpy().tobytes()
    rule = definition.Segments64K(item_bytes=2 * SEG64K)
    rng = random.Random(0)
    items = []
    for start, end in rule.work_spans(len(data)):
        hasher, at = rule.hasher(), start
        while at < end:
            step = min(end - at, rng.choice([1, 7, 4096, SEG64K - 3, 3 * SEG64K]))
            hasher.update(data[at : at + step])
            at += step
        items.append(hasher.digest())
    assert len(items) == 3 and rule.combine(items, len(data)) == xxh64k(data)


@pytest.mark.slow
def test_host_pipeline_with_staging_and_small_items() -> None:
    """CPU tensors hashed in place, and streamed through host buffers in odd chunks, give the rule."""
    small_items = [definition.Segments64K(item_bytes=2 * SEG64K)]
    tensors = {f"t{n}": random_bytes(n, n) for n in [*SIZES, 5 * SEG64K + 7]}
    tensors["strided"] = random_tensor((300, 90), torch.float32, 3)[::2, 1::3]
    expected = [xxh64k(host_bytes(t)) for t in tensors.values()]
    for digester in (Digester(2, rules=small_items),
                     Digester(3, chunk_bytes=5000, staging="always", rules=small_items)):
        with digester:
            assert [r.digest for r in digester.digest(tensors, algorithm=DEVICE_ALGORITHM)] == expected


def test_unknown_algorithm_is_refused() -> None:
    with pytest.raises(ValueError, match=r"unknown checksum algorithm 'xxh3_64k'.*xxh3_64_seg64k"):
        Digester(1).digest({"t": torch.zeros(3)}, algorithm="xxh3_64k")


# ---- the eager twin and the kernel -----------------------------------------------------------------------


def test_twin_equals_xxhash() -> None:
    segments = torch.stack([random_bytes(SEG64K, 5), torch.zeros(SEG64K, dtype=torch.uint8),
                            torch.full((SEG64K,), 255, dtype=torch.uint8), random_bytes(SEG64K, 6)])
    segments[3, 40000:] = 0  # a padded tail
    got = device_kernels.segment_digests_torch(segments.view(torch.int64)).numpy().tobytes()
    assert got == b"".join(xxhash.xxh3_64_digest(s.numpy().tobytes()) for s in segments)


@pytest.mark.slow
def test_kernel_segments_equal_twin_and_xxhash(kernel: DeviceDigester) -> None:
    """Raw per-segment output: whole segments, a partial one (masked loads read zeros), and sources at
    negative and positive offsets from the base pointer."""
    data = [random_bytes(SEG64K, 7), random_bytes(3 * SEG64K, 8), random_bytes(4000, 9)]
    data = [d.to(DEVICE) for d in data]
    pending = kernel.launch(data)
    raw = pending.segment_bytes()
    padded = torch.cat([d.cpu() for d in data] + [torch.zeros(SEG64K - 4000, dtype=torch.uint8)])
    expected = b"".join(xxhash.xxh3_64_digest(padded[i : i + SEG64K].numpy().tobytes())
                        for i in range(0, padded.numel(), SEG64K))
    assert raw == expected
    assert device_kernels.segment_digests_torch(padded.view(torch.int64).view(-1, 8192)).numpy().tobytes() == raw
    assert pending.result() == [xxh64k(host_bytes(d)) for d in data]


@pytest.mark.slow
def test_kernel_on_odd_sizes_misaligned_and_strided_views(kernel: DeviceDigester) -> None:
    """One launch: every size class, slices off 16-byte alignment (copied to scratch), an aligned
    slice (read in place from its storage offset), transposed, strided, expanded and conjugate views."""
    tensors = [random_bytes(n, n).to(DEVICE) for n in SIZES]
    buf = random_bytes(3 * SEG64K, 11).to(DEVICE)
    tensors += [buf[1 : 1 + SEG64K], buf[8 : 8 + 1000], buf[16 : 16 + SEG64K + 32], buf[: 2 * SEG64K].view(torch.int64)]
    base = random_tensor((130, 70), torch.float32, 12).to(DEVICE)
    z = random_tensor((6, 5), torch.complex64, 13).to(DEVICE)
    tensors += [base.t(), base[::3, 1::2], base[0].expand(4, 70), z.conj(), bytes_zeros(100), bytes_zeros(101)]
    got = kernel.digest(tensors)
    assert got == [xxh64k(host_bytes(t)) for t in tensors]
    assert got[SIZES.index(0)] == EMPTY_DIGEST
    assert got[-1] != got[-2]  # 100 and 101 zero bytes: the length is hashed


def bytes_zeros(n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.uint8, device=DEVICE)


@pytest.mark.slow
def test_every_dtype_in_one_launch(kernel: DeviceDigester, monkeypatch: pytest.MonkeyPatch) -> None:
    launches = []
    real_launch = device_kernels.launch
    monkeypatch.setattr(device_kernels, "launch", lambda *a, **k: launches.append(a) or real_launch(*a, **k))
    tensors = {f"{dtype}".removeprefix("torch."): random_tensor((3, 37), dtype, seed=i).to(DEVICE)
               for i, dtype in enumerate(DTYPES)}
    tensors["scalar"] = torch.tensor(7, dtype=torch.int64, device=DEVICE)
    tensors["embedding"] = random_tensor((129, 260), torch.bfloat16, 99).to(DEVICE)  # 67,080 bytes: 2 segments
    with Digester(2) as digester:
        records = digester.digest(tensors, algorithm=DEVICE_ALGORITHM)
    assert len(launches) == 1, "one launch for every tensor of a device"
    for record, (name, t) in zip(records, tensors.items()):
        assert (record.name, record.dtype, record.shape) == (name, str(t.dtype).removeprefix("torch."), tuple(t.shape))
        assert record.digest == xxh64k(host_bytes(t)), name
    # The same records as the host path on CPU copies, and the default rule is untouched.
    cpu = {n: t.cpu() for n, t in tensors.items()}
    assert Digester(2).digest(cpu, algorithm=DEVICE_ALGORITHM) == records
    assert Digester(2).digest(cpu)[0].digest == xxh(host_bytes(cpu["bool"]))


@pytest.mark.slow
def test_flipped_byte_fails_the_audit_naming_the_tensor(kernel: DeviceDigester) -> None:
    tensors = {"a.weight": random_tensor((200, 180), torch.bfloat16, 1).to(DEVICE),  # 72,000 bytes
               "b.bias": random_tensor((180,), torch.bfloat16, 2).to(DEVICE)}
    with Digester(1) as digester:
        expected = manifest_from_tensors(tensors, model="target", weight_version=4, rank="dp0:pp0:tp1",
                                         digester=digester, algorithm=DEVICE_ALGORITHM)
        assert expected.algorithm == DEVICE_ALGORITHM
        tensors["a.weight"].view(torch.uint8).view(-1)[-1] ^= 1  # the last byte: in the partial segment
        actual = manifest_from_tensors(tensors, model="target", weight_version=4, rank="dp0:pp0:tp1",
                                       digester=digester, algorithm=DEVICE_ALGORITHM)
        assert digester._device is not None and digester._device.cached_layouts == 1  # same addresses
    report = compare(expected, actual)
    assert [(m.kind, m.tensor) for m in report.mismatches] == [("digest", "a.weight")]
    assert "'a.weight'" in report.summary() and "dp0:pp0:tp1" in report.summary()


def test_without_triton_cuda_and_cpu_tensors_hash_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device_digest, "_kernels", lambda: None)
    with device_digest.kernel_on_cpu():
        assert not device_digest.can_hash_on(torch.device("cpu"))
        assert not device_digest.can_hash_on(torch.device("cuda"))
        t = random_bytes(SEG64K + 9, 3)
        assert Digester(1).digest({"t": t}, algorithm=DEVICE_ALGORITHM)[0].digest == xxh64k(host_bytes(t))


def test_pick_algorithm_keeps_cpu_tensors_on_the_default() -> None:
    assert pick_algorithm([torch.zeros(4), torch.ones(2)]) == ALGORITHM
    assert pick_algorithm([]) == ALGORITHM


def test_kernel_config_is_validated() -> None:
    with pytest.raises(ValueError, match="power of 2"):
        KernelConfig(block_s=24)
    with pytest.raises(ValueError, match="num_warps"):
        KernelConfig(num_warps=3)


@pytest.mark.slow
def test_importing_checksum_does_not_import_triton() -> None:
    code = "import sys, checksum; assert 'triton' not in sys.modules, 'triton imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(os.path.dirname(__file__)))


# ---- manifests and comparisons name the algorithm ------------------------------------------------------


def manifest(algorithm: str, digest: str = "0" * 32) -> Manifest:
    from checksum import TensorRecord

    return Manifest("target", 1, "dp0:pp0:tp0", (TensorRecord("w", "bfloat16", (2, 3), digest),), algorithm)


def test_manifests_of_either_algorithm_round_trip() -> None:
    for algorithm in (ALGORITHM, DEVICE_ALGORITHM):
        m = manifest(algorithm)
        assert Manifest.from_json(m.to_json()) == m and f'"algorithm": "{algorithm}"' in m.to_json()
    with pytest.raises(ManifestError, match=r"unknown algorithm 'xxh3_64k'.*'xxh3_128_seg64m', 'xxh3_64_seg64k'"):
        Manifest.from_dict({**manifest(ALGORITHM).to_dict(), "algorithm": "xxh3_64k"})


def test_comparing_two_algorithms_is_one_clear_mismatch() -> None:
    expected, actual = manifest(ALGORITHM, "1" * 32), manifest(DEVICE_ALGORITHM, "2" * 32)
    report = compare(expected, actual)
    assert [(m.kind, m.expected, m.actual) for m in report.mismatches] == [("algorithm", ALGORITHM, DEVICE_ALGORITHM)]
    assert f"expected {ALGORITHM}, got {DEVICE_ALGORITHM}" in report.summary()
    assert "cannot be compared" in report.summary()


# ---- compiled, on a GPU --------------------------------------------------------------------------------


def numpy_bytes(t: torch.Tensor) -> bytes:
    return t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.cuda
def test_cuda_kernel_equals_host_rule_on_random_odd_sizes() -> None:
    rng = random.Random(0)
    sizes = [rng.randrange(1, 5 * SEG64K) for _ in range(40)] + [rng.randrange(1, 40 << 20) for _ in range(3)]
    tensors = [random_bytes(n, i).cuda() for i, n in enumerate(sizes)]
    tensors += [random_tensor((1001, 333), torch.bfloat16, 5).cuda().t(), random_bytes(10 << 20, 6).cuda()[3:]]
    tensors += [random_tensor((2048, 1536), dtype, 7).cuda() for dtype in DTYPES]  # 2-25 MB each
    expected = [digest_bytes(numpy_bytes(t), DEVICE_ALGORITHM) for t in tensors]
    assert expected[0] == xxh64k(numpy_bytes(tensors[0]))
    digester = DeviceDigester()
    for config in (KernelConfig(), KernelConfig(8, 1), KernelConfig(16, 2), KernelConfig(64, 8)):
        digester.config = config
        assert digester.digest(tensors) == expected, config
    with Digester(4) as host_and_device:  # the Digester routes CUDA tensors to the kernel
        named = {f"t{i}": t for i, t in enumerate(tensors)}
        assert [r.digest for r in host_and_device.digest(named, algorithm=DEVICE_ALGORITHM)] == expected


@pytest.mark.cuda
def test_cuda_kernel_equals_twin_on_many_segments() -> None:
    words = torch.randint(-(1 << 62), 1 << 62, (300, 8192), dtype=torch.int64, device="cuda")
    raw = DeviceDigester().launch([words]).segment_bytes()
    assert raw == device_kernels.segment_digests_torch(words).cpu().numpy().tobytes()


@pytest.mark.cuda
def test_cuda_digest_sees_writes_queued_on_the_current_stream() -> None:
    t = torch.zeros(1 << 22, device="cuda", dtype=torch.bfloat16)
    digester = DeviceDigester()
    before = digester.digest([t])
    t.add_(1)  # queued, not synchronized
    assert digester.digest([t]) != before
    assert pick_algorithm([t]) == DEVICE_ALGORITHM
