"""Delta syncs on a GPU: ipc between two processes sharing one GPU (direct and packed), the delta applied
on the device and audited against the full tensors; gloo from host tensors into a CUDA worker. Skipped
without a GPU. On the CPU: tests/test_delta_sync.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from inference.config import EngineConfig
from inference.engine.worker import Worker
from tests.helpers_weight_update import DIMS, Link, perturbed

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from inference.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("delta-cuda") / "target", "qwen2", **DIMS)


def _cuda_worker(model_dir: Path) -> Worker:
    worker = Worker(EngineConfig(model=str(model_dir), device="cuda", dtype="float32"))
    worker.init_device()
    worker.load_model()
    return worker


def _steps(model_dir: Path, device: str) -> list[dict[str, torch.Tensor]]:
    """Three versions; each after the first changes about 2% of every tensor's elements."""
    state = {n: t.to(device) for n, t in perturbed(model_dir, 1).items()}
    out = [state]
    gen = torch.Generator().manual_seed(2)
    for _ in range(2):
        state = {n: t.clone() for n, t in state.items()}
        for t in state.values():
            flat = t.view(-1)
            flat[torch.randperm(flat.numel(), generator=gen)[:max(1, flat.numel() // 50)].to(device)] += 0.5
        out.append(state)
    return out


def _ipc_sender(out: Any, inbox: Any, model_dir: str, mode: str) -> None:
    from inference.transfer.sender import WeightSender

    torch.cuda.set_device(0)
    sender = WeightSender("ipc", bucket_bytes=1 << 20, timeout_s=60, device="cuda:0", ipc_mode=mode, delta=True)
    out.put(sender.init_info())
    sender.connect()
    for version, state in enumerate(_steps(Path(model_dir), "cuda:0"), start=1):
        out.put(sender.manifest(state, version))
        sender.send(state, deliver_digests=True)
        out.put(sender.last_sync["mode"])
        inbox.get(timeout=120)
    inbox.get(timeout=120)  # the receiver released its mappings
    sender.close()


@pytest.mark.parametrize("mode", ["direct", "packed"])
def test_ipc_delta_between_two_processes_on_one_gpu(model_dir: Path, mode: str) -> None:
    worker = _cuda_worker(model_dir)
    ctx = mp.get_context("spawn")
    out, inbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_ipc_sender, args=(out, inbox, str(model_dir), mode))
    proc.start()
    try:
        worker.weights.init_transfer(out.get(timeout=120))
        modes = []
        for version, state in enumerate(_steps(model_dir, "cpu"), start=1):
            worker.weights.start("target", version, out.get(timeout=120))
            delivered = worker.weights.update(digests_follow=True)
            assert worker.weights.finish(delivered).report.ok  # the full tensors' digests
            modes.append(out.get(timeout=120))
            params = dict(worker.models["target"].named_parameters())
            assert torch.equal(params["model.norm.weight"].detach().cpu(), state["model.norm.weight"])
            inbox.put("audited")
        assert modes == ["full", "delta", "delta"]
        worker.weights.close_transfer()
        inbox.put("released")
        proc.join(60)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
        worker.shutdown()


def test_gloo_delta_from_host_tensors_into_a_cuda_worker(model_dir: Path) -> None:
    worker = _cuda_worker(model_dir)
    link = Link(worker, delta=True)
    try:
        modes = []
        for version, state in enumerate(_steps(model_dir, "cpu"), start=1):
            assert link.sync(state, version).report.ok
            modes.append(link.sender.last_sync["mode"])
        assert modes == ["full", "delta", "delta"]
    finally:
        link.sender.close()
        worker.shutdown()
