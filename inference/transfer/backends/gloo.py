"""gloo: buckets through host memory over the session's gloo group. Runs with any device at either
end: CUDA tensors are packed into pinned host buckets on the sender and copied to the device from
them on a receiver.

The bytes go down a pipelined chain of small point-to-point messages, written in place where both
ends allow it (inference/transfer/backends/chain.py), for any number of receivers: gloo's host
broadcast is one-to-all, and one large message per bucket moves about half the bytes per second of a
stream of small ones. The steps around the bytes (agreement, status) are the broadcast backends'."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from inference.transfer.backends import chain
from inference.transfer.backends.base import Sink
from inference.transfer.backends.broadcast import BroadcastBackend
from inference.transfer.groups import TransferGroup
from inference.transfer.plan import Bucket, ParsedManifest, TensorSpec


class GlooBackend(BroadcastBackend):
    """The bytes go over the control group itself: no data plane, buckets on the host."""

    sizes = chain.ChainSizes()  # the chain's thresholds (an instance may take others: tests)

    def plan(self, specs: ParsedManifest) -> Sequence[Bucket]:
        return self.sizes.plan(specs, self.bucket_bytes)

    def plan_id(self) -> str:
        return f"{self.spec.name}/{self.sizes.plan_id()}"

    def send(self, group: TransferGroup, plan: Sequence[Bucket], tensors: list[torch.Tensor],
             agreed: Sequence[bool]) -> None:
        chain.send_chain(self, group, plan, tensors)
        self.finish_sending(group)

    def receive(self, group: TransferGroup, plan: Sequence[Bucket], specs: Sequence[TensorSpec], sink: Sink,
                agreed: Sequence[bool], values: Sequence[int]) -> None:
        self.last_mode = "chain"
        failure = chain.receive_chain(self, group, plan, specs, sink)
        self.finish_receiving(group, failure, sink)
