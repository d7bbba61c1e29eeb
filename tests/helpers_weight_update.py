"""Shared pieces of the weight-update tests (tests/test_weight_update*.py): two tiny checkpoints, a
trainer-like perturbed state, what the loader makes of it, and an in-process sender linked to a Worker."""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from checksum import digest_tensors
from inference.config import EngineConfig
from inference.engine.worker import Worker
from inference.models import build_model
from inference.models.hf_config import read_model_config
from inference.models.loader import iter_hf_tensors, load_weights
from inference.models.tiny import make_tiny_model
from inference.parallel import TPInfo
from inference.transfer.sender import WeightSender
from inference.weights.state import UpdateResult

DIMS = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=96)
BUCKET = 16 << 10  # the 128 KiB embedding spans 8 buckets
RANK = "dp0:pp0:tp0"
Q1 = "model.layers.1.self_attn.q_proj.weight"


def tiny_model_dirs(root: Path) -> dict[str, Path]:
    """The target (Qwen2: tied, qkv bias) and draft (Llama: untied) checkpoints under root."""
    return {"target": make_tiny_model(root / "target", "qwen2", **DIMS),
            "draft": make_tiny_model(root / "draft", "llama", seed=1, **DIMS)}


def perturbed(model_dir: Path, seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors plus seeded noise: what a trainer holds after an optimizer step."""
    gen = torch.Generator().manual_seed(seed)
    return {n: (t + 0.01 * torch.randn(t.shape, generator=gen)).to(dtype) for n, t in iter_hf_tensors(model_dir)}


def loader_digests(model_dir: Path, state: dict[str, torch.Tensor], out: Path, tp: TPInfo | None = None,
                   rank: str = RANK) -> dict[str, str]:
    """What the loader makes of `state` (saved as a checkpoint), as compute_weight_checksums keys."""
    if not out.exists():
        shutil.copytree(model_dir, out)
        save_file({n: t.contiguous() for n, t in state.items()}, str(out / "model.safetensors"))
    model = build_model(read_model_config(out), tp or TPInfo(), torch.float32, "cpu")
    load_weights(model, out)
    return {f"{rank}:{r.name}": r.digest for r in digest_tensors(list(model.named_parameters()))}


def make_worker(dirs: dict[str, Path], draft: bool = True) -> Worker:
    worker = Worker(EngineConfig(model=str(dirs["target"]), draft_model=str(dirs["draft"]) if draft else None,
                                 device="cpu", dtype="float32"))
    worker.init_device()
    worker.load_model()
    return worker


class Link:
    """A sender on this process, connected to `worker` (the sender's calls run on a thread)."""

    def __init__(self, worker: Worker, bucket_bytes: int = BUCKET, timeout_s: float = 20.0,
                 digest_algorithm: str | None = None, delta: bool = False, send_fp8: bool = False,
                 check_installed: bool = True) -> None:
        self.worker = worker
        self.sender = WeightSender("gloo", bucket_bytes=bucket_bytes, timeout_s=timeout_s,
                                   digest_algorithm=digest_algorithm, delta=delta, send_fp8=send_fp8,
                                   check_installed=check_installed)
        info = self.sender.init_info()
        with ThreadPoolExecutor(1) as pool:
            connecting = pool.submit(self.sender.connect)
            worker.weights.init_transfer(info)
            connecting.result(timeout=30)

    def sync(self, state: dict[str, torch.Tensor], version: int, which: str = "target",
             allow_cast: bool = False, sent: dict[str, torch.Tensor] | None = None,
             held_manifest: bool = False, fp8: bool | None = None, deliver: bool = False) -> UpdateResult:
        """start, send beside update, finish. `deliver`: the sync's digests (and an FP8 rank's expected
        installed digests) travel in the sync, as the sidecar's one protocol has it; else finish takes the
        records send() returned (the two-call way)."""
        manifest = self.sender.manifest(state, version, fp8=fp8)
        self.worker.weights.start(which, version, manifest, allow_cast=allow_cast)
        digests = self.transfer(sent if sent is not None else state, deliver=deliver)
        return self.worker.weights.finish(digests, held_manifest=held_manifest)

    def transfer(self, state: dict[str, torch.Tensor], deliver: bool = False) -> Any:
        """send() beside update_weights(); the receiver's error wins, then the sender's. Returns the sender's
        records, or with `deliver` what update returned (the delivered digests)."""
        with ThreadPoolExecutor(1) as pool:
            sending = pool.submit(self.sender.send, state, deliver_digests=deliver)
            try:
                delivered = self.worker.weights.update(digests_follow=deliver)
            finally:
                sender_error = sending.exception(timeout=60)
        if sender_error is not None:
            raise sender_error
        return delivered if deliver else sending.result()


def held(worker: Worker, which: str = "target") -> dict[str, str]:
    return worker.weights.checksums(which)


def sparse_step(state: dict[str, torch.Tensor], seed: int, least: int = 1) -> dict[str, torch.Tensor]:
    """A few elements of every tensor changed (2%, at least `least`): what a small optimizer step does to
    low-precision weights, the shape of step a delta sync is for."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        t = t.clone()
        flat = t.view(-1)
        flat[torch.randperm(flat.numel(), generator=gen)[:max(least, flat.numel() // 50)]] += 0.5
        out[name] = t
    return out
