"""Packing tensors into bucket buffers and rebuilding whole tensors from them, following a plan.

Both ends walk the same `plan_buckets` output. The packer copies each segment's bytes into the
bucket buffer; the unpacker hands back, per bucket, the tensors completed by it: a zero-copy view
into the buffer when a tensor is whole in one bucket, else the tensor assembled in a staging buffer
from its pieces (so a fused or split tensor is never loaded half-written). Views are valid only
until the buffer is reused: the consumer must load and digest them before that.

A split tensor whose final home is known (`destinations`: a flat byte view of the region the tensor's
loader would write, on any device) skips the staging buffer: each piece is copied straight to its
place there (a blocking copy, so the buffer may be reused after `tensors` returns), and the tensor is
reported in `direct_done` once its last byte landed. Pieces that arrived in that region by other
means (received into it) are counted with `landed_in_place`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from checksum import flat_bytes
from inference.transfer.plan import Bucket, TensorSpec


def as_tensor(flat: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """View the 1-D uint8 `flat` (exactly spec.nbytes, suitably aligned) as the spec's tensor."""
    assert flat.dtype == torch.uint8 and flat.numel() == spec.nbytes, (spec, flat.numel())
    return flat.view(spec.torch_dtype).view(spec.shape)


class Packer:
    """Copies one bucket's segments from the sender's tensors into a byte buffer.

    A tensor's flat byte view is made once and dropped after its last segment, so a
    non-contiguous tensor split over several buckets is made contiguous once, not per piece.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], plan: Sequence[Bucket]) -> None:
        self._tensors = tensors
        self._last_use = {seg.tensor: b.index for b in plan for seg in b.segments}
        self._flats: dict[int, torch.Tensor] = {}

    def pack(self, bucket: Bucket, buf: torch.Tensor, non_blocking: bool = False) -> None:
        """Issue the copies (on the current stream); `buf` is at least bucket.nbytes long."""
        assert buf.dtype == torch.uint8 and buf.numel() >= bucket.nbytes
        for seg in bucket.segments:
            flat = self._flats.get(seg.tensor)
            if flat is None:
                flat = flat_bytes(self._tensors[seg.tensor])
                self._flats[seg.tensor] = flat
            dst = buf[seg.dst_offset:seg.dst_offset + seg.nbytes]
            dst.copy_(flat[seg.src_offset:seg.src_offset + seg.nbytes], non_blocking=non_blocking)
            if self._last_use[seg.tensor] == bucket.index:
                del self._flats[seg.tensor]


class Unpacker:
    """Turns received buckets back into whole tensors (see the module docstring)."""

    def __init__(self, specs: Sequence[TensorSpec], device: torch.device,
                 destinations: Sequence[torch.Tensor | None] | None = None) -> None:
        self._specs = specs
        self._device = device
        self._destinations = destinations
        self._staging: dict[int, tuple[torch.Tensor, int]] = {}  # tensor index -> (bytes, bytes received)
        self._in_place: dict[int, int] = {}  # tensor index -> bytes landed in its destination so far
        self.direct_done: list[int] = []  # split tensors completed in their destinations (see module doc)

    def tensors(self, bucket: Bucket, buf: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """(tensor index, tensor) for every tensor this bucket completes, in plan order (split tensors
        with a destination excepted: they are written there and listed in `direct_done`)."""
        done: list[tuple[int, torch.Tensor]] = []
        for seg in bucket.segments:
            spec = self._specs[seg.tensor]
            piece = buf[seg.dst_offset:seg.dst_offset + seg.nbytes]
            if seg.nbytes == spec.nbytes:
                assert seg.src_offset == 0 and seg.tensor not in self._staging
                done.append((seg.tensor, as_tensor(piece, spec)))
                continue
            dst = self._destinations[seg.tensor] if self._destinations is not None else None
            if dst is not None:
                dst[seg.src_offset:seg.src_offset + seg.nbytes].copy_(piece)
                self.landed_in_place(seg.tensor, seg.nbytes)
                continue
            staged, got = self._staging.get(seg.tensor) or (
                torch.empty(spec.nbytes, dtype=torch.uint8, device=self._device), 0)
            staged[seg.src_offset:seg.src_offset + seg.nbytes].copy_(piece)
            got += seg.nbytes
            assert got <= spec.nbytes, (spec.name, got)
            if got == spec.nbytes:
                del self._staging[seg.tensor]
                done.append((seg.tensor, as_tensor(staged, spec)))
            else:
                self._staging[seg.tensor] = (staged, got)
        return done

    def landed_in_place(self, index: int, nbytes: int) -> None:
        """Count `nbytes` more of tensor `index` as written in its destination."""
        got = self._in_place.get(index, 0) + nbytes
        assert got <= self._specs[index].nbytes, (self._specs[index].name, got)
        if got == self._specs[index].nbytes:
            self._in_place.pop(index, None)
            self.direct_done.append(index)
        else:
            self._in_place[index] = got

    @property
    def incomplete(self) -> list[str]:
        """Names of tensors that have received some but not all of their bytes."""
        return [self._specs[i].name for i in (*self._staging, *self._in_place)]
