"""ipc: the ranks read the trainer's GPU memory through CUDA IPC (handles: inference/transfer/ipc.py).

Step 1's all-reduce also compares the key of the sender's layout (handles, offsets) with the one
each receiver applied last, and carries the layout message's size. Equal keys on every rank: the
cached layout is used and nothing more is exchanged (two control round trips per sync in "direct"
mode). Otherwise the layout is broadcast over the control group and applied.
- "direct" (the trainer's tensors are contiguous CUDA tensors on the sender's device): every
  receiver copies straight from them into its parameters (`CopyPlan`, built once per layout), then
  the status step; the sender's send() returns after it, so its tensors are not rewritten while
  read.
- "packed": the sender fills two shared bucket buffers. Before bucket j the ranks all-reduce a
  status meaning "bucket j is packed" (sender) and "bucket j-1 is unpacked" (receivers), so packing
  j+1 overlaps unpacking j and a failure anywhere stops everyone at the same step.
`ipc_mode` (WeightSender's): "auto" takes direct when it can, "direct" refuses otherwise, "packed".
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from inference.core import InvalidRequestError
from inference.transfer.backends import BackendSpec
from inference.transfer.backends.base import Agreement, Sink, TransferBackend
from inference.transfer.buckets import Packer, Unpacker
from inference.transfer.groups import TransferError, TransferGroup
from inference.transfer.ipc import CopyPlan, IpcExporter, IpcImporter, LayoutOffer, layout_key
from inference.transfer.plan import Bucket, TensorSpec


class IpcBackend(TransferBackend):
    """The exporter is the sender's, the importer a receiver's (see the module docstring)."""

    agreement_size = (1, 1)  # the layout's key; its message's size

    def __init__(self, spec: BackendSpec, device: torch.device, label: str, bucket_bytes: int,
                 ipc_mode: str = "auto") -> None:
        super().__init__(spec, device, label, bucket_bytes, ipc_mode)
        self.exporter = IpcExporter()
        self.importer = IpcImporter()
        self._offer: LayoutOffer | None = None
        self._eligible_key: tuple[Sequence[TensorSpec], list[int]] | None = None  # the last direct check passed
        self._layout: tuple[int, dict[str, Any]] | None = None  # (key, layout) a receiver applied last
        self._direct: _DirectRouting | None = None
        self.direct_plans_built = 0  # tests check that an unchanged layout reuses its plan
        self.layouts_received = 0  # layout messages a receiver got (tests check the cached path with it)

    def close(self) -> None:
        self.importer.close()
        self._layout, self._direct = None, None
        super().close()

    # ---- the sender's end -------------------------------------------------------------------------
    def new_session(self) -> None:
        super().new_session()
        self.exporter = IpcExporter()  # receivers open every handle afresh

    def prepare_send(self, specs: Sequence[TensorSpec], tensors: list[torch.Tensor]) -> Agreement:
        """This sync's mode and layout, decided before the agreement (which carries its key)."""
        self._offer = None
        eligible = self._direct_eligible(specs, tensors)
        if self.ipc_mode == "direct" and not eligible:
            raise InvalidRequestError("ipc_mode", "direct needs contiguous, non-empty CUDA tensors on "
                                      f"{self.device}; use 'auto' to fall back to packing")
        if eligible and self.ipc_mode != "packed":
            self._offer = self.exporter.offer("direct", tensors)
        else:
            self._offer = self.exporter.offer("packed", [], self._shared_buckets())
        return [self._offer.key], [len(self._offer.payload)]

    def sends_by_waiting(self) -> bool:
        return self._offer is not None and self._offer.mode == "direct"

    def withdraw(self) -> None:
        self.exporter.rollback()  # its new handles never reached the receivers
        self._offer = None

    def send(self, group: TransferGroup, plan: Sequence[Bucket], tensors: list[torch.Tensor],
             agreed: Sequence[bool]) -> None:
        offer, self._offer = self._offer, None
        assert offer is not None, "prepare_send first"
        if not agreed[0]:  # some receiver does not hold this layout
            group.broadcast_bytes(offer.payload, len(offer.payload))
        self.exporter.commit()
        self.last_mode = offer.mode
        if offer.mode == "direct":
            failed = group.all_max([0], "end-of-sync status")[0]
        else:
            failed = self._send_packed(group, plan, tensors, self._shared_buckets())
        self.exporter.retire()
        if failed:
            raise TransferError("a receiver failed during the ipc transfer (see the sidecar's error for the "
                                "rank and tensor); the model there is marked torn")

    def _shared_buckets(self) -> list[torch.Tensor]:
        return self.double_buffer(self.bucket_bytes, self.device, pin=False)

    def _direct_eligible(self, specs: Sequence[TensorSpec], tensors: list[torch.Tensor]) -> bool:
        """Contiguous, non-empty CUDA tensors on our device. Same manifest and same addresses as the
        last passing check: the device and sizes are those checked then, only contiguity may differ."""
        ptrs = [t.data_ptr() for t in tensors]
        if self._eligible_key is not None and self._eligible_key[0] is specs and self._eligible_key[1] == ptrs:
            return all(t.is_contiguous() for t in tensors)
        device = self.device
        eligible = all(t.is_cuda and t.device == device and t.is_contiguous() and t.numel() for t in tensors)
        self._eligible_key = (specs, ptrs) if eligible else None
        return eligible

    def _send_packed(self, group: TransferGroup, plan: Sequence[Bucket], tensors: list[torch.Tensor],
                     bufs: list[torch.Tensor]) -> int:
        """Step j: bucket j is packed (ours) and bucket j-1 is unpacked (theirs)."""
        packer = Packer(tensors, plan)
        stream = self.pack_stream()
        for j in range(len(plan) + 1):
            if j < len(plan):  # its buffer held bucket j-2, which every receiver confirmed at step j-1
                with torch.cuda.stream(stream):
                    packer.pack(plan[j], bufs[j % 2], non_blocking=True)
                stream.synchronize()
            if group.all_max([0], f"ipc bucket step {j}")[0]:
                return 1
        return 0

    # ---- a receiver's end -------------------------------------------------------------------------
    def receiver_agreement(self) -> Agreement:
        return [self._layout[0] if self._layout is not None else 0], [0]

    def receive(self, group: TransferGroup, plan: Sequence[Bucket], specs: Sequence[TensorSpec], sink: Sink,
                agreed: Sequence[bool], values: Sequence[int]) -> None:
        layout, failure = self._apply_layout(group, None if agreed[0] else values[0])
        self.last_mode = layout["mode"]
        if layout["mode"] == "direct":
            if failure is None:
                failure = self.guard(lambda: self._copy_direct(layout, specs, sink))
            self.finish_receiving(group, failure, sink)
        else:
            self._receive_packed(group, plan, specs, sink, layout, failure)

    def _apply_layout(self, group: TransferGroup, size: int | None) -> tuple[dict[str, Any], BaseException | None]:
        """The layout of this sync (`size` None: every rank holds it already), received and applied
        unless cached; a failure to apply it is returned (reported at the status step), and leaves
        no cached layout behind."""
        if size is None:
            assert self._layout is not None
            return self._layout[1], None
        self._layout = None
        layout = json.loads(group.broadcast_bytes(None, size))
        self.layouts_received += 1
        try:
            self.importer.apply(layout)
        except Exception as e:
            return layout, e
        steady = {**layout, "new": {}}  # its handles are open now
        self._layout = (layout_key(steady), steady)
        return layout, None

    def _copy_direct(self, layout: dict[str, Any], specs: Sequence[TensorSpec], sink: Sink) -> None:
        routing = self._direct_routing(self.importer.views(layout, specs), sink.direct_destinations())
        with torch.no_grad():
            routing.plan.run()
        sink.mark_direct(routing.direct)
        sink.put(routing.rest)  # TP shards, casts, skipped names: loaded and digested while the memory is ours
        copied = torch.cuda.Event()
        copied.record(torch.cuda.current_stream(self.device))
        sink.landed()  # queued behind the copies: its host work runs while they do (finish_receiving skips it)
        copied.synchronize()  # every read of the sender's memory is done before the ack

    def _direct_routing(self, sources: Sequence[torch.Tensor],
                        destinations: Sequence[torch.Tensor | None]) -> _DirectRouting:
        """Which sources are copied straight into which regions; rebuilt only when either list changes."""
        cached = self._direct
        if cached is not None and cached.sources is sources and cached.destinations is destinations:
            return cached
        assert len(sources) == len(destinations), (len(sources), len(destinations))
        pairs, direct, rest = [], [], []
        for i, (src, dst) in enumerate(zip(sources, destinations)):
            if dst is not None and dst.device == src.device:
                pairs.append((dst, src))
                direct.append(i)
            else:
                rest.append((i, src))
        self._direct = _DirectRouting(sources, destinations, CopyPlan.build(pairs), tuple(direct), tuple(rest))
        self.direct_plans_built += 1
        return self._direct

    def _receive_packed(self, group: TransferGroup, plan: Sequence[Bucket], specs: Sequence[TensorSpec],
                        sink: Sink, layout: dict[str, Any], failure: BaseException | None) -> None:
        bufs = [self.importer.storage(sid) for sid in layout["buffers"]] if failure is None else []
        unpacker = Unpacker(specs, self.device)

        def unpack(j: int) -> None:
            sink.put(unpacker.tensors(plan[j], bufs[j % 2]))
            torch.cuda.synchronize(self.device)  # done reading bucket j before reporting it

        status = 0
        for j in range(len(plan) + 1):
            status = group.all_max([int(failure is not None)], f"ipc bucket step {j}")[0]
            if status:
                break
            if j < len(plan):
                failure = self.guard(lambda j=j: unpack(j))
        if failure is not None:
            raise failure
        if status:
            raise TransferError(f"{self.label}: another rank of the group failed during the ipc transfer; this "
                                "update is abandoned")


@dataclass(frozen=True)
class _DirectRouting:
    """The direct-mode split of one (sources, destinations) pair; holds both so their ids stay valid."""

    sources: Sequence[torch.Tensor]
    destinations: Sequence[torch.Tensor | None]
    plan: CopyPlan
    direct: tuple[int, ...]
    rest: tuple[tuple[int, torch.Tensor], ...]

