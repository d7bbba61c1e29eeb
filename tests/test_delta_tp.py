"""Delta syncs into TP=2 ranks: each rank applies the delta to the part of every tensor it holds (rows of
column-parallel weights and the vocabulary, columns of row-parallel ones) and audits those parts against
the sender's digests of the same slices. After a delta a rank holds exactly what a full sync of the same
weights gives it, and its received manifest is of the full tensors; a value flipped on one rank fails
the audit on both, naming that rank and the tensor; a sync whose base is not what the ranks hold is
full. In one process: tests/test_delta_sync.py."""

from __future__ import annotations

import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from checksum import ChecksumMismatch, digest_tensors
from inference.config import EngineConfig
from inference.engine.worker import Worker
from inference.models import build_model
from inference.models.hf_config import read_model_config
from inference.models.loader import iter_hf_tensors, load_weights
from inference.parallel import TPInfo
from inference.transfer.plan import ParsedManifest, TensorSpec
from inference.transfer.sender import WeightSender
from inference.weights.target import route_manifest
from tests.helpers_fault import flip_delta_values
from tests.helpers_models import make_hf_checkpoint
from tests.helpers_tp import free_port
from tests.helpers_weight_update import BUCKET, Q1, loader_digests, perturbed, sparse_step, tiny_model_dirs

DOWN0 = "model.layers.0.mlp.down_proj.weight"  # row-parallel: each rank holds columns (a strided slice)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["llama", "qwen2", "qwen3", "qwen3_moe"])
def test_every_part_a_tp2_rank_holds_is_where_its_loader_writes_it(tmp_path: Path, case: str) -> None:
    """The region and slice each parameter reports (held_part) are exactly what its weight_loader wrote
    from the full tensor, on both ranks, for every tensor a rank holds (a tied lm_head is none)."""
    make_hf_checkpoint(case, tmp_path, seed=3)
    config = read_model_config(tmp_path)
    full = dict(iter_hf_tensors(tmp_path))
    specs = ParsedManifest([TensorSpec.of(n, t) for n, t in full.items()])
    for rank in range(2):
        model = build_model(config, TPInfo(rank, 2, group=object()), torch.float32, "cpu")
        load_weights(model, tmp_path)
        routing = route_manifest(specs, model, config, which="target", rank=f"tp{rank}", tp_size=2, allow_cast=False)
        for route in routing.routes:
            if route.param is None:
                continue
            assert route.tp_part is not None, f"{route.spec.name}: no part on rank {rank}"
            region, sl = route.tp_part
            want = full[route.spec.name] if sl is None else full[route.spec.name].narrow(sl.dim, sl.start, sl.length)
            assert torch.equal(region, want), f"{route.spec.name} on rank {rank}: {sl}"


# version -> (the rank whose delta arrives with flipped values, the tensor)
FLIPS = {3: (1, Q1), 5: (0, DOWN0)}


def _tp_rank(rank: int, port: int, info: dict, model_dir: str, inbox: Any, out: Any) -> None:
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=timedelta(seconds=60))
        tp = TPInfo(rank=rank, size=2, group=dist.new_group([0, 1]))
        worker = Worker(EngineConfig(model=model_dir, device="cpu", dtype="float32", tp_size=2), tp=tp)
        worker.init_device()
        worker.load_model()
        worker.weights.init_transfer(info)
        while (got := inbox.get(timeout=120)) is not None:
            version, manifest = got
            worker.weights.start("target", version, manifest)
            with pytest.MonkeyPatch.context() as patch:
                flip_rank, tensor = FLIPS.get(version, (None, ""))
                if flip_rank == rank:
                    flip_delta_values(patch, tensor)
                delivered = worker.weights.update(digests_follow=True)
            delta = worker.weights.receiver.last_delta is not None
            try:
                result = worker.weights.finish(delivered)
                outcome = ("ok", delta, worker.weights.checksums("target"), result.received.records)
            except ChecksumMismatch as e:
                outcome = ("mismatch", delta, str(e), {m.rank for m in e.report.mismatches},
                           e.report.first_tensor.tensor)
            out.put((rank, version, outcome, worker.weights.state("target")))
        dist.barrier()  # leave together: a rank exiting alone can abort in gloo's teardown
    except Exception:
        out.put((rank, 0, ("error", traceback.format_exc()), None))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.slow
def test_tp2_ranks_take_deltas_into_their_shards_and_audit_them(tmp_path: Path) -> None:
    dirs = tiny_model_dirs(tmp_path)
    sender = WeightSender("gloo", num_receivers=2, bucket_bytes=BUCKET, timeout_s=60, delta=True)
    info = sender.init_info()
    ctx = mp.get_context("spawn")
    inboxes, out = [ctx.Queue(), ctx.Queue()], ctx.Queue()
    port = free_port()  # the ranks' own TP group
    procs = [ctx.Process(target=_tp_rank, args=(r, port, info, str(dirs["target"]), inboxes[r], out))
             for r in range(2)]
    for p in procs:
        p.start()
    states, modes, results = {}, {}, {}
    try:
        sender.connect()
        state = perturbed(dirs["target"], 1)
        for version in range(1, 9):
            if version > 1:
                state = sparse_step(state, version, least=2)
            states[version] = state
            manifest = sender.manifest(state, version)
            if version == 7:  # the sender's base is not what the ranks hold (one of them missed a version)
                sender.kept.set_version(sender._last_specs, 4)
            for inbox in inboxes:
                inbox.put((version, manifest))
            sender.send(state, deliver_digests=True)
            modes[version] = sender.last_sync["mode"]
            for _ in range(2):
                rank, v, outcome, got_state = out.get(timeout=120)
                assert outcome[0] != "error", outcome[1]
                results[rank, v] = (outcome, got_state)
    finally:
        for inbox in inboxes:
            inbox.put(None)
        for p in procs:
            p.join(timeout=60)
        sender.close()
    # full at the start, after each torn audit, and when the base is not what the ranks hold
    assert modes == {1: "full", 2: "delta", 3: "delta", 4: "full", 5: "delta", 6: "full", 7: "full", 8: "delta"}
    for r in range(2):
        key = f"dp0:pp0:tp{r}"
        for version in (2, 8):  # a delta leaves exactly the loader's shard of the trainer's weights
            (kind, delta, held, records), st = results[r, version]
            assert kind == "ok" and delta and st["version"] == version and st["servable"], (r, version, st)
            ref = loader_digests(dirs["target"], states[version], tmp_path / f"ref{version}",
                                 TPInfo(r, 2, group=object()), rank=key)
            assert held == ref, f"rank {r} holds other bytes after the delta of version {version}"
            # the received manifest is of the full tensors, as after a full sync (the sender's digests of them)
            assert list(records) == digest_tensors(list(states[version].items())), (r, version)
        for version, (bad_rank, tensor) in FLIPS.items():
            (kind, delta, message, bad_ranks, first), st = results[r, version]
            bad = f"dp0:pp0:tp{bad_rank}"
            assert kind == "mismatch" and delta and bad_ranks == {bad} and first == tensor, (r, version, message)
            assert bad in message and tensor in message, message
            assert st["torn"] and not st["servable"] and st["version"] == version - 1, st  # neither rank goes live
