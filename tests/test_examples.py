"""The examples run as written: each in a subprocess against a real `sidecar launch --model DIR` on the tiny
model. examples/hf_trainer.py on the CPU (the dev extra brings transformers and accelerate);
examples/deepspeed_grpo.py on a GPU shared with the sidecar (the deepspeed extra, --sender ipc)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from inference.tiny import make_tiny_model
from tests.helpers_sidecar import REPO, launch


def _env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path}


def test_hf_trainer_example_syncs_every_step(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "model")
    server = launch("--model", str(model))
    try:
        proc = subprocess.run([sys.executable, "examples/hf_trainer.py", "--url", server.url, "--model", str(model),
                               "--steps", "3"], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    finally:
        code = server.stop()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # one sync (and audit) per optimizer step: the rollout after training comes from version 3
    assert proc.stdout.strip().splitlines()[-1].startswith("weight version 3: "), proc.stdout
    assert code == 0, server.log


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.cuda
def test_deepspeed_example_trains_with_zero3_on_one_gpu(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    model = make_tiny_model(tmp_path / "model", dtype="bfloat16")
    server = launch("--model", str(model), "--device", "cuda")
    env = {**_env(), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    try:
        proc = subprocess.run([sys.executable, "examples/deepspeed_grpo.py", "--url", server.url, "--model",
                               str(model), "--steps", "2", "--samples", "2", "--sender", "ipc"], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=600)
    finally:
        code = server.stop()
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "weight version 2 after 2 steps" in proc.stdout, proc.stdout[-4000:]
    assert code == 0, server.log
