"""The receiving end of the weight wire: one rank's membership in the group, and the receive loops.

Protocol of one sync (every rank walks it in the same order, so no collective can pair with the
wrong one): (1) `agree` on the plan fingerprint (version, manifest, bucket size, backend): if any
rank derived a different plan, all stop before a byte moves; (2) the bytes; (3) a status all-reduce
in which every receiver reports whether it unpacked everything: the sender's send() returns only
after it, so an ipc sender never overwrites memory a receiver still reads, and a receiver's failure
is reported to the trainer instead of passing silently.

- gloo / nccl: the plan's buckets are broadcast into two alternating receive buffers; bucket k+1 is
  in flight while bucket k is unpacked. A rank whose unpack fails keeps receiving (and discarding)
  until the end, so the others are not left hanging, then reports the failure at (3).
- ipc: the agreement at (1) also compares the key of the sender's layout (handles, offsets; see
  ipc.py) with the one this rank applied last, and carries the layout message's size. Equal keys on
  every rank: the cached layout is used and nothing more is exchanged (two control round trips per
  sync in "direct" mode). Otherwise the layout is broadcast over the control group and applied. In
  "direct" mode the receivers copy straight from the sender's tensors, then (3). In "packed" mode
  the sender fills two shared buckets: before bucket j the ranks all-reduce a status that means
  "bucket j is packed" (sender) and "bucket j-1 is unpacked" (receivers), so packing j+1 overlaps
  unpacking j and a failure anywhere stops everyone at the same step.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from inference.transfer.buckets import Unpacker
from inference.transfer.groups import InitInfo, TransferError, TransferGroup
from inference.transfer.ipc import CopyPlan, IpcImporter, layout_key
from inference.transfer.plan import Bucket, ParsedManifest, TensorSpec


class Sink(Protocol):
    """Where received tensors go (inference.transfer.target.UpdateTarget)."""

    def direct_destinations(self) -> Sequence[torch.Tensor | None]:
        """Per manifest index, the region a direct copy may write, or None to go through `put`.
        The same object while nothing changed, so the receiver can reuse its copy plan."""
        ...

    def mark_direct(self, indices: Sequence[int]) -> None: ...

    def put(self, items: Sequence[tuple[int, torch.Tensor]]) -> None: ...


class WeightReceiver:
    """One receiver rank of one transfer session. Joining blocks until every rank has joined."""

    def __init__(self, info: InitInfo, rank: int, device: torch.device, rank_key: str) -> None:
        if info.backend == "ipc" and device.type != "cuda":
            raise TransferError(f"rank {rank_key}: the ipc backend needs a CUDA device, this rank has {device}")
        self.info = info
        self.rank_key = rank_key
        self.device = device
        # Bytes arrive on the CPU for gloo, on this rank's GPU for nccl.
        self.buffer_device = device if info.backend == "nccl" else torch.device("cpu")
        self.group = TransferGroup(info, rank, device, label=f"rank {rank_key}")
        self.ipc = IpcImporter() if info.backend == "ipc" else None
        self.last_mode: str | None = None  # "broadcast", or ipc's "direct" / "packed": for metrics and tests
        self._buffers: list[torch.Tensor] = []
        self._direct: _DirectRouting | None = None
        self._layout: tuple[int, dict[str, Any]] | None = None  # (key, layout) last applied, ipc only
        self.direct_plans_built = 0  # tests check that an unchanged layout reuses its plan
        self.layouts_received = 0  # ipc layout messages received (tests check the cached path with it)

    @property
    def broken(self) -> str | None:
        return self.group.broken

    def close(self) -> None:
        if self.ipc is not None:
            self.ipc.close()
        self.group.close()
        self._buffers, self._direct, self._layout = [], None, None

    def receive(self, version: int, specs: ParsedManifest | Sequence[TensorSpec], sink: Sink,
                on_agreed: Callable[[], None] | None = None) -> None:
        """Receive one whole sync into `sink`. Raises TransferError (group broken) or the sink's error.

        `on_agreed` runs once both ends agreed on the plan, just before the first byte may be written.
        """
        parsed = specs if isinstance(specs, ParsedManifest) else ParsedManifest(specs)
        fingerprint = parsed.fingerprint(version, self.info.bucket_bytes, self.info.backend)
        ipc = self.info.backend == "ipc"
        keys = [fingerprint, self._layout[0] if self._layout is not None else 0] if ipc else [fingerprint]
        same, sizes = self.group.agree_many(keys, [0] if ipc else [])
        if not same[0]:
            raise TransferError(f"rank {self.rank_key}: the sender's plan (version, manifest or bucket size) "
                                f"differs from this rank's for version {version}; nothing was written")
        plan = parsed.plan(self.info.bucket_bytes)
        if on_agreed is not None:
            on_agreed()
        if ipc:
            self._receive_ipc(plan, parsed, sink, None if same[1] else sizes[0])
        else:
            self.last_mode = "broadcast"
            self._receive_broadcast(plan, parsed, sink)

    # ---- gloo / nccl ----------------------------------------------------------------------------
    def _receive_broadcast(self, plan: Sequence[Bucket], specs: Sequence[TensorSpec], sink: Sink) -> None:
        bufs = self._receive_buffers(max((b.nbytes for b in plan), default=0))
        unpacker = Unpacker(specs, self.buffer_device)
        failure: BaseException | None = None
        works: dict[int, Any] = {}
        if plan:
            works[0] = self.group.broadcast(bufs[0][:plan[0].nbytes])
        for k, bucket in enumerate(plan):
            self.group.wait(works.pop(k), f"bucket {k} of {len(plan)}")
            if k + 1 < len(plan):  # its buffer held bucket k-1, unpacked already (same stream on CUDA)
                works[k + 1] = self.group.broadcast(bufs[(k + 1) % 2][:plan[k + 1].nbytes])
            if failure is None:
                try:
                    sink.put(unpacker.tensors(bucket, bufs[k % 2]))
                except Exception as e:  # keep draining so the sender and other ranks are not left hanging
                    failure = e
        if failure is None and unpacker.incomplete:
            failure = RuntimeError(f"rank {self.rank_key}: tensors left incomplete: {unpacker.incomplete[:3]}")
        self._finish(failure)

    def _receive_buffers(self, nbytes: int) -> list[torch.Tensor]:
        if not self._buffers or self._buffers[0].numel() < nbytes:
            self._buffers = []  # free the old pair before allocating the larger one
            pin = self.buffer_device.type == "cpu" and self.device.type == "cuda"
            self._buffers = [torch.empty(nbytes, dtype=torch.uint8, device=self.buffer_device, pin_memory=pin)
                             for _ in range(2)]
        return self._buffers

    # ---- ipc ----------------------------------------------------------------------------------
    def _receive_ipc(self, plan: Sequence[Bucket], specs: Sequence[TensorSpec], sink: Sink,
                     layout_size: int | None) -> None:
        """`layout_size` None: every rank holds the sender's layout already (see the module docstring)."""
        layout, failure = self._ipc_layout(layout_size)
        self.last_mode = layout["mode"]
        if layout["mode"] == "direct":
            if failure is None:
                failure = self._guard(lambda: self._copy_direct(layout, specs, sink))
            self._finish(failure)
        else:
            self._receive_packed(plan, specs, sink, layout, failure)

    def _ipc_layout(self, size: int | None) -> tuple[dict[str, Any], BaseException | None]:
        """The layout of this sync, received and applied unless cached; a failure to apply it is
        returned (reported at the status step), and leaves no cached layout behind."""
        assert self.ipc is not None
        if size is None:
            assert self._layout is not None
            return self._layout[1], None
        self._layout = None
        layout = json.loads(self.group.broadcast_bytes(None, size))
        self.layouts_received += 1
        try:
            self.ipc.apply(layout)
        except Exception as e:
            return layout, e
        steady = {**layout, "new": {}}  # its handles are open now
        self._layout = (layout_key(steady), steady)
        return layout, None

    def _copy_direct(self, layout: dict[str, Any], specs: Sequence[TensorSpec], sink: Sink) -> None:
        assert self.ipc is not None
        routing = self._direct_routing(self.ipc.views(layout, specs), sink.direct_destinations())
        with torch.no_grad():
            routing.plan.run()
        sink.mark_direct(routing.direct)
        sink.put(routing.rest)  # TP shards, casts, skipped names: loaded and digested while the memory is ours
        torch.cuda.synchronize(self.device)  # every read of the sender's memory is done before the ack

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

    def _receive_packed(self, plan: Sequence[Bucket], specs: Sequence[TensorSpec], sink: Sink,
                        layout: dict[str, Any], failure: BaseException | None) -> None:
        assert self.ipc is not None
        bufs = [self.ipc.storage(sid) for sid in layout["buffers"]] if failure is None else []
        unpacker = Unpacker(specs, self.device)

        def unpack(j: int) -> None:
            sink.put(unpacker.tensors(plan[j], bufs[j % 2]))
            torch.cuda.synchronize(self.device)  # done reading bucket j before reporting it

        for j in range(len(plan) + 1):
            status = self.group.all_max([int(failure is not None)], f"ipc bucket step {j}")[0]
            if status:
                break
            if j < len(plan):
                failure = self._guard(lambda j=j: unpack(j))
        if failure is not None:
            raise failure
        if status:
            raise TransferError(f"rank {self.rank_key}: another rank of the group failed during the ipc "
                                "transfer; this update is abandoned")

    # ---- shared -------------------------------------------------------------------------------
    @staticmethod
    def _guard(fn: Any) -> BaseException | None:
        try:
            fn()
        except Exception as e:  # reported through the status all-reduce, then re-raised by _finish
            return e
        return None

    def _finish(self, failure: BaseException | None) -> None:
        status = self.group.all_max([int(failure is not None)], "end-of-sync status")[0]
        if failure is not None:
            raise failure
        if status:
            raise TransferError(f"rank {self.rank_key}: another rank of the group failed to receive this "
                                "update; it is abandoned")


@dataclass(frozen=True)
class _DirectRouting:
    """The direct-mode split of one (sources, destinations) pair; holds both so their ids stay valid."""

    sources: Sequence[torch.Tensor]
    destinations: Sequence[torch.Tensor | None]
    plan: CopyPlan
    direct: tuple[int, ...]
    rest: tuple[tuple[int, torch.Tensor], ...]
