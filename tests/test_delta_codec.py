"""The delta codec on its edge cases: no change, every element changed, changes at the first and last
element and across the host compare's chunk and group boundaries of a tensor whose size is a multiple of
neither, NaN patterns and signed zeros compared as bits, several dtypes; the device path (torch, run here
on the CPU) gives the same bytes as the host path (numpy); an apply into a slice (a TP shard) writes
exactly the slice of the full result; a bad index is refused before anything is written."""

from __future__ import annotations

import pytest
import torch

from inference.transfer import delta_codec as codec
from inference.transfer.delta_codec import (
    DENSE,
    INDEX,
    RUNS,
    UNCHANGED,
    DeltaError,
    DeltaLayout,
    Encoded,
    Slice,
    apply_delta,
    bits,
    encode,
    encode_all,
    write_payload,
)
from inference.transfer.plan import TensorSpec

N = 2 * codec._CHUNK + 13  # neither a multiple of the chunk nor of the 8-byte groups
DTYPES = [torch.bfloat16, torch.float32, torch.float8_e4m3fn]


def _tensor(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _bump(t: torch.Tensor, positions: list[int] | torch.Tensor) -> torch.Tensor:
    """A copy with the elements at `positions` changed (their lowest bit flipped)."""
    out = t.clone()
    flat = bits(out)
    idx = torch.as_tensor(positions, dtype=torch.int64)
    flat[idx] = flat[idx] ^ 1
    return out


def _payload(spec: TensorSpec, enc: Encoded, new: torch.Tensor) -> tuple[DeltaLayout, torch.Tensor]:
    layout = DeltaLayout.from_codes([spec], [enc.enc, enc.a, enc.b])
    payload = torch.zeros(layout.total, dtype=torch.uint8)
    if layout.entries[0].nbytes:
        write_payload(spec, enc, bits(new), payload[:layout.entries[0].nbytes])
    return layout, payload


def _round_trip(old: torch.Tensor, new: torch.Tensor) -> Encoded:
    """Encode `new` against `old`, apply the payload onto a copy of `old`: it must equal `new` bit for bit."""
    spec = TensorSpec.of("w", new)
    enc = encode(spec, bits(new), bits(old))
    layout, payload = _payload(spec, enc, new)
    held = old.clone()
    apply_delta([held], [spec], layout, payload)
    assert torch.equal(bits(held), bits(new))
    return enc


@pytest.mark.parametrize("dtype", DTYPES)
def test_no_change_moves_no_bytes_and_every_change_moves_the_tensor(dtype: torch.dtype) -> None:
    old = _tensor(N, dtype)
    enc = _round_trip(old, old.clone())
    assert enc.enc == UNCHANGED and enc.sizes["changed"] == 0
    assert DeltaLayout.from_codes([TensorSpec.of("w", old)], [enc.enc, enc.a, enc.b]).entries[0].nbytes == 0
    enc = _round_trip(old, _bump(old, torch.arange(N)))
    assert enc.enc == DENSE and enc.sizes["changed"] == N


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("positions", [[0], [N - 1], [0, N - 1], [codec._CHUNK - 1, codec._CHUNK],
                                       [7, 8, 15, 16], [N - 13, N - 5, N - 2]])
def test_changes_at_the_edges_of_the_tensor_chunks_and_groups_are_found(dtype: torch.dtype,
                                                                          positions: list[int]) -> None:
    old = _tensor(N, dtype)
    enc = _round_trip(old, _bump(old, positions))
    assert enc.sizes["changed"] == len(positions)
    if enc.enc == INDEX:
        assert torch.as_tensor(enc.idx).tolist() == positions


def test_nan_patterns_and_signed_zeros_are_compared_as_bits() -> None:
    old = torch.zeros(64, dtype=torch.bfloat16)
    flat = bits(old)
    flat[3] = 0x7FC0  # a quiet NaN
    flat[9] = 0x7FC1  # another NaN pattern, unchanged below
    new = old.clone()
    bits(new)[3] = 0x7FC1  # NaN -> another NaN: changed, though both are NaN
    bits(new)[5] = -0x8000  # +0.0 -> -0.0: changed, though they compare equal as floats
    enc = _round_trip(old, new)
    assert enc.enc == INDEX and torch.as_tensor(enc.idx).tolist() == [3, 5]


def _device_round_trip(spec: TensorSpec, old: torch.Tensor, new: torch.Tensor,
                       sl: Slice | None = None) -> tuple[Encoded, torch.Tensor, torch.Tensor]:
    """The device path (torch) run on this CPU: (encoding, payload, `old` (or its slice) with the delta applied)."""
    (enc,) = codec._encode_device([spec], [bits(new)], [bits(old)], False)
    layout = DeltaLayout.from_codes([spec], [enc.enc, enc.a, enc.b])
    payload = torch.zeros(layout.total, dtype=torch.uint8)
    nbytes = layout.entries[0].nbytes
    held = old.clone() if sl is None else old.narrow(sl.dim, sl.start, sl.length).contiguous()
    if nbytes:
        codec._write_device(spec, enc, bits(new), payload[:nbytes])
        parts = [(0, bits(held), payload[:nbytes], sl)]
        codec._check_device([spec], layout, parts)
        codec._apply_device([spec], layout, parts)
    return enc, payload, held


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pattern", ["none", "edges", "scattered", "blocks", "all"])
def test_the_device_path_gives_the_host_paths_bytes(dtype: torch.dtype, pattern: str) -> None:
    old = _tensor(N, dtype, seed=1)
    gen = torch.Generator().manual_seed(2)
    positions = {"none": [], "edges": [0, 1, N - 1], "scattered": torch.randperm(N, generator=gen)[:N // 40].sort()[0],
                 "blocks": torch.cat([torch.arange(100, 900), torch.arange(N - 40, N - 3)]),
                 "all": torch.arange(N)}[pattern]
    new = _bump(old, positions)
    spec = TensorSpec.of("w", new)
    host = encode(spec, bits(new), bits(old))
    _, payload = _payload(spec, host, new)
    enc, device_payload, held = _device_round_trip(spec, old, new)
    assert (enc.enc, enc.a, enc.b) == (host.enc, host.a, host.b) and enc.sizes == host.sizes
    assert torch.equal(device_payload, payload)
    assert torch.equal(bits(held), bits(new))
    if pattern == "blocks":
        assert host.enc == RUNS


@pytest.mark.parametrize("shape, sl", [((12, 40), Slice(0, 6, 6)), ((12, 40), Slice(1, 20, 20)),
                                       ((12, 40), Slice(0, 0, 0)), ((4, 6, 10), Slice(2, 5, 5)),
                                       ((4, 6, 10), Slice(1, 0, 3))])
@pytest.mark.parametrize("pattern", ["scattered", "all"])
def test_a_delta_applied_into_a_slice_writes_the_slice_of_the_new_tensor(shape: tuple[int, ...], sl: Slice,
                                                                        pattern: str) -> None:
    old = _tensor(int(torch.tensor(shape).prod()), torch.bfloat16, seed=3).view(shape)
    changed = torch.arange(old.numel()) if pattern == "all" else torch.arange(0, old.numel(), 7)
    new = _bump(old.reshape(-1), changed).view(shape)
    spec = TensorSpec.of("w", new)
    enc = encode(spec, bits(new), bits(old))
    layout, payload = _payload(spec, enc, new)
    held = old.narrow(sl.dim, sl.start, sl.length).contiguous()
    apply_delta([held], [spec], layout, payload, [sl])
    want = new.narrow(sl.dim, sl.start, sl.length)
    assert torch.equal(bits(held), bits(want.contiguous()))
    _, _, device_held = _device_round_trip(spec, old, new, sl)
    assert torch.equal(bits(device_held), bits(want.contiguous()))


@pytest.mark.parametrize("device_path", [False, True])
def test_an_encode_that_updates_leaves_the_old_tensor_equal_to_the_new(device_path: bool) -> None:
    old = _tensor(N, torch.bfloat16)
    new = _bump(old, torch.arange(3, N, 29))
    spec = TensorSpec.of("w", new)
    kept = bits(old.clone())
    if device_path:
        codec._encode_device([spec], [bits(new)], [kept], True)
    else:
        encode_all([spec], [bits(new)], [kept], update=True)
    assert torch.equal(kept, bits(new))


def test_a_bad_index_is_refused_naming_the_tensor_before_anything_is_written() -> None:
    specs = [TensorSpec("model.a", "bfloat16", (16,)), TensorSpec("model.b", "bfloat16", (16,))]
    layout = DeltaLayout.from_codes(specs, [INDEX, 1, 0, RUNS, 1, 4])
    payload = torch.zeros(layout.total, dtype=torch.uint8)
    a, b = layout.entries
    payload[a.offset:a.offset + 4].view(torch.int32)[0] = 2  # a's one index: fine
    payload[b.offset:b.offset + 8].view(torch.int32)[:] = torch.tensor([14, 4], dtype=torch.int32)  # 14 + 4 > 16
    regions = [torch.zeros(16, dtype=torch.bfloat16), torch.zeros(16, dtype=torch.bfloat16)]
    payload[a.offset + 8:a.offset + 10] = 0x3F  # a's value: nonzero, so a write would show
    with pytest.raises(DeltaError, match=r"model\.b: a run"):
        apply_delta(regions, specs, layout, payload)
    assert not regions[0].any(), "model.a was written before model.b's bad run was found"
    with pytest.raises(DeltaError, match=r"model\.b: a run"):
        codec._check_device(specs, layout, [(i, bits(r), payload[e.offset:e.offset + e.nbytes], None)
                                            for i, (r, e) in enumerate(zip(regions, layout.entries))])
