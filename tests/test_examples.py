"""The examples run as written: each in a subprocess against a real `sidecar launch --model DIR` on the tiny
model. examples/hf_trainer.py, grpo_tutorial.py and grpo_partial.py on the CPU (the dev extra brings transformers
and accelerate); examples/deepspeed_grpo.py on a GPU shared with the sidecar (the deepspeed extra, --sender ipc)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from inference.models.tiny import make_tiny_model
from tests.helpers_sidecar import REPO, launch
from tests.helpers_tp import free_port


def _env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path}


def _run_example(tmp_path: Path, script: str, *args: str) -> subprocess.CompletedProcess[str]:
    """examples/`script` --url --model against a CPU `sidecar launch` of the tiny model, which must stop
    cleanly afterwards."""
    model = make_tiny_model(tmp_path / "model")
    server = launch("--model", str(model))
    try:
        proc = subprocess.run([sys.executable, f"examples/{script}", "--url", server.url, "--model", str(model),
                               *args], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    finally:
        code = server.stop()
    assert code == 0, server.log + proc.stdout + proc.stderr  # the sidecar stopped cleanly after the example
    return proc


@pytest.mark.slow
def test_hf_trainer_example_syncs_every_step(tmp_path: Path) -> None:
    proc = _run_example(tmp_path, "hf_trainer.py", "--steps", "3")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # one sync (and audit) per optimizer step: the rollout after training comes from version 3
    assert proc.stdout.strip().splitlines()[-1].startswith("weight version 3: "), proc.stdout


@pytest.mark.slow
def test_grpo_partial_example_trains_on_the_first_groups_and_carries_the_tail(tmp_path: Path) -> None:
    proc = _run_example(tmp_path, "grpo_partial.py", "--steps", "3", "--groups", "3", "--oversample", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr  # the example asserts no group came back twice
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    # its own weights synced before the first rollouts (sync_on_attach), then one sync per step; min_groups each
    assert summary["version"] == 4 and summary["groups"] == 9, summary
    assert sum(summary["staleness_samples"].values()) == 9 * 4
    left = summary["left"]
    assert left["pending"] + left["finished"] == 2 and left["failed"] == 0, left  # the over-sampled tail waits


@pytest.mark.slow
def test_grpo_tutorial_example_syncs_after_every_step(tmp_path: Path) -> None:
    """docs/tutorial-grpo.md's loop as written: each step's rollouts come from the weights the last step synced."""
    proc = _run_example(tmp_path, "grpo_tutorial.py", "--steps", "2", "--samples", "4", "--max-tokens", "8")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    summary = json.loads(lines[-1])
    assert len(summary["rewards"]) == 2 and all(0.0 <= r <= 1.0 for r in summary["rewards"]), summary
    # a sync (with its audit) after every optimizer step: the second step's rollouts are the first step's weights
    synced = [int(line.rsplit("now version ", 1)[1]) for line in lines[:-1]]
    assert synced == [summary["version"] - 1, summary["version"]], proc.stdout
    assert f"rollouts from version {synced[0]}," in lines[1], proc.stdout


@pytest.mark.cuda
def test_deepspeed_example_trains_with_zero3_on_one_gpu(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    model = make_tiny_model(tmp_path / "model", dtype="bfloat16")
    server = launch("--model", str(model), "--device", "cuda")
    env = {**_env(), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    try:
        proc = subprocess.run([sys.executable, "examples/deepspeed_grpo.py", "--url", server.url, "--model",
                               str(model), "--steps", "2", "--samples", "2", "--sender", "ipc"], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=600)
    finally:
        code = server.stop()
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "weight version 2 after 2 steps" in proc.stdout, proc.stdout[-4000:]
    assert code == 0, server.log


@pytest.mark.slow
def test_deepspeed_example_step_takes_samples_of_different_lengths(tmp_path: Path) -> None:
    """The GRPO step pads a group's samples (they stop at different lengths) and masks the padding out:
    the loss is the mean over completion tokens only, so padding never changes a gradient."""
    import importlib.util
    from types import SimpleNamespace

    import torch
    from transformers import AutoModelForCausalLM

    spec = importlib.util.spec_from_file_location("deepspeed_grpo", REPO / "examples" / "deepspeed_grpo.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    model = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "model"), dtype=torch.float32)

    class Engine:  # the three things _grpo_step uses of a DeepSpeed engine
        device = torch.device("cpu")

        def __call__(self, ids: torch.Tensor, attention_mask: torch.Tensor) -> object:
            return model(ids, attention_mask=attention_mask)

        def backward(self, loss: torch.Tensor) -> None:
            loss.backward()

        def step(self) -> None:
            pass

    prompt, digits = [5, 6, 7], {9}
    samples = [[9, 3, 9, 4, 9], [2, 9], [4, 4, 9, 4]]  # stopped at different lengths

    model.zero_grad()
    outs = [SimpleNamespace(token_ids=t) for t in samples]
    example._grpo_step(Engine(), [SimpleNamespace(prompt_token_ids=prompt, outputs=outs)], digits)
    padded = [p.grad.clone() for p in model.parameters()]

    # the same loss, one unpadded sample at a time: -sum(adv * logp over completion tokens) / their count
    model.zero_grad()
    r = torch.tensor([example.reward(t, digits) for t in samples])
    adv = r - r.mean()
    loss = torch.zeros(())
    for t, a in zip(samples, adv, strict=True):
        ids = torch.tensor([prompt + t])
        logits = model(ids[:, :-1]).logits.float()[:, len(prompt) - 1:]
        loss = loss - a * torch.log_softmax(logits, -1).gather(-1, ids[:, len(prompt):, None]).sum()
    (loss / sum(map(len, samples))).backward()
    assert any(p.grad.abs().sum() > 0 for p in model.parameters())
    for got, want in zip(padded, (p.grad for p in model.parameters()), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
