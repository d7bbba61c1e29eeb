"""The gloo backend's chain (inference/transfer/backends/chain.py), between real processes on the CPU:
with a sender and one or three receivers every receiver ends with the sender's exact bytes, whether a
bucket went in place (one piece of a tensor, sent from the sender's tensor, received into a host
destination the sink gave) or through the ring (shared buckets, a non-contiguous sender tensor, a
tensor without a destination); a receiver that dies mid-group ends every other rank in a
TransferError naming it, within the group's timeout, never a hang."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import queue
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from inference.transfer.backends import chain, check_backend
from inference.transfer.backends.gloo import GlooBackend
from inference.transfer.groups import InitInfo, TransferError, TransferGroup, master_store, new_session_id
from inference.transfer.plan import Bucket, ParsedManifest, Segment, TensorSpec
from tests.helpers_weight_update import Link, held, loader_digests, make_worker, perturbed, tiny_model_dirs

BACKEND = check_backend(GlooBackend.__module__.rpartition(".")[2])  # the registry's gloo entry
STREAM = 16 << 10  # small buckets, so a few KiB of tensors cover every case
ALONE = 4 << 10
BUCKET = 64 << 10  # the session's bucket size: the chain plans at STREAM below it
TIMEOUT_S = 10.0
WITH_DESTINATION = (0, 2, 5)  # tensors the receivers' sink gives a host destination


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randn(25_000, generator=g),  # 100,000 B: alone, in 7 pieces, the last one short
            torch.randn(10, generator=g),  # a shared bucket
            torch.randint(0, 255, (STREAM,), dtype=torch.uint8, generator=g),  # alone, one piece
            torch.randn(3, generator=g),  # shares the shared bucket
            torch.randn(60, 100, generator=g).t(),  # alone but not contiguous: the sender packs it
            torch.randn(3000, generator=g).to(torch.bfloat16),  # alone, in place at both ends
            torch.randn(5000, generator=g),  # alone, no destination: received into the ring
            torch.empty(0)]  # an empty bucket (planned by hand below)


SIZES = chain.ChainSizes(STREAM, ALONE)


def _plan(specs: Sequence[TensorSpec]) -> list[Bucket]:
    plan = list(SIZES.plan(ParsedManifest(specs[:-1]), BUCKET))
    return [*plan, Bucket(len(plan), 0, (Segment(len(specs) - 1, 0, 0, 0),))]


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


class _Sink:
    """A receiver's view of the sync: host destinations for WITH_DESTINATION, a copy of every tensor put."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.dests = [torch.full_like(t.contiguous(), 0) if i in WITH_DESTINATION else None
                      for i, t in enumerate(tensors)]
        self.got: dict[int, torch.Tensor] = {}
        self.direct: list[int] = []
        self.landed_once = False

    def direct_destinations(self) -> Sequence[torch.Tensor | None]:
        return self.dests

    def mark_direct(self, indices: Sequence[int]) -> None:
        assert not set(indices) & set(self.direct), "a tensor marked twice"
        self.direct.extend(indices)

    def put(self, items: Sequence[tuple[int, torch.Tensor]]) -> None:
        for i, t in items:
            assert i not in self.got, f"tensor {i} put twice"
            dst = self.dests[i]
            if dst is not None:
                dst.copy_(t)
            self.got[i] = dst if dst is not None else t.clone()

    def landed(self) -> None:
        self.landed_once = True


def _end(info: dict[str, Any], rank: int, die: int | None, stall: bool, out: Any) -> None:
    """One group rank in a process of its own: sends or receives `_tensors()` through GlooBackend and
    puts (rank, outcome, detail, seconds) on `out`. Rank `die` joins the group, then exits at once (or,
    with `stall`, stays silent past everyone's timeout)."""
    full = InitInfo(**info)
    tensors = _tensors()
    specs = [TensorSpec.of(f"t{i}", t) for i, t in enumerate(tensors)]
    end = GlooBackend(BACKEND, torch.device("cpu"), "sender" if rank == 0 else f"rank {rank}", BUCKET)
    end.sizes = SIZES
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
            sink = _Sink(tensors)
            end.receive(group, _plan(specs), specs, sink, [], [])
            assert sink.landed_once and sorted([*sink.got, *sink.direct]) == list(range(len(specs)))
            digests = [_digest(sink.got[i] if i in sink.got else sink.dests[i]) for i in range(len(specs))]
            out.put((rank, end.last_mode, (digests, sorted(sink.direct)), time.monotonic() - start))
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


def test_the_plan_covers_every_case_of_the_chain() -> None:
    tensors = _tensors()
    specs = [TensorSpec.of(f"t{i}", t) for i, t in enumerate(tensors)]
    plan = _plan(specs)
    alone = {i for i, sp in enumerate(specs) if sp.nbytes >= ALONE}
    assert alone == {0, 2, 4, 5, 6}
    for b in plan:
        assert b.nbytes <= STREAM
        tensors_in = {seg.tensor for seg in b.segments}
        assert len(tensors_in) == 1 or not tensors_in & alone, "an alone tensor shares a bucket"
    shared = [b for b in plan if len(b.segments) > 1]
    assert [[seg.tensor for seg in b.segments] for b in shared] == [[1, 3]]
    assert sum(seg.tensor == 0 for b in plan for seg in b.segments) == 7 and plan[-1].nbytes == 0


@pytest.mark.parametrize("world", [2, 4], ids=["one-receiver", "three-receivers"])
@pytest.mark.slow
def test_every_receiver_gets_the_senders_exact_bytes_in_place_or_through_the_ring(world: int) -> None:
    results = _run_group(world)
    outcome, sent, _ = results[0]
    assert outcome == "ok", sent
    for rank in range(1, world):
        mode, (got, direct), _ = results[rank]
        assert mode == "chain", (rank, got)
        assert got == sent, f"rank {rank} received other bytes than were sent"
        # every tensor with a destination that is alone went in place (or its pieces straight there)
        assert direct == [0, 2, 5], (rank, direct)


@pytest.mark.parametrize("stall", [False, True], ids=["exits", "stalls"])
@pytest.mark.slow
def test_a_dead_receiver_ends_its_neighbours_in_an_error_naming_it(stall: bool) -> None:
    results = _run_group(4, die=2, stall=stall)
    assert sorted(results) == [0, 1, 3]
    for rank, (outcome, detail, seconds) in results.items():
        assert outcome == "TransferError", (rank, detail)
        assert seconds < 2 * TIMEOUT_S + 5, (rank, seconds)
    for rank in (1, 3):  # its two neighbours name it: one could not forward to it, one heard nothing from it
        assert "group rank 2" in results[rank][1], results[rank][1]


def test_a_sender_that_plans_otherwise_is_stopped_before_a_byte_moves(tmp_path: Path) -> None:
    """Another release of the chain (other constants) at one end: the agreement fails cleanly on both
    ends, nothing is written, the group stays usable and the next sync from a matching sender passes."""
    dirs = tiny_model_dirs(tmp_path / "models")
    worker = make_worker(dirs, draft=False)
    link = Link(worker)
    end = link.sender._end
    try:
        before = held(worker)
        state = perturbed(dirs["target"], 5)
        assert end.plan_id() == f"gloo/chain/{chain.STREAM_BYTES}/{chain.ALONE_BYTES}"
        end.sizes = chain.ChainSizes(2 * chain.STREAM_BYTES)
        worker.weights.start("target", 1, link.sender.manifest(state, 1))
        with pytest.raises(TransferError, match=r"plan .*differs"):
            link.transfer(state)
        assert held(worker) == before, "a byte was written before the ends agreed"
        worker.weights.abort()
        end.sizes = chain.ChainSizes()  # the receivers' own again
        assert link.sync(state, 2).report.ok
        assert held(worker) == loader_digests(dirs["target"], state, tmp_path / "ref")
    finally:
        link.sender.close()
        worker.weights.close_transfer()


def test_a_trainer_on_the_ranks_own_gpu_over_nccl_is_told_to_use_ipc() -> None:
    """NCCL refuses two ranks on one device; the error says what to launch instead (the message is built
    by TransferGroup._fail, which every failed collective goes through)."""
    group = object.__new__(TransferGroup)  # only the fields _fail reads: no process group is needed for it
    group.label, group.broken, group._data = "rank dp0:pp0:tp0 (group rank 1)", None, None
    group.info = InitInfo("nccl", "127.0.0.1", 1, 2, BUCKET, TIMEOUT_S, new_session_id())
    group.timeout = group.info.timeout
    nccl = RuntimeError("NCCL error: invalid usage. Duplicate GPU detected : rank 1 and rank 0 both on CUDA "
                        "device 60")
    err = group._fail("broadcast", nccl)
    assert isinstance(err, TransferError) and "Duplicate GPU detected" in str(err)
    assert "sidecar launch --transfer ipc" in str(err) and group.broken is not None
    assert "--transfer ipc" not in str(group._fail("broadcast", RuntimeError("connection reset")))
