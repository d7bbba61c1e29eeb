"""Tensor parallelism on CPU for tests: a free local port (for a rendezvous, or as a port nothing listens
on), and the gloo group that a spawned rank function runs its TP work in (every rank calls `gloo_tp` with
the same port)."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from datetime import timedelta

import torch.distributed as dist

from inference.parallel import TPInfo


def free_port() -> int:
    """A port on 127.0.0.1 that was free a moment ago (the OS picks it; another process may still take it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def gloo_tp(rank: int, size: int, port: int, timeout_s: float = 60) -> Iterator[TPInfo]:
    """This process as TP rank `rank` of `size` over gloo, rendezvous at tcp://127.0.0.1:`port`.

    On a normal exit the ranks meet at a barrier first: a rank that leaves alone can abort in gloo's
    teardown. On an exception there is no barrier (the other ranks may never reach it); the process group
    is destroyed either way."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=timedelta(seconds=timeout_s))
    try:
        yield TPInfo(rank=rank, size=size, group=dist.new_group(list(range(size))))
        dist.barrier()
    finally:
        dist.destroy_process_group()
