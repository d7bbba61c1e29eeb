"""FP8 syncs on a GPU: a trainer process sends its CUDA tensors over ipc (direct and packed) to an FP8 rank on
the same GPU, quantized on send (the payload) or on receive; either way the rank installs exactly the bytes
a rank quantizing the same bf16 tensors on receive (on its GPU, from host tensors over gloo, the sender a
CPU trainer) installs, and both ranks check every installed tensor, before going live, against the
expected installed digests the sender computed on its own device (the rule is bit-exact across devices).
Skipped without a GPU. On the CPU: tests/test_fp8_send.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from inference.config import EngineConfig
from inference.engine.worker import Worker
from tests.helpers_weight_update import DIMS, Link, perturbed
from tests.test_fp8_send import installed_bytes

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from inference.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("fp8-send-cuda") / "target", "qwen2", dtype="bfloat16", **DIMS)


def _fp8_worker(model_dir: Path) -> Worker:
    worker = Worker(EngineConfig(model=str(model_dir), device="cuda", dtype="bfloat16", quantization="fp8"))
    worker.init_device()
    worker.load_model()
    return worker


def _ipc_fp8_sender(out: Any, inbox: Any, model_dir: str, mode: str, send_fp8: bool) -> None:
    from inference.transfer.sender import WeightSender

    torch.cuda.set_device(0)
    sender = WeightSender("ipc", bucket_bytes=1 << 20, timeout_s=60, device="cuda:0", ipc_mode=mode,
                          send_fp8=send_fp8)
    out.put(sender.init_info())
    sender.connect()
    state = {n: t.to("cuda:0") for n, t in perturbed(Path(model_dir), 1, torch.bfloat16).items()}
    out.put(sender.manifest(state, 1))
    sender.send(state, deliver_digests=True)
    out.put(dict(sender.last_sync))
    inbox.get(timeout=120)  # the receiver released its mappings
    sender.close()


@pytest.mark.parametrize("send_fp8", [True, False])
@pytest.mark.parametrize("mode", ["direct", "packed"])
def test_a_gpu_trainers_fp8_sync_installs_the_receive_side_bytes_checked_before_going_live(
        model_dir: Path, mode: str, send_fp8: bool) -> None:
    on_send, on_receive = _fp8_worker(model_dir), _fp8_worker(model_dir)
    ctx = mp.get_context("spawn")
    out, inbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_ipc_fp8_sender, args=(out, inbox, str(model_dir), mode, send_fp8))
    proc.start()
    try:
        on_send.weights.init_transfer(out.get(timeout=120))
        on_send.weights.start("target", 1, out.get(timeout=120))
        result = on_send.weights.finish(on_send.weights.update(digests_follow=True))
        assert result.report.ok and out.get(timeout=120)["fp8"] == send_fp8
        assert result.installed_checked == len(result.installed) > 0  # the GPU trainer's rule, checked here
        on_send.weights.close_transfer()
        inbox.put("released")
        proc.join(60)
        assert proc.exitcode == 0
        state = perturbed(model_dir, 1, torch.bfloat16)  # the same tensors, on the host
        link = Link(on_receive)
        assert link.sync(state, 1, deliver=True).installed_checked == len(result.installed)  # the CPU's rule
        assert installed_bytes(on_send) == installed_bytes(on_receive)
        link.sender.close()
    finally:
        if proc.is_alive():
            proc.kill()
        on_send.shutdown()
        on_receive.shutdown()
