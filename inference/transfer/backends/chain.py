"""A pipelined chain of point-to-point sends: how the gloo backend moves a bucket to two or more receivers.

gloo's broadcast on the host is one-to-all: the sender writes every byte once per receiver, so its one
stream is the bottleneck and a sync of n receivers costs about n times one receiver's. In the chain the
sender (group rank 0) sends each bucket, in chunks of CHUNK_BYTES, to rank 1 only; receiver r receives
its chunks from r - 1 and forwards each to r + 1 (the last forwards nothing) while the next chunk is in
flight. Every process then moves each byte about once in and once out, in parallel, and a bucket's
wall time is about its bytes over one link's bandwidth plus (n - 1) chunk times.

Invariants: every end derives the same chunks from the agreed plan (an empty bucket has none), the
bytes of each chunk land unchanged at every receiver (the same bytes as the broadcast puts there), and
the point-to-point traffic runs on the session's gloo control group, between steps (1) and (3) of the
protocol, so it never overlaps a collective. Both ends keep two bucket buffers: the sender packs
bucket k+1 while bucket k's chunks are on the wire; a receiver posts bucket k+1's receives before it
unpacks bucket k, and reuses a buffer only after its forwards from it completed. Every wait has the
group's timeout, and names the bucket, the chunk and the peer; a failed wait breaks the group
(TransferGroup.wait), as a failed broadcast does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from inference.transfer.backends.base import Sink, TransferBackend
from inference.transfer.buckets import Packer, Unpacker
from inference.transfer.groups import TransferGroup
from inference.transfer.plan import Bucket, TensorSpec

# A chunk is the unit a receiver forwards: large next to one message's fixed cost (tens of us), small
# next to a bucket, so the last receiver lags the first by only (n - 1) short chunk times.
CHUNK_BYTES = 4 << 20
MIN_RECEIVERS = 2  # with one receiver a chain is the broadcast itself: gloo keeps its broadcast path

Pending = tuple[Any, str]  # (a started send or receive, what to name in its error)


def chained(group: TransferGroup) -> bool:
    """Whether this group's buckets go through the chain (a sender and MIN_RECEIVERS or more)."""
    return group.info.world_size - 1 >= MIN_RECEIVERS


def chunk_bounds(nbytes: int) -> list[tuple[int, int]]:
    """The [start, stop) byte ranges of a bucket of `nbytes`, in order; none for an empty bucket."""
    return [(start, min(start + CHUNK_BYTES, nbytes)) for start in range(0, nbytes, CHUNK_BYTES)]


def _start(group: TransferGroup, send: bool, chunk: torch.Tensor, peer: int, what: str) -> Pending:
    """Start sending `chunk` to group rank `peer` (or receiving it from there), with its error's name."""
    return group.exchange(send, chunk, peer, what), what


def _settle(group: TransferGroup, pending: list[Pending]) -> None:
    """Wait for every started operation in `pending` (each with the group's timeout), then forget them."""
    for work, what in pending:
        group.wait(work, what)
    pending.clear()


def _start_bucket(group: TransferGroup, send: bool, buf: torch.Tensor, peer: int, k: int, n: int) -> list[Pending]:
    """Start every chunk of bucket k (of n), which is `buf`, to or from `peer`."""
    way = "to" if send else "from"
    return [_start(group, send, buf[a:b], peer, f"chunk {c} of bucket {k} of {n} {way} group rank {peer}")
            for c, (a, b) in enumerate(chunk_bounds(buf.numel()))]


def send_chain(end: TransferBackend, group: TransferGroup, plan: Sequence[Bucket],
               tensors: list[torch.Tensor]) -> None:
    """The sender's bytes: every bucket, packed into a host buffer, goes to group rank 1 in chunks.
    Returns once every chunk left this process; the status step follows (the caller's)."""
    pin = torch.cuda.is_available()
    bufs = end.double_buffer(max((b.nbytes for b in plan), default=0), torch.device("cpu"), pin)
    packer = Packer(tensors, plan)
    stream = end.pack_stream() if any(t.is_cuda for t in tensors) else None
    sends: list[list[Pending]] = [[], []]
    for k, bucket in enumerate(plan):
        slot = k % 2
        _settle(group, sends[slot])  # bucket k-2 left this buffer
        buf = bufs[slot][:bucket.nbytes]
        if stream is None:
            packer.pack(bucket, buf)
        else:
            with torch.cuda.stream(stream):
                packer.pack(bucket, buf, non_blocking=True)
            stream.synchronize()  # gloo reads the host buffer from its own threads
        sends[slot] = _start_bucket(group, True, buf, 1, k, len(plan))
    for pending in sends:
        _settle(group, pending)


def receive_chain(end: TransferBackend, group: TransferGroup, plan: Sequence[Bucket],
                  specs: Sequence[TensorSpec], sink: Sink) -> BaseException | None:
    """A receiver's bytes: every bucket from group rank r - 1, each chunk forwarded to r + 1 as it
    lands (not by the last rank), each bucket unpacked into `sink` while the next one arrives. Returns
    the sink's failure, if any: a rank whose unpack failed keeps receiving and forwarding to the end,
    so its neighbours are not left hanging, and reports it at the status step (the caller's)."""
    src, dst = group.rank - 1, group.rank + 1
    forwards = dst < group.info.world_size
    pin = end.device.type == "cuda"
    bufs = end.double_buffer(max((b.nbytes for b in plan), default=0), torch.device("cpu"), pin)
    unpacker = Unpacker(specs, torch.device("cpu"))
    failure: BaseException | None = None
    n = len(plan)
    recvs = _start_bucket(group, False, bufs[0][:plan[0].nbytes], src, 0, n) if plan else []
    sends: list[list[Pending]] = [[], []]
    for k, bucket in enumerate(plan):
        buf = bufs[k % 2][:bucket.nbytes]
        for c, ((work, what), (a, b)) in enumerate(zip(recvs, chunk_bounds(bucket.nbytes))):
            group.wait(work, what)
            if forwards:  # on the wire while chunk c+1 still arrives
                sends[k % 2].append(_start(group, True, buf[a:b], dst, f"chunk {c} of bucket {k} of {n} to "
                                           f"group rank {dst}"))
        if k + 1 < n:  # its buffer held bucket k-1: unpacked already, and forwarded once these complete
            _settle(group, sends[(k + 1) % 2])
            recvs = _start_bucket(group, False, bufs[(k + 1) % 2][:plan[k + 1].nbytes], src, k + 1, n)
        if failure is None:
            try:
                sink.put(unpacker.tensors(bucket, bufs[k % 2]))
            except Exception as e:  # keep receiving and forwarding so no other rank is left hanging
                failure = e
    for pending in sends:
        _settle(group, pending)
    if failure is None and unpacker.incomplete:
        failure = RuntimeError(f"{end.label}: tensors left incomplete: {unpacker.incomplete[:3]}")
    return failure
