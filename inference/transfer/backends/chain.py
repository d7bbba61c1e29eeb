"""How the gloo backend moves a sync's bytes: a chain of point-to-point messages, one per small bucket,
written in place wherever both ends allow it and posted all at once where no buffer is needed.

The plan (`ChainSizes`): buckets of `stream_bytes` at most; a tensor of `alone_bytes` or more never shares
one. Each bucket is one message tagged with its index, so either end may post in any order. A bucket
that is one piece of one tensor goes straight from the sender's host tensor and into the receiver's
parameter where the sink gives one (`Sink.direct_destinations`), all posted at the start; the others
go through a ring of DEPTH host buffers. The sender sends to group rank 1; receiver r receives from
r - 1 and forwards to r + 1 as each bucket lands, so every process moves each byte about once.

Invariants: every end derives the same buckets from the agreed plan (the sizes enter the plan id); every
receiver ends with the sender's exact bytes; a ring buffer is reused only after its bucket was unpacked
and forwarded (or sent). The traffic runs on the session's gloo control group between the agreement and
the status step. Every wait has the group's timeout and names the bucket and the peer; a receiver whose
unpack failed keeps receiving and forwarding to the end, so no other rank hangs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from checksum import flat_bytes
from inference.transfer.backends.base import Sink, TransferBackend
from inference.transfer.buckets import Packer, Unpacker
from inference.transfer.groups import TransferGroup
from inference.transfer.plan import Bucket, ParsedManifest, TensorSpec

STREAM_BYTES = 4 << 20  # the largest bucket: small enough to pipeline, large next to a message's cost
ALONE_BYTES = 1 << 20  # a tensor this large is sent in buckets of its own (in place where it can be)
DEPTH = 4  # ring buffers at each end, for the buckets that are packed or unpacked

Pending = tuple[Any, str]  # (a started send or receive, what to name in its error)


@dataclass(frozen=True)
class ChainSizes:
    """The chain's byte thresholds (defaults: the constants above; tests use smaller ones). They enter
    the plan id, so two ends with other sizes stop at the agreement."""

    stream_bytes: int = STREAM_BYTES
    alone_bytes: int = ALONE_BYTES

    def plan(self, specs: ParsedManifest, bucket_bytes: int) -> Sequence[Bucket]:
        """The buckets of a gloo sync of `specs` in a session agreed on `bucket_bytes`."""
        size = min(bucket_bytes, self.stream_bytes)
        return specs.plan(size, min(self.alone_bytes, size))

    def plan_id(self) -> str:
        return f"chain/{self.stream_bytes}/{self.alone_bytes}"


def _start(group: TransferGroup, send: bool, buf: torch.Tensor, peer: int, k: int, n: int) -> Pending:
    """Start sending bucket k (of n), which is `buf`, to group rank `peer` (or receiving it from there)."""
    what = f"bucket {k} of {n} {'to' if send else 'from'} group rank {peer}"
    return group.exchange(send, buf, peer, what, tag=k), what


def _settle(group: TransferGroup, pending: deque[Pending], keep: int = 0) -> None:
    """Wait for the oldest operations in `pending` (each with the group's timeout) until `keep` remain."""
    while len(pending) > keep:
        group.wait(*pending.popleft())


def _in_place(plan: Sequence[Bucket], tensors: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """Per bucket, the bytes it is in `tensors` when it is one piece of one tensor that is contiguous on
    the host (a view: sent from or received into there), else None (through a ring buffer)."""
    flats: dict[int, torch.Tensor | None] = {}
    out: list[torch.Tensor | None] = []
    for b in plan:
        seg = b.segments[0] if len(b.segments) == 1 and b.nbytes == b.segments[0].nbytes > 0 else None
        if seg is None:
            out.append(None)
            continue
        if seg.tensor not in flats:
            t = tensors[seg.tensor]
            flats[seg.tensor] = flat_bytes(t) if t is not None and t.device.type == "cpu" and t.is_contiguous() \
                else None
        flat = flats[seg.tensor]
        out.append(None if flat is None else flat[seg.src_offset:seg.src_offset + seg.nbytes])
    return out


def send_chain(end: TransferBackend, group: TransferGroup, plan: Sequence[Bucket],
               tensors: list[torch.Tensor]) -> None:
    """The sender's bytes: every non-empty bucket to group rank 1, the in-place ones posted at once, the
    others packed into the ring in order. Returns once every message left; the status step follows
    (the caller's)."""
    n = len(plan)
    sources = _in_place(plan, tensors)
    packed = [k for k, (b, s) in enumerate(zip(plan, sources)) if s is None and b.nbytes]
    ring = end.ring(DEPTH, max((plan[k].nbytes for k in packed), default=0), torch.device("cpu"),
                    torch.cuda.is_available())
    direct = deque(_start(group, True, s, 1, k, n) for k, s in enumerate(sources) if s is not None)
    packer = Packer(tensors, plan)
    stream = end.pack_stream() if any(t.is_cuda for t in tensors) else None
    sends: deque[Pending] = deque()
    for j, k in enumerate(packed):
        _settle(group, sends, DEPTH - 1)  # the slot's last bucket has left
        buf = ring[j % DEPTH][:plan[k].nbytes]
        if stream is None:
            packer.pack(plan[k], buf)
        else:
            with torch.cuda.stream(stream):
                packer.pack(plan[k], buf, non_blocking=True)
            stream.synchronize()  # gloo reads the host buffer from its own threads
        sends.append(_start(group, True, buf, 1, k, n))
    _settle(group, sends)
    _settle(group, direct)


def receive_chain(end: TransferBackend, group: TransferGroup, plan: Sequence[Bucket],
                  specs: Sequence[TensorSpec], sink: Sink) -> BaseException | None:
    """A receiver's bytes: every non-empty bucket from group rank r - 1, forwarded to r + 1 as it lands
    (not by the last rank); the in-place ones posted at once, the others into the ring as it frees, and
    unpacked into `sink` in order. Returns the sink's failure, if any: a rank whose unpack failed keeps
    receiving and forwarding to the end, so its neighbours are not left hanging, and reports it at the
    status step (the caller's)."""
    n, src, dst = len(plan), group.rank - 1, group.rank + 1
    forwards = dst < group.info.world_size
    # Destinations as flat byte views: on the host a one-piece bucket is received straight into its own;
    # on a GPU rank the Unpacker copies each piece of a split tensor into its own from the (pinned) ring.
    dests = [flat_bytes(d) if d is not None and d.is_contiguous() else None for d in sink.direct_destinations()]
    places = _in_place(plan, dests)
    ringed = [k for k, p in enumerate(places) if p is None]  # in order; empty ones need no message
    ring = end.ring(DEPTH, max((plan[k].nbytes for k in ringed), default=0), torch.device("cpu"),
                    end.device.type == "cuda")
    recvs: dict[int, tuple[Pending | None, torch.Tensor]] = {
        k: (_start(group, False, p, src, k, n), p) for k, p in enumerate(places) if p is not None}
    slot_sends: list[deque[Pending]] = [deque() for _ in range(DEPTH)]
    direct_sends: deque[Pending] = deque()
    slot = {kk: j % DEPTH for j, kk in enumerate(ringed)}
    posted = 0  # of `ringed`

    def post_ringed(k: int) -> None:
        """Post the next ring receives whose slot is free: its last bucket (DEPTH ring buckets back) was
        unpacked, i.e. comes before bucket k, and has left for the next rank."""
        nonlocal posted
        while posted < len(ringed) and (posted < DEPTH or ringed[posted - DEPTH] < k):
            kk = ringed[posted]
            _settle(group, slot_sends[slot[kk]])
            view = ring[slot[kk]][:plan[kk].nbytes]
            recvs[kk] = (_start(group, False, view, src, kk, n) if plan[kk].nbytes else None, view)
            posted += 1

    unpacker = Unpacker(specs, torch.device("cpu"), dests)
    failure: BaseException | None = None
    for k, bucket in enumerate(plan):
        post_ringed(k)
        work, view = recvs.pop(k)
        if work is not None:
            group.wait(*work)
            if forwards:
                sends = direct_sends if places[k] is not None else slot_sends[slot[k]]
                sends.append(_start(group, True, view, dst, k, n))
        if failure is None:
            try:
                if places[k] is not None:
                    unpacker.landed_in_place(bucket.segments[0].tensor, bucket.nbytes)
                    items = []
                else:
                    items = unpacker.tensors(bucket, view)
                if unpacker.direct_done:
                    sink.mark_direct(unpacker.direct_done)
                    unpacker.direct_done.clear()
                if items:
                    sink.put(items)
            except Exception as e:  # keep receiving and forwarding so no other rank is left hanging
                failure = e
    for pending in (*slot_sends, direct_sends):
        _settle(group, pending)
    if failure is None and unpacker.incomplete:
        failure = RuntimeError(f"{end.label}: tensors left incomplete: {unpacker.incomplete[:3]}")
    return failure
