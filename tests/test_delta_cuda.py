"""Delta syncs on a GPU: ipc between two processes sharing one GPU (direct and packed), the delta applied
on the device and audited against the full tensors; gloo from host tensors into a CUDA worker; the device
codec gives the host codec's bytes, applies into TP slices, and syncs the host a fixed number of times
whatever the number of tensors. Skipped without a GPU. On the CPU: tests/test_delta_sync.py,
tests/test_delta_codec.py."""

from __future__ import annotations

import warnings
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from inference.config import EngineConfig
from inference.engine.worker import Worker
from inference.transfer.delta_codec import DeltaLayout, Slice, apply_delta, bits, encode_all, write_payload
from inference.transfer.plan import TensorSpec
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


def _changed(n: int, pattern: str, gen: torch.Generator) -> torch.Tensor:
    return {"scattered": torch.randperm(n, generator=gen)[:n // 35], "blocks": torch.arange(n // 4, n // 2),
            "none": torch.arange(0), "all": torch.arange(n)}[pattern]


def _states(count: int) -> tuple[list[TensorSpec], list[torch.Tensor], list[torch.Tensor]]:
    """`count` bf16 tensors (CPU) and their next version: scattered changes, a block, none, all."""
    gen = torch.Generator().manual_seed(count)
    specs, olds, news = [], [], []
    for i in range(count):
        old = torch.randn(1000 + 37 * i, generator=gen).to(torch.bfloat16)
        new = old.clone()
        flat = bits(new)
        idx = _changed(old.numel(), ("scattered", "blocks", "none", "all")[i % 4], gen)
        flat[idx] = flat[idx] ^ 1
        specs.append(TensorSpec(f"t{i}", "bfloat16", tuple(old.shape)))
        olds.append(old)
        news.append(new)
    return specs, olds, news


def _encoded_payload(specs: list[TensorSpec], olds: list[torch.Tensor],
                     news: list[torch.Tensor]) -> tuple[DeltaLayout, torch.Tensor]:
    encoded = encode_all(specs, [bits(n) for n in news], [bits(o) for o in olds])
    layout = DeltaLayout.from_codes(specs, [v for e in encoded for v in (e.enc, e.a, e.b)])
    payload = torch.zeros(layout.total, dtype=torch.uint8, device=news[0].device)
    for spec, enc, new, entry in zip(specs, encoded, news, layout.entries):
        if entry.nbytes:
            write_payload(spec, enc, bits(new), payload[entry.offset:entry.offset + entry.nbytes])
    return layout, payload


def test_the_device_codec_gives_the_host_codecs_bytes() -> None:
    specs, olds, news = _states(12)
    layout, payload = _encoded_payload(specs, olds, news)
    on_gpu = [t.cuda() for t in olds], [t.cuda() for t in news]
    gpu_layout, gpu_payload = _encoded_payload(specs, *on_gpu)
    assert gpu_layout == layout and torch.equal(gpu_payload.cpu(), payload)
    held = [t.clone() for t in on_gpu[0]]
    apply_delta(held, specs, gpu_layout, gpu_payload)
    assert all(torch.equal(h.cpu(), n) for h, n in zip(held, news))
    # a TP shard's rows and columns of a 2-D tensor
    full_old = olds[0][:960].view(24, 40).cuda()
    full_new = news[0][:960].view(24, 40).cuda()
    spec = TensorSpec("w", "bfloat16", (24, 40))
    one_layout, one_payload = _encoded_payload([spec], [full_old], [full_new])
    for sl in (Slice(0, 12, 12), Slice(1, 20, 20)):
        region = full_old.narrow(sl.dim, sl.start, sl.length).contiguous()
        apply_delta([region], [spec], one_layout, one_payload, [sl])
        assert torch.equal(region, full_new.narrow(sl.dim, sl.start, sl.length))


def _host_syncs(fn: Any) -> int:
    """How many synchronizing CUDA calls `fn` makes (torch's sync debug mode, counted as warnings)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchronizing" in str(w.message) for w in seen)


def test_the_device_codec_syncs_the_host_a_fixed_number_of_times_whatever_the_tensor_count() -> None:
    counts = []
    for count in (4, 40):
        specs, olds, news = _states(count)
        olds, news = [t.cuda() for t in olds], [t.cuda() for t in news]
        layout, payload = _encoded_payload(specs, olds, news)  # warm: allocator, kernels
        held = [t.clone() for t in olds]
        counts.append((_host_syncs(partial(_encoded_payload, specs, olds, news)),
                       _host_syncs(partial(apply_delta, held, specs, layout, payload))))
    assert counts[0] == counts[1], counts
    assert counts[0][0] <= 2 and counts[0][1] <= 1, counts
