"""gloo: buckets through host memory over the session's gloo group. Runs with any device at either
end: CUDA tensors are packed into pinned host buckets on the sender and copied to the device from
them on a receiver.

With one receiver a bucket is one broadcast (inference/transfer/backends/broadcast.py). With two or
more it goes down a pipelined chain of point-to-point sends (inference/transfer/backends/chain.py):
gloo's host broadcast is one-to-all, so there the sender's single stream would carry every byte once
per receiver. The steps around the bytes (agreement, status) are the same either way."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from inference.transfer.backends import chain
from inference.transfer.backends.base import Sink
from inference.transfer.backends.broadcast import BroadcastBackend
from inference.transfer.groups import TransferGroup
from inference.transfer.plan import Bucket, TensorSpec


class GlooBackend(BroadcastBackend):
    """The bytes go over the control group itself: no data plane, buckets on the host."""

    def send(self, group: TransferGroup, plan: Sequence[Bucket], tensors: list[torch.Tensor],
             agreed: Sequence[bool]) -> None:
        if not chain.chained(group):
            super().send(group, plan, tensors, agreed)
            return
        chain.send_chain(self, group, plan, tensors)
        self.finish_sending(group)

    def receive(self, group: TransferGroup, plan: Sequence[Bucket], specs: Sequence[TensorSpec], sink: Sink,
                agreed: Sequence[bool], values: Sequence[int]) -> None:
        if not chain.chained(group):
            super().receive(group, plan, specs, sink, agreed, values)
            return
        self.last_mode = "chain"
        failure = chain.receive_chain(self, group, plan, specs, sink)
        self.finish_receiving(group, failure, sink)
