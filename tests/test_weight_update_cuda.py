"""Weight updates on a GPU: the ipc backend between two processes sharing one GPU (direct and packed
modes, handles opened once and reused), and gloo into a CUDA worker. Skipped without a GPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from inference.config import EngineConfig
from inference.engine.worker import Worker
from tests.helpers_weight_update import DIMS, RANK, Link, loader_digests, perturbed

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from inference.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("wuc") / "target", "qwen2", **DIMS)


def cuda_worker(model_dir: Path) -> Worker:
    worker = Worker(EngineConfig(model=str(model_dir), device="cuda", dtype="float32"))
    worker.init_device()
    worker.load_model()
    return worker


def delta(model_dir: Path, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: 0.01 * torch.randn(t.shape, generator=gen) for n, t in perturbed(model_dir, 0).items()}


def _ipc_sender(out: Any, inbox: Any, model_dir: str, mode: str, bucket_bytes: int) -> None:
    """A trainer on the same GPU: its parameters live on in one place and change in place per step."""
    from inference.transfer.sender import WeightSender

    torch.cuda.set_device(0)
    sender = WeightSender("ipc", bucket_bytes=bucket_bytes, timeout_s=60, device="cuda:0", ipc_mode=mode)
    out.put(sender.init_info())
    sender.connect()
    params = {n: t.cuda() for n, t in perturbed(Path(model_dir), 1).items()}
    for version in (1, 2):
        if version == 2:
            for n, d in delta(Path(model_dir), 2).items():
                params[n].add_(d.cuda())  # an optimizer step: same storages, new values
        out.put(sender.manifest(params, version))
        records = sender.send(params)
        out.put(([r.__dict__ for r in records], sender._end.exporter.exported_total))
        inbox.get(timeout=120)  # the receiver finished its audit
    inbox.get(timeout=120)  # the receiver released its mappings: our memory may go now
    sender.close()


@pytest.mark.parametrize("mode,bucket_bytes", [("direct", 1 << 20), ("packed", 16 << 10)])
def test_ipc_sync_between_two_processes_on_one_gpu(model_dir: Path, tmp_path: Path, mode: str,
                                                   bucket_bytes: int) -> None:
    worker = cuda_worker(model_dir)
    ctx = mp.get_context("spawn")
    out, inbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_ipc_sender, args=(out, inbox, str(model_dir), mode, bucket_bytes))
    proc.start()
    try:
        worker.weights.init_transfer(out.get(timeout=120))
        expected = perturbed(model_dir, 1)
        opened = []
        for version in (1, 2):
            if version == 2:
                step = delta(model_dir, 2)
                expected = {n: t + step[n] for n, t in expected.items()}
            worker.weights.start("target", version, out.get(timeout=120))
            worker.weights.update()
            records, exported = out.get(timeout=120)
            result = worker.weights.finish(records)
            assert result.report.ok and worker.weights.is_servable("target")
            assert worker.weights.receiver.backend.last_mode == mode
            ref = loader_digests(model_dir, expected, tmp_path / f"ref{version}")
            assert worker.weights.checksums() == ref, f"version {version}: params differ from the loader's"
            opened.append((worker.weights.receiver.backend.importer.opened_total, exported))
            assert worker.weights.receiver.backend.direct_plans_built == (mode == "direct"), "the copy plan was rebuilt"
            inbox.put("next")
        assert opened[0] == opened[1], "the second sync opened or exported handles again"
        assert opened[0][0] > 0
        worker.weights.close_transfer()
        inbox.put("bye")
    finally:
        proc.join(timeout=60)
    assert proc.exitcode == 0


def _moving_sender(out: Any, inbox: Any, model_dir: str) -> None:
    """Three syncs: the second from the same storages, the third from new ones (new handles)."""
    from inference.transfer.sender import WeightSender

    torch.cuda.set_device(0)
    sender = WeightSender("ipc", bucket_bytes=1 << 20, timeout_s=60, device="cuda:0", ipc_mode="direct")
    out.put(sender.init_info())
    sender.connect()
    params = {n: t.cuda() for n, t in perturbed(Path(model_dir), 1).items()}
    for version in (1, 2, 3):
        if version == 3:
            params = {n: t + 0.5 for n, t in params.items()}  # e.g. a trainer that rebuilt its tensors
        out.put(sender.manifest(params, version))
        out.put([r.__dict__ for r in sender.send(params)])
        inbox.get(timeout=120)
    inbox.get(timeout=120)
    sender.close()


def test_ipc_layout_is_sent_only_when_it_changed(model_dir: Path, tmp_path: Path) -> None:
    worker = cuda_worker(model_dir)
    ctx = mp.get_context("spawn")
    out, inbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_moving_sender, args=(out, inbox, str(model_dir)))
    proc.start()
    try:
        worker.weights.init_transfer(out.get(timeout=120))
        seen = []
        for version in (1, 2, 3):
            worker.weights.start("target", version, out.get(timeout=120))
            worker.weights.update()
            assert worker.weights.finish(out.get(timeout=120)).report.ok
            backend = worker.weights.receiver.backend
            seen.append((backend.layouts_received, backend.importer.opened_total, backend.direct_plans_built))
            state = perturbed(model_dir, 1)
            expected = state if version < 3 else {n: t + 0.5 for n, t in state.items()}
            ref = loader_digests(model_dir, expected, tmp_path / f"ref{version}")
            assert worker.weights.checksums() == ref, f"version {version}: params differ from the loader's"
            inbox.put("next")
        assert seen[0][0] == 1 and seen[1] == seen[0], "an unchanged layout was sent or applied again"
        assert seen[2][0] == 2 and seen[2][1] > seen[0][1] and seen[2][2] == 2, "a changed layout was not used"
        worker.weights.close_transfer()
        inbox.put("bye")
    finally:
        proc.join(timeout=60)
    assert proc.exitcode == 0


def test_gloo_into_a_cuda_worker(model_dir: Path, tmp_path: Path) -> None:
    worker = cuda_worker(model_dir)
    state = perturbed(model_dir, 3)
    assert Link(worker).sync(state, 1).report.ok
    assert worker.weights.checksums() == loader_digests(model_dir, state, tmp_path / "ref")
    assert all(k.startswith(RANK) for k in worker.weights.checksums())
