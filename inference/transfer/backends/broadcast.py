"""Bucket broadcasts, the way gloo and nccl move bytes (their files say where the buckets live).

Both ends double-buffer: the sender packs bucket k+1 while bucket k is on the wire (on CUDA packing
runs on a stream of its own, and a device data plane orders each broadcast after its pack); a
receiver has bucket k+1 in flight while it unpacks bucket k. A receiver whose unpack fails keeps
receiving (and discarding) to the end, so the others are not left hanging, then reports the
failure at the status step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from inference.transfer.backends.base import Sink, TransferBackend
from inference.transfer.buckets import Packer, Unpacker
from inference.transfer.groups import TransferError, TransferGroup
from inference.transfer.plan import Bucket, TensorSpec


class BroadcastBackend(TransferBackend):
    """Buckets broadcast from rank 0 into two alternating buffers at every end."""

    def bucket_device(self) -> torch.device:
        """Where bucket buffers live at both ends (the host here)."""
        return torch.device("cpu")

    def send(self, group: TransferGroup, plan: Sequence[Bucket], tensors: list[torch.Tensor],
             agreed: Sequence[bool]) -> None:
        on_gpu = self.bucket_device().type == "cuda"
        device = self.device if on_gpu else torch.device("cpu")
        pin = device.type == "cpu" and torch.cuda.is_available()
        bufs = self.double_buffer(max((b.nbytes for b in plan), default=0), device, pin)
        packer = Packer(tensors, plan)
        stream = self.pack_stream() if on_gpu or any(t.is_cuda for t in tensors) else None
        works: list[Any] = [None, None]
        for k, bucket in enumerate(plan):
            slot = k % 2
            if works[slot] is not None:
                group.wait(works[slot], f"bucket {k - 2} of {len(plan)}")  # its buffer is free again
            buf = bufs[slot][:bucket.nbytes]
            if stream is None:
                packer.pack(bucket, buf)
                works[slot] = group.broadcast(buf)
                continue
            with torch.cuda.stream(stream):
                packer.pack(bucket, buf, non_blocking=True)
                if not on_gpu:
                    stream.synchronize()  # gloo reads the host buffer from its own threads
                works[slot] = group.broadcast(buf)  # a device data plane orders it after the pack
        for k, work in enumerate(works):
            if work is not None:
                group.wait(work, f"final bucket (slot {k})")
        self.finish_sending(group)

    @staticmethod
    def finish_sending(group: TransferGroup) -> None:
        """The sender's status step; TransferError if any receiver failed."""
        if group.all_max([0], "end-of-sync status")[0]:
            raise TransferError("a receiver failed to unpack the update (see the sidecar's error for the "
                                "rank and tensor); the model there is marked torn")

    def receive(self, group: TransferGroup, plan: Sequence[Bucket], specs: Sequence[TensorSpec], sink: Sink,
                agreed: Sequence[bool], values: Sequence[int]) -> None:
        self.last_mode = "broadcast"
        buffer_device = self.bucket_device()
        pin = buffer_device.type == "cpu" and self.device.type == "cuda"
        bufs = self.double_buffer(max((b.nbytes for b in plan), default=0), buffer_device, pin)
        unpacker = Unpacker(specs, buffer_device)
        failure: BaseException | None = None
        works: dict[int, Any] = {}
        if plan:
            works[0] = group.broadcast(bufs[0][:plan[0].nbytes])
        for k, bucket in enumerate(plan):
            group.wait(works.pop(k), f"bucket {k} of {len(plan)}")
            if k + 1 < len(plan):  # its buffer held bucket k-1, unpacked already (same stream on CUDA)
                works[k + 1] = group.broadcast(bufs[(k + 1) % 2][:plan[k + 1].nbytes])
            if failure is None:
                try:
                    sink.put(unpacker.tensors(bucket, bufs[k % 2]))
                except Exception as e:  # keep draining so the sender and other ranks are not left hanging
                    failure = e
        if failure is None and unpacker.incomplete:
            failure = RuntimeError(f"{self.label}: tensors left incomplete: {unpacker.incomplete[:3]}")
        self.finish_receiving(group, failure, sink)
