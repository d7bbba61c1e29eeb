"""The interface of a weight-transfer backend (`TransferBackend`), and what its variants share.

An instance is one end of the wire: the sender's (WeightSender builds one and keeps it across
sessions; `new_session` at each connect) or one receiver's (WeightReceiver builds one per group),
built from its registry entry (inference/transfer/backends/__init__.py), never by name. Every end
walks one sync in the same order (inference/transfer/receiver.py), so no collective mispairs:
1. ONE all-reduce agrees on the plan's fingerprint, followed by the backend's own keys and values
   (`agreement_size` of each; the sender's from `prepare_send`, a receiver's from
   `receiver_agreement`): a backend adds control data without adding a round trip;
2. the bytes (`send`, `receive`);
3. a status all-reduce in which every receiver reports whether it wrote everything (`send` and
   `receive` run it: the sender returns only after it, so it never reuses memory a receiver reads).
The plan, its fingerprint, the group with its timeouts and the digests are shared by all backends;
a backend decides how the bytes move, where buckets live, and whether it needs a process group of
its own for them (`data_plane`).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Protocol

import torch
import torch.distributed as dist

from inference.transfer.backends import BackendSpec
from inference.transfer.groups import InitInfo, TransferError, TransferGroup
from inference.transfer.plan import Bucket, ParsedManifest, TensorSpec

Agreement = tuple[list[int], list[int]]  # (keys every end must pass equal, values whose max every end learns)


class Sink(Protocol):
    """Where received tensors go (inference/weights/target.py UpdateTarget)."""

    def direct_destinations(self) -> Sequence[torch.Tensor | None]:
        """Per manifest index, the region a direct copy may write, or None to go through `put`.
        The same object while nothing changed, so a receiver can reuse its copy plan."""
        ...

    def mark_direct(self, indices: Sequence[int]) -> None: ...

    def put(self, items: Sequence[tuple[int, torch.Tensor]]) -> None: ...

    def landed(self) -> None:
        """Every byte of the sync is written (queued on the current stream); the status step follows.
        Work that reads what was written may be queued here, to run while the ranks report."""
        ...


class TransferBackend(ABC):
    """One end of one backend (see the module docstring). `label` names the end in errors ("sender",
    "rank dp0:pp0:tp0"); `ipc_mode` is WeightSender's argument, read by the ipc backend only."""

    agreement_size: ClassVar[tuple[int, int]] = (0, 0)  # (keys, values) this backend adds to step 1

    def __init__(self, spec: BackendSpec, device: torch.device, label: str, bucket_bytes: int,
                 ipc_mode: str = "auto") -> None:
        self.spec, self.device, self.label = spec, device, label
        self.bucket_bytes, self.ipc_mode = bucket_bytes, ipc_mode
        self.last_mode: str | None = None  # how the last sync moved ("broadcast", "direct", "packed")
        self._buffers: list[torch.Tensor] = []
        self._pack_stream: Any = None

    @staticmethod
    def data_plane(store: dist.Store, rank: int, world_size: int, info: InitInfo, device: torch.device) -> Any:
        """A process group of the backend's own for the bytes, or None: they go over the gloo control
        group (TransferGroup builds it from its session's store)."""
        return None

    def check_device(self) -> None:
        """TransferError unless this end's device can hold the backend's bytes."""
        if self.spec.cuda and self.device.type != "cuda":
            raise TransferError(f"{self.label}: the {self.spec.name} backend needs a CUDA device, this rank "
                                f"has {self.device}")

    def close(self) -> None:
        self._buffers = []

    # ---- the sender's end -------------------------------------------------------------------------
    def new_session(self) -> None:
        """A new group (WeightSender.connect): the receivers hold nothing of earlier sessions."""
        self.last_mode = None

    def prepare_send(self, specs: Sequence[TensorSpec], tensors: list[torch.Tensor]) -> Agreement:
        """Before the agreement: decide this sync's way and return the agreement's extra keys and
        values. InvalidRequestError: the sync cannot go this way (the receivers are stopped cleanly)."""
        return [], []

    def sends_by_waiting(self) -> bool:
        """After `prepare_send`: whether this sync's `send` only waits for the receivers (they read the
        trainer's memory themselves), so the sender's own host work may run before it."""
        return False

    def withdraw(self) -> None:
        """The agreement failed after `prepare_send`: nothing of this sync reached the receivers."""
        return None

    @abstractmethod
    def send(self, group: TransferGroup, plan: Sequence[Bucket], tensors: list[torch.Tensor],
             agreed: Sequence[bool]) -> None:
        """Move every bucket, then run the status step; TransferError if any receiver failed.
        `agreed`: the verdicts on this backend's agreement keys."""

    # ---- a receiver's end -------------------------------------------------------------------------
    def receiver_agreement(self) -> Agreement:
        """This receiver's extra keys and values for step 1."""
        return [0] * self.agreement_size[0], [0] * self.agreement_size[1]

    @abstractmethod
    def receive(self, group: TransferGroup, plan: Sequence[Bucket], specs: Sequence[TensorSpec], sink: Sink,
                agreed: Sequence[bool], values: Sequence[int]) -> None:
        """Receive every bucket into `sink`, then run the status step. Raises the sink's error, or
        TransferError when another rank failed."""

    # ---- shared -----------------------------------------------------------------------------------
    def plan(self, specs: ParsedManifest) -> Sequence[Bucket]:
        """The buckets of a sync of `specs` (every end of a group derives the same from the agreed
        bucket size and the backend)."""
        return specs.plan(self.bucket_bytes)

    def plan_id(self) -> str:
        """What the plan depends on beyond the manifest and the bucket size: the backend's name and any
        constant of its own planning. It enters the agreed fingerprint, so two ends that would plan
        differently (another release of the backend) stop before a byte moves instead of mismatching."""
        return self.spec.name

    def double_buffer(self, nbytes: int, device: torch.device, pin: bool) -> list[torch.Tensor]:
        """Two byte buffers of at least `nbytes` on `device`, reused while they fit."""
        return self.ring(2, nbytes, device, pin)

    def ring(self, count: int, nbytes: int, device: torch.device, pin: bool) -> list[torch.Tensor]:
        """`count` byte buffers of at least `nbytes` on `device`, reused while they fit."""
        bufs = self._buffers
        if len(bufs) != count or bufs[0].numel() < nbytes or bufs[0].device != device:
            self._buffers = []  # free the old ones before allocating the new
            self._buffers = [torch.empty(nbytes, dtype=torch.uint8, device=device, pin_memory=pin)
                             for _ in range(count)]
        return self._buffers

    def pack_stream(self) -> Any:
        """The sender's packing stream, ordered after the trainer's work on the current stream."""
        if self._pack_stream is None:
            self._pack_stream = torch.cuda.Stream(self.device)
        self._pack_stream.wait_stream(torch.cuda.current_stream(self.device))
        return self._pack_stream

    def finish_receiving(self, group: TransferGroup, failure: BaseException | None, sink: Sink) -> None:
        """The receiver's status step: tell `sink` its bytes landed (unless this rank failed; a failure
        there is this rank's), report `failure` (or success), then raise it, or TransferError when
        another rank failed."""
        if failure is None:
            failure = self.guard(sink.landed)
        status = group.all_max([int(failure is not None)], "end-of-sync status")[0]
        if failure is not None:
            raise failure
        if status:
            raise TransferError(f"{self.label}: another rank of the group failed to receive this update; it "
                                "is abandoned")

    @staticmethod
    def guard(fn: Callable[[], None]) -> BaseException | None:
        """Run `fn`; its exception is returned, to be reported at a status step and raised after it."""
        try:
            fn()
        except Exception as e:
            return e
        return None


def backend_class(spec: BackendSpec) -> type[TransferBackend]:
    """The TransferBackend subclass `spec` names (its module is imported now)."""
    return getattr(importlib.import_module(spec.module), spec.cls)  # type: ignore[no-any-return]
