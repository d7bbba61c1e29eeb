"""The gloo backend's pipelined chain (inference/transfer/backends/chain.py), between real processes on
the CPU: with a sender and three receivers every receiver gets the sender's exact bytes through the
chain (buckets a multiple of the chunk, not a multiple, smaller than one chunk, and empty); with one
receiver the bytes still go by the broadcast; a receiver that dies mid-group ends every other rank in a
TransferError naming it, within the group's timeout, never a hang."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import queue
import time
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from inference.transfer.backends import chain, check_backend
from inference.transfer.backends.gloo import GlooBackend
from inference.transfer.groups import InitInfo, TransferError, TransferGroup, master_store, new_session_id
from inference.transfer.plan import Bucket, Segment, TensorSpec, plan_buckets

BACKEND = check_backend(GlooBackend.__module__.rpartition(".")[2])  # the registry's gloo entry
CHUNK = 16 << 10  # small chunks, so a few KiB of tensors cover every case of the chunking
BUCKET = 64 << 10  # four chunks exactly
TIMEOUT_S = 10.0


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randn(25_000, generator=g),  # 100,000 B: a full bucket, then a bucket of 2 chunks and a bit
            torch.randn(10, generator=g),  # rides in the open bucket of the one before
            torch.randint(0, 255, (BUCKET,), dtype=torch.uint8, generator=g),  # a bucket of its own
            torch.randn(3, generator=g),  # 12 B: a bucket smaller than one chunk
            torch.empty(0)]  # an empty bucket (planned by hand below)


def _plan(specs: Sequence[TensorSpec]) -> list[Bucket]:
    plan = plan_buckets(specs[:-1], BUCKET)
    return [*plan, Bucket(len(plan), 0, (Segment(len(specs) - 1, 0, 0, 0),))]


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


class _Sink:
    """Keeps a copy of every tensor it is given (the receiver's view of the sync)."""

    def __init__(self, n: int) -> None:
        self.got: dict[int, torch.Tensor] = {}
        self.n = n
        self.landed_once = False

    def direct_destinations(self) -> Sequence[torch.Tensor | None]:
        return [None] * self.n

    def mark_direct(self, indices: Sequence[int]) -> None:
        raise AssertionError("the broadcast backends never copy directly")

    def put(self, items: Sequence[tuple[int, torch.Tensor]]) -> None:
        for i, t in items:
            assert i not in self.got, f"tensor {i} put twice"
            self.got[i] = t.clone()

    def landed(self) -> None:
        self.landed_once = True


def _refuse_chain(*args: object, **kwargs: object) -> None:
    raise AssertionError("a group of one receiver must keep the broadcast path")


def _end(info: dict[str, Any], rank: int, die: int | None, stall: bool, out: Any) -> None:
    """One group rank in a process of its own: sends or receives `_tensors()` through GlooBackend and
    puts (rank, outcome, detail, seconds) on `out`. Rank `die` joins the group, then exits at once (or,
    with `stall`, stays silent past everyone's timeout)."""
    chain.CHUNK_BYTES = CHUNK
    full = InitInfo(**info)
    if full.world_size == 2:
        chain.send_chain = chain.receive_chain = _refuse_chain  # type: ignore[assignment]
    tensors = _tensors()
    specs = [TensorSpec.of(f"t{i}", t) for i, t in enumerate(tensors)]
    end = GlooBackend(BACKEND, torch.device("cpu"), "sender" if rank == 0 else f"rank {rank}", BUCKET)
    group = TransferGroup(full, rank, torch.device("cpu"), label=end.label)
    if rank == die:
        if stall:
            time.sleep(3 * TIMEOUT_S)
        os._exit(0)
    start = time.monotonic()
    try:
        if rank == 0:
            end.send(group, _plan(specs), tensors, [])
            out.put((rank, "ok", [_digest(t) for t in tensors], time.monotonic() - start))
        else:
            sink = _Sink(len(specs))
            end.receive(group, _plan(specs), specs, sink, [], [])
            assert sink.landed_once and sorted(sink.got) == list(range(len(specs)))
            digests = [_digest(sink.got[i]) for i in range(len(specs))]
            out.put((rank, end.last_mode, digests, time.monotonic() - start))
    except TransferError as e:
        out.put((rank, "TransferError", str(e), time.monotonic() - start))
    finally:
        group.close()


def _run_group(world: int, die: int | None = None, stall: bool = False) -> dict[int, tuple[str, Any, float]]:
    """Every rank of a `world`-rank group in its own process; their outcomes by rank."""
    store = master_store("127.0.0.1", 0, world, TIMEOUT_S)  # served from here, for the whole run
    info = InitInfo(BACKEND.name, "127.0.0.1", store.port, world, BUCKET, TIMEOUT_S, new_session_id()).to_dict()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_end, args=(info, r, die, stall, out), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, tuple[str, Any, float]] = {}
    try:
        for _ in range(world - (die is not None)):
            rank, outcome, detail, seconds = out.get(timeout=60 + 2 * TIMEOUT_S)
            results[rank] = (outcome, detail, seconds)
    except queue.Empty:
        pytest.fail(f"ranks {sorted(set(range(world)) - set(results) - {die})} never finished (a hang)")
    finally:
        if die is not None:
            procs[die].kill()  # a stalled rank would outlive the test
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return results


def test_chunks_cover_a_bucket_in_order_and_an_empty_one_has_none() -> None:
    n = chain.CHUNK_BYTES
    assert chain.chunk_bounds(0) == []
    assert chain.chunk_bounds(5) == [(0, 5)]
    assert chain.chunk_bounds(2 * n) == [(0, n), (n, 2 * n)]
    assert chain.chunk_bounds(2 * n + 1) == [(0, n), (n, 2 * n), (2 * n, 2 * n + 1)]


def test_plan_covers_every_chunking_case() -> None:
    specs = [TensorSpec.of(f"t{i}", t) for i, t in enumerate(_tensors())]
    sizes = [b.nbytes for b in _plan(specs)]
    assert sizes[0] == BUCKET and BUCKET % CHUNK == 0
    assert any(s > CHUNK and s % CHUNK for s in sizes), sizes
    assert any(0 < s < CHUNK for s in sizes) and sizes[-1] == 0, sizes


def test_three_receivers_get_the_senders_exact_bytes_through_the_chain() -> None:
    results = _run_group(4)
    outcome, sent, _ = results[0]
    assert outcome == "ok", sent
    for rank in (1, 2, 3):
        mode, got, _ = results[rank]
        assert mode == "chain", (rank, got)
        assert got == sent, f"rank {rank} received other bytes than were sent"


def test_one_receiver_keeps_the_broadcast() -> None:
    results = _run_group(2)
    assert results[0][0] == "ok", results[0]
    assert results[1][:2] == ("broadcast", results[0][1])


@pytest.mark.parametrize("stall", [False, True], ids=["exits", "stalls"])
def test_a_dead_receiver_ends_its_neighbours_in_an_error_naming_it(stall: bool) -> None:
    results = _run_group(4, die=2, stall=stall)
    assert sorted(results) == [0, 1, 3]
    for rank, (outcome, detail, seconds) in results.items():
        assert outcome == "TransferError", (rank, detail)
        assert seconds < 2 * TIMEOUT_S + 5, (rank, seconds)
    for rank in (1, 3):  # its two neighbours name it: one could not forward to it, one heard nothing from it
        assert "group rank 2" in results[rank][1], results[rank][1]
