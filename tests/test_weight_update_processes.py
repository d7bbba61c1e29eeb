"""Weight updates with real processes: a sender that dies or stalls mid-sync (the worker lives on with its
model torn, and a new init + sync recovers it), and TP=2 receivers that each hold their shard, where a
flipped byte on one rank tears both ranks and names that rank on each."""

from __future__ import annotations

import os
import time
import traceback
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from checksum import ChecksumMismatch
from inference.config import EngineConfig
from inference.core import StateError
from inference.engine.worker import Worker
from inference.parallel import TPInfo
from inference.transfer.groups import TransferError
from inference.transfer.sender import WeightSender
from tests.helpers_fault import flipped_on_arrival
from tests.helpers_sidecar import on_bucket_message
from tests.helpers_tp import free_port
from tests.helpers_weight_update import (
    BUCKET,
    Q1,
    RANK,
    Link,
    held,
    loader_digests,
    make_worker,
    perturbed,
    tiny_model_dirs,
)

pytestmark = pytest.mark.slow  # every test here starts real processes or runs for seconds


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return tiny_model_dirs(tmp_path_factory.mktemp("wu"))


def _dying_sender(out: Any, model_dir: str, how: str) -> None:
    """Connects, sends two buckets of a sync, then dies (exit) or hangs (stall) like a broken trainer."""
    sender = WeightSender("gloo", bucket_bytes=BUCKET, timeout_s=3.0)
    out.put(sender.init_info())
    sender.connect()
    state = perturbed(Path(model_dir), 100)
    out.put(sender.manifest(state, 1))
    def third_message() -> None:
        if how == "stall":
            time.sleep(120)  # alive but silent: only the receiver's timeout can end its wait
        os._exit(17)

    on_bucket_message(sender._group, 3, third_message)
    sender.send(state)


@pytest.mark.parametrize("how", ["exit", "stall"])
def test_dead_sender_tears_the_model_and_a_new_init_recovers(dirs: dict[str, Path], tmp_path: Path,
                                                             how: str) -> None:
    worker = make_worker(dirs)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_dying_sender, args=(out, str(dirs["target"]), how))
    proc.start()
    try:
        worker.weights.init_transfer(out.get(timeout=60))
        worker.weights.start("target", 1, out.get(timeout=60))
        with pytest.raises(TransferError, match=rf"bucket \d+ of \d+ (from group rank 0 )?failed on rank {RANK}"):
            worker.weights.update()
    finally:
        if how == "stall":
            proc.kill()
        proc.join(timeout=30)
    assert proc.exitcode == (17 if how == "exit" else -9)
    worker.check_health()  # alive
    assert worker.weights.torn["target"] and not worker.weights.is_servable("target")
    assert "failed" in worker.weights.state("target")["torn_reason"]
    with pytest.raises(StateError, match="broken"):
        worker.weights.start("target", 1, [])
    state = perturbed(dirs["target"], 101)
    assert Link(worker).sync(state, 1).report.ok
    assert worker.weights.is_servable("target")
    assert held(worker) == loader_digests(dirs["target"], state, tmp_path / "ref")


def _tp_receiver(rank: int, port: int, info: dict, dirs: dict[str, str], which: str, inbox: Any, out: Any,
                 deliver: bool) -> None:
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=timedelta(seconds=60))
        tp = TPInfo(rank=rank, size=2, group=dist.new_group([0, 1]))
        draft = dirs["draft"] if which == "draft" else None
        worker = Worker(EngineConfig(model=dirs["target"], draft_model=draft, device="cpu", dtype="float32",
                                     tp_size=2), tp=tp)
        worker.init_device()
        worker.load_model()
        worker.weights.init_transfer(info)
        for version, flip in ((1, False), (2, rank == 1), (3, False)):
            worker.weights.start(which, version, inbox.get(timeout=60))
            with flipped_on_arrival(Q1) if flip else nullcontext():
                delivered = worker.weights.update(digests_follow=deliver)  # with deliver: the sender's digests
            digests = inbox.get(timeout=60)
            try:
                result = worker.weights.finish(delivered if deliver else digests)
                outcome = ("ok", result.report.ok, worker.weights.checksums(which))
            except ChecksumMismatch as e:
                outcome = ("mismatch", str(e), {m.rank for m in e.report.mismatches}, e.report.first_tensor.tensor)
            out.put((rank, version, *outcome, worker.weights.state(which)))
    except Exception:
        out.put((rank, 0, "error", traceback.format_exc(), None))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.parametrize("deliver, which", [(False, "target"), (True, "target"), (True, "draft")])
def test_tp2_receivers_each_hold_their_shard_and_a_flip_on_one_rank_tears_both(
        dirs: dict[str, Path], tmp_path: Path, deliver: bool, which: str) -> None:
    """A byte flipped on rank 1 only: neither rank goes live (rank 0 alone would step into the model's TP
    collectives while rank 1 stays torn), every rank's error names rank 1 and the tensor, and the next
    good sync brings both live. With `deliver`, each rank takes the sender's digests from the group in
    its update (one request per sync through the sidecar) instead of from the test."""
    sender = WeightSender("gloo", num_receivers=2, bucket_bytes=BUCKET, timeout_s=60)
    info = sender.init_info()
    ctx = mp.get_context("spawn")
    inboxes, out = [ctx.Queue(), ctx.Queue()], ctx.Queue()
    port = free_port()  # for the receivers' own TP group
    paths = {k: str(v) for k, v in dirs.items()}
    procs = [ctx.Process(target=_tp_receiver, args=(r, port, info, paths, which, inboxes[r], out, deliver))
             for r in range(2)]
    for p in procs:
        p.start()
    states = {}
    try:
        sender.connect()
        results = {}
        for version, seed in ((1, 110), (2, 111), (3, 112)):
            states[version] = perturbed(dirs[which], seed)
            for inbox in inboxes:
                inbox.put(sender.manifest(states[version], version))
            digests = sender.send(states[version], deliver_digests=deliver)
            for inbox in inboxes:
                inbox.put(digests)
            for _ in range(2):
                rank, v, kind, *rest = out.get(timeout=60)
                assert kind != "error", rest[0]
                results[rank, v] = (kind, *rest)
    finally:
        for p in procs:
            p.join(timeout=30)
        sender.close()
    for r in range(2):
        for version in (1, 3):
            kind, ok, digests, state = results[r, version]
            assert kind == "ok" and ok and state["version"] == version and state["servable"], (r, version, state)
            ref = loader_digests(dirs[which], states[version], tmp_path / f"ref{version}",
                                 TPInfo(r, 2, group=object()), rank=f"dp0:pp0:tp{r}")
            assert digests == ref, f"rank {r} holds other bytes than the loader's shard of version {version}"
        kind, message, bad_ranks, tensor, state = results[r, 2]
        assert kind == "mismatch" and bad_ranks == {"dp0:pp0:tp1"} and tensor == Q1, (r, message)
        assert "dp0:pp0:tp1" in message and Q1 in message, message
        assert state["torn"] and not state["servable"] and state["version"] == 1, state  # both torn, none live


def _tp_receiver_one_dies(rank: int, port: int, info: dict, model_dir: str, inbox: Any, out: Any) -> None:
    """Both ranks receive version 1; rank 1 then dies before its finish, rank 0 finishes."""
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=timedelta(seconds=10))
        worker = Worker(EngineConfig(model=model_dir, device="cpu", dtype="float32", tp_size=2),
                        tp=TPInfo(rank=rank, size=2, group=dist.group.WORLD))
        worker.init_device()
        worker.load_model()
        worker.weights.init_transfer(info)
        worker.weights.start("target", 1, inbox.get(timeout=60))
        worker.weights.update()
        digests = inbox.get(timeout=60)
        if rank == 1:
            os._exit(3)
        begin = time.monotonic()
        try:
            worker.weights.finish(digests)
            out.put(("live", "", 0.0, worker.weights.state()))
        except StateError as e:
            out.put(("state", str(e), time.monotonic() - begin, worker.weights.state()))
    except Exception:
        out.put(("error", traceback.format_exc(), 0.0, None))


def test_tp2_a_rank_that_dies_before_its_audit_leaves_the_other_torn_not_hung(dirs: dict[str, Path]) -> None:
    """Rank 0's audit passes but rank 1 is gone: the agreement fails (at worst at the TP group's timeout)
    and rank 0 stays torn, naming the failed agreement, instead of going live alone."""
    sender = WeightSender("gloo", num_receivers=2, bucket_bytes=BUCKET, timeout_s=60)
    info = sender.init_info()
    ctx = mp.get_context("spawn")
    inboxes, out = [ctx.Queue(), ctx.Queue()], ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_tp_receiver_one_dies, args=(r, port, info, str(dirs["target"]), inboxes[r], out))
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        sender.connect()
        state = perturbed(dirs["target"], 120)
        for inbox in inboxes:
            inbox.put(sender.manifest(state, 1))
        digests = sender.send(state)
        for inbox in inboxes:
            inbox.put(digests)
        kind, message, waited, weights = out.get(timeout=120)
    finally:
        for p in procs:
            p.join(timeout=30)
        sender.close()
    assert procs[1].exitcode == 3
    assert kind == "state" and "could not agree" in message and "dp0:pp0:tp0" in message, message
    assert waited < 30 and weights["torn"] and not weights["servable"] and weights["version"] == 0, weights
