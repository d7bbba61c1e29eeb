"""Tensor digests on the GPU: the pinned-buffer streaming path must agree with the CPU definition."""

from __future__ import annotations

import pytest
import torch

from checksum import Digester, TensorRecord, digest_tensors
from tests.helpers_checksum import (
    MIB,
    SEGMENT,
    SMALL_SEGMENT,
    mixed_tensors,
    random_tensor,
    small_segments_rule,
    storage_bytes,
    xxh,
)


def cuda_mix(device: str) -> dict[str, torch.Tensor]:
    tensors = mixed_tensors(device)
    tensors["embedding"] = random_tensor((3000, 700), torch.bfloat16, 7).to(device)  # ~4 MB: many chunks
    tensors["transposed_big"] = random_tensor((700, 900), torch.float32, 8).to(device).t()
    tensors["fp8_e5m2_rows"] = random_tensor((123, 45), torch.float8_e5m2, 9).to(device)[1::2]
    return tensors


@pytest.mark.cuda
@pytest.mark.parametrize(("threads", "chunk_bytes", "num_buffers"),
                         [(1, 4096, 1), (4, 65536, 3), (16, 1 << 20, None), (8, None, None)])
def test_cuda_digests_equal_cpu_digests(
    threads: int, chunk_bytes: int | None, num_buffers: int | None
) -> None:
    expected = Digester(1).digest(cuda_mix("cpu"))
    gpu = cuda_mix("cuda")
    assert not gpu["transposed_big"].is_contiguous() and gpu["embedding"].nbytes > 4 * 65536
    kwargs = {"chunk_bytes": chunk_bytes} if chunk_bytes else {}
    with Digester(threads, num_buffers=num_buffers, **kwargs) as digester:
        for _ in range(2):  # the second run reuses the pinned buffers, streams and events
            assert digester.digest(gpu) == expected


@pytest.mark.cuda
def test_cuda_sees_writes_made_on_the_current_stream() -> None:
    """The copy stream waits for the caller's stream: a digest right after a kernel sees its result."""
    t = torch.zeros(1 << 22, device="cuda", dtype=torch.bfloat16)
    before = digest_tensors({"t": t})[0].digest
    t.add_(1)  # queued on the current stream, not synchronized
    after = digest_tensors({"t": t})[0].digest
    assert before != after
    assert after == Digester(1).digest({"t": t.cpu()})[0].digest


@pytest.mark.cuda
def test_cuda_and_cpu_tensors_in_one_call_keep_input_order() -> None:
    expected = Digester(1).digest(cuda_mix("cpu"))
    gpu = cuda_mix("cuda")
    mixed = {n: t if i % 2 else cuda_mix("cpu")[n] for i, (n, t) in enumerate(gpu.items())}
    assert digest_tensors(mixed) == expected


@pytest.mark.cuda
@pytest.mark.parametrize("chunk_bytes", [100, 300, SMALL_SEGMENT, 4096])
def test_cuda_segments_with_any_chunk_size(chunk_bytes: int) -> None:
    """Many segments per tensor on the device: chunks are cut per segment, whatever their size."""
    def tensors(device: str) -> dict[str, torch.Tensor]:
        out = mixed_tensors(device)
        out["rows"] = random_tensor((90, 70), torch.bfloat16, 15).to(device)[::2]  # strided, many segments
        return out

    cpu = tensors("cpu")
    expected = [TensorRecord(n, str(t.dtype).removeprefix("torch."), tuple(t.shape),
                             xxh(storage_bytes(t), SMALL_SEGMENT)) for n, t in cpu.items()]
    with Digester(4, chunk_bytes=chunk_bytes, num_buffers=5, rules=[small_segments_rule()]) as digester:
        assert digester.digest(tensors("cuda")) == expected


@pytest.mark.cuda
@pytest.mark.parametrize(("threads", "chunk_bytes"), [(1, 16 * MIB), (16, 16 * MIB), (8, 24 * MIB), (4, MIB)])
def test_cuda_real_segments_equal_the_documented_rule(threads: int, chunk_bytes: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(3)
    embedding = torch.empty(40000, 1792, dtype=torch.bfloat16, device="cuda").normal_(generator=g)  # 2+ segments
    tensors = {
        "embedding": embedding,
        "below": embedding.reshape(-1)[: SEGMENT // 2 - 1],
        "at": embedding.reshape(-1)[: SEGMENT // 2],
        "above": embedding.reshape(-1)[1 : SEGMENT // 2 + 2],  # odd offset: not aligned to a segment
        "transposed": embedding[:, :1000].t(),  # strided and bigger than a segment
    }
    assert embedding.nbytes > 2 * SEGMENT and tensors["transposed"].nbytes > SEGMENT
    expected = [xxh(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()) for t in tensors.values()]
    with Digester(threads, chunk_bytes=chunk_bytes) as digester:
        for _ in range(2):
            assert [r.digest for r in digester.digest(tensors)] == expected
