"""Weight updates with real processes: a sender that dies or stalls mid-sync (the worker lives on with its
model torn, and a new init + sync recovers it), and TP=2 receivers that each hold their shard, where a
flipped byte on one rank names that rank."""

from __future__ import annotations

import os
import socket
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


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return tiny_model_dirs(tmp_path_factory.mktemp("wu"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def _tp_receiver(rank: int, port: int, info: dict, model_dir: str, inbox: Any, out: Any, deliver: bool) -> None:
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=timedelta(seconds=60))
        tp = TPInfo(rank=rank, size=2, group=dist.new_group([0, 1]))
        worker = Worker(EngineConfig(model=model_dir, device="cpu", dtype="float32", tp_size=2), tp=tp)
        worker.init_device()
        worker.load_model()
        worker.weights.init_transfer(info)
        for version, flip in ((1, False), (2, rank == 1)):
            worker.weights.start("target", version, inbox.get(timeout=60))
            with flipped_on_arrival(Q1) if flip else nullcontext():
                delivered = worker.weights.update(digests_follow=deliver)  # with deliver: the sender's digests
            digests = inbox.get(timeout=60)
            try:
                result = worker.weights.finish(delivered if deliver else digests)
                out.put((rank, version, "ok", result.report.ok, worker.weights.checksums()))
            except ChecksumMismatch as e:
                out.put((rank, version, "mismatch", str(e), e.report.first_tensor.tensor))
    except Exception:
        out.put((rank, 0, "error", traceback.format_exc(), None))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.parametrize("deliver", [False, True])
def test_tp2_receivers_each_hold_their_shard_and_a_flip_names_its_rank(dirs: dict[str, Path], tmp_path: Path,
                                                                       deliver: bool) -> None:
    """With `deliver`, each rank takes the sender's digests from the group in its update (one request per
    sync through the sidecar) instead of from the test."""
    sender = WeightSender("gloo", num_receivers=2, bucket_bytes=BUCKET, timeout_s=60)
    info = sender.init_info()
    ctx = mp.get_context("spawn")
    inboxes, out = [ctx.Queue(), ctx.Queue()], ctx.Queue()
    port = _free_port()  # for the receivers' own TP group
    procs = [ctx.Process(target=_tp_receiver, args=(r, port, info, str(dirs["target"]), inboxes[r], out, deliver))
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        sender.connect()
        results = {}
        for version, seed in ((1, 110), (2, 111)):
            state = perturbed(dirs["target"], seed)
            for inbox in inboxes:
                inbox.put(sender.manifest(state, version))
            digests = sender.send(state, deliver_digests=deliver)
            for inbox in inboxes:
                inbox.put(digests)
            for _ in range(2):
                rank, v, kind, *rest = out.get(timeout=60)
                assert kind != "error", rest[0]
                results[rank, v] = (kind, *rest)
            if version == 1:
                v1_state = state
    finally:
        for p in procs:
            p.join(timeout=30)
        sender.close()
    for r in range(2):
        kind, ok, digests = results[r, 1]
        assert kind == "ok" and ok
        ref = loader_digests(dirs["target"], v1_state, tmp_path / "ref", TPInfo(r, 2, group=object()),
                             rank=f"dp0:pp0:tp{r}")
        assert digests == ref, f"rank {r} holds other bytes than the loader's shard"
    assert results[0, 2][0] == "ok"
    kind, message, tensor = results[1, 2]
    assert kind == "mismatch" and tensor == Q1 and "dp0:pp0:tp1" in message
