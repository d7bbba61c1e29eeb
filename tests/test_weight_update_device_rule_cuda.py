"""The device rule on a GPU: ipc syncs between two processes are audited by one kernel launch per end (no
byte of a CUDA tensor staged through host memory), equal python-xxhash on the CPU, and a byte flipped on
the sender's side or in a rank's held weights fails the audit naming tensor and rank; the sidecar on CUDA
syncs, answers GET /checksums by the device rule by default and by the other rule when asked, and warms
the kernel up at start. Skipped without a GPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

import inference.transfer.digests as sync_digests
from checksum import ALGORITHM, DEVICE_ALGORITHM, ChecksumMismatch, digest_bytes, flat_bytes
from inference.config import EngineConfig
from inference.engine.worker import Worker
from tests.helpers_fault import flip_held_after_landing
from tests.helpers_weight_update import DIMS, Q1, RANK, Link, perturbed

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from inference.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("wudc") / "target", "qwen2", **DIMS)


def cuda_worker(model_dir: Path) -> Worker:
    worker = Worker(EngineConfig(model=str(model_dir), device="cuda", dtype="float32"))
    worker.init_device()
    worker.load_model()
    return worker


def python_xxhash(state: dict[str, torch.Tensor]) -> dict[str, str]:
    return {n: digest_bytes(flat_bytes(t.cpu()).numpy().tobytes(), DEVICE_ALGORITHM) for n, t in state.items()}


def no_host_staging(monkeypatch: pytest.MonkeyPatch) -> None:
    """The host path of the sync's digests may see CPU tensors only."""
    real = sync_digests.digest_tensors

    def host_only(items: Any, **kwargs: Any) -> Any:
        assert all(t.device.type == "cpu" for _, t in items), "a CUDA tensor was hashed through host memory"
        return real(items, **kwargs)

    monkeypatch.setattr(sync_digests, "digest_tensors", host_only)


def _sender(out: Any, inbox: Any, model_dir: str, mode: str, flip: bool, deliver: bool) -> None:
    """A trainer on the same GPU; with `flip`, it writes one byte of Q1 right after hashing it; with
    `deliver`, its digests also go to the rank in the sync (inference/transfer/delivery.py)."""
    from inference.transfer.sender import WeightSender

    torch.cuda.set_device(0)
    sender = WeightSender("ipc", bucket_bytes=16 << 10, timeout_s=60, device="cuda:0", ipc_mode=mode)
    out.put(sender.init_info())
    sender.connect()
    params = {n: t.cuda() for n, t in perturbed(Path(model_dir), 1).items()}
    if flip:
        real = sender._digests.launch

        def then_flip(*args: Any, **kwargs: Any) -> Any:
            pending = real(*args, **kwargs)
            pending.result()  # hashed; packing (after this returns) reads the flipped byte
            flat_bytes(params[Q1])[:1].bitwise_xor_(1)
            return pending

        sender._digests.launch = then_flip  # type: ignore[method-assign]
    for version in (1, 2):
        out.put(sender.manifest(params, version))
        records = sender.send(params, deliver_digests=deliver)
        out.put(([r.__dict__ for r in records], sender.algorithm, sender._digests._device.cached_layouts))
        if inbox.get(timeout=120) == "stop":
            break
    inbox.get(timeout=120)
    sender.close()


def _run(model_dir: Path, mode: str, flip: bool, monkeypatch: pytest.MonkeyPatch, deliver: bool = False) -> list[Any]:
    worker = cuda_worker(model_dir)
    no_host_staging(monkeypatch)
    ctx = mp.get_context("spawn")
    out, inbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_sender, args=(out, inbox, str(model_dir), mode, flip, deliver))
    proc.start()
    outcomes: list[Any] = []
    try:
        worker.weights.init_transfer(out.get(timeout=120))
        for version in (1, 2):
            manifest = out.get(timeout=120)
            assert manifest["algorithm"] == DEVICE_ALGORITHM
            worker.weights.start("target", version, manifest)
            delivered = worker.weights.update(digests_follow=deliver)
            records, algorithm, layouts = out.get(timeout=120)
            if deliver:  # the same digests, over the group instead of through the test's queue
                assert delivered == {"algorithm": algorithm, "digests": [r["digest"] for r in records]}
            try:
                outcomes.append((worker.weights.finish(delivered if deliver else records), algorithm, layouts))
            except ChecksumMismatch as e:
                outcomes.append(e)
                inbox.put("stop")
                break
            inbox.put("next")
        worker.weights.close_transfer()
        inbox.put("bye")
    finally:
        proc.join(timeout=60)
    assert proc.exitcode == 0
    return outcomes


@pytest.mark.parametrize("deliver", [False, True])
def test_ipc_direct_syncs_are_audited_on_the_device_at_both_ends(model_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                                deliver: bool) -> None:
    outcomes = _run(model_dir, "direct", False, monkeypatch, deliver)
    want = python_xxhash(perturbed(model_dir, 1))
    for result, algorithm, layouts in outcomes:
        assert result.report.ok and algorithm == DEVICE_ALGORITHM == result.received.algorithm
        assert {r.name: r.digest for r in result.received.records} == want
        assert layouts == 1, "the sender's segment table was rebuilt for an unchanged layout"


@pytest.mark.parametrize("deliver", [False, True])
def test_a_byte_flipped_on_the_senders_side_fails_naming_tensor_and_rank(model_dir: Path,
                                                                        monkeypatch: pytest.MonkeyPatch,
                                                                        deliver: bool) -> None:
    (error,) = _run(model_dir, "packed", True, monkeypatch, deliver)
    first = error.report.first_tensor
    assert (first.kind, first.tensor, first.rank) == ("digest", Q1, RANK) and Q1 in str(error)


def test_a_byte_flipped_in_held_cuda_weights_fails_naming_tensor_and_rank(model_dir: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU sender computes the device rule on the host; the CUDA rank hashes with the kernel."""
    worker = cuda_worker(model_dir)
    no_host_staging(monkeypatch)
    link = Link(worker, digest_algorithm=DEVICE_ALGORITHM)
    assert link.sync(perturbed(model_dir, 2), 1).report.ok  # host rule == kernel on the same bytes
    qkv = dict(worker.models["target"].named_parameters())["model.layers.1.self_attn.qkv_proj.weight"]
    flip_held_after_landing(monkeypatch, worker.weights, qkv)  # the first byte of the q rows: Q1
    state = perturbed(model_dir, 3)
    worker.weights.start("target", 2, link.sender.manifest(state, 2))
    digests = link.transfer(state)
    with pytest.raises(ChecksumMismatch) as err:
        worker.weights.finish(digests)
    first = err.value.report.first_tensor
    assert (first.kind, first.tensor, first.rank) == ("digest", Q1, RANK) and worker.weights.torn["target"]


def test_the_engine_warms_the_kernel_up_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    from inference.engine.llm import LLM

    warmed: list[torch.device] = []
    real = sync_digests.RecordDigests.warm_up
    monkeypatch.setattr(sync_digests.RecordDigests, "warm_up",
                        lambda self, device: warmed.append(device) or real(self, device))
    LLM(device="cuda", kv_cache_bytes=64 << 20)
    assert [d.type for d in warmed] == ["cuda"]


def test_sidecar_on_cuda_syncs_and_answers_checksums_by_either_rule(tmp_path: Path) -> None:
    from inference.engine.llm import LLM
    from inference.models.tiny import TinyModelSpec, random_weights, write_model_dir
    from inference.transfer.sender import WeightSender
    from sidecar.client import SidecarClient
    from tests.helpers_sidecar import KV_BYTES, launch

    spec = TinyModelSpec(seed=5)
    reference = LLM(write_model_dir(spec, tmp_path / "v1"), device="cuda", kv_cache_bytes=KV_BYTES)
    params = dict(reference.worker.models["target"].named_parameters())
    server = launch("--device", "cuda")
    sender = WeightSender("ipc", num_receivers=1, timeout_s=120, device="cuda:0")
    try:
        with SidecarClient(server.url, timeout=120) as c:
            c.connect_sender(sender)
            new = {k: v.to("cuda:0") for k, v in random_weights(spec).items()}
            for version in (1, 2):
                result = c.sync_weights(sender, new, version=version, allow_cast=True)
                assert result["ok"] and result["algorithm"] == DEVICE_ALGORITHM, result["table"]
            (held,) = c.checksums()
            assert held["algorithm"] == DEVICE_ALGORITHM
            assert {t["name"]: t["digest"] for t in held["tensors"]} == python_xxhash(params)
            (old,) = c.checksums(algorithm=ALGORITHM)
            assert old["algorithm"] == ALGORITHM and old["tensors"] != held["tensors"]
    finally:
        sender.close()
        assert server.stop() == 0, server.log
