"""`sidecar demo`: the end-to-end RL loop on CPU (gloo) finishes, every sync passes its audit, the sidecar's
logprobs equal the trainer's recomputed ones, and the reward rises; `--model DIR` trains that directory's
weights on the id reward; on a GPU, the Qwen2-0.5B shape runs with the ipc backend."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from inference.models.tiny import TinyModelSpec, default_model_dir, weight_shapes, write_model_dir
from sidecar.demo.task import QWEN2_05B, TARGET_EVERY, DemoModel, kv_cache_bytes, make_prompts, make_reward
from tests.helpers_plot import plotted_points

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_demo_trains_syncs_audits_and_the_reward_rises(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, "-m", "sidecar.cli.main", "demo", "--steps", "5", "--device", "cpu",
                           "--plot", str(tmp_path / "run.png")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ok"] and result["backend"] == "gloo"
    assert result["audits"] == ["ok"] * 5 and result["versions"] == [0, 1, 2, 3, 4, 5]
    assert result["logprob_max_abs_diff"] < 1e-3  # rollouts came from exactly the trainer's weights
    assert result["reward_last"] > result["reward_first"] + 0.2, result["rewards"]
    table = proc.stdout.splitlines()[0].split()
    assert table == ["step", "reward", "sync_ms", "audit", "sleep_ms", "wake_ms", "version"]
    # --plot: a PNG with matplotlib, else the SVG beside it; either way one point per step, the run's numbers
    plot = Path(result["plot"])
    assert plot.parent == tmp_path and plot.name in ("run.png", "run.svg") and plot.is_file()
    points = plotted_points(plot)
    assert points["reward"] == list(enumerate(result["rewards"]))
    assert all([s for s, _ in points[k]] == [1, 2, 3, 4, 5] for k in ("sync_ms", "audit_ms", "sleep_ms", "wake_ms"))


def _run_demo(*args: str, home: Path | None = None, timeout: float = 300) -> tuple[subprocess.CompletedProcess, dict]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    if home is not None:
        env["SIDECAR_HOME"] = str(home)
    proc = subprocess.run([sys.executable, "-m", "sidecar.cli.main", "demo", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_demo_on_a_model_directory_uses_its_weights_and_the_id_reward(tmp_path: Path) -> None:
    spec = TinyModelSpec(family="llama", vocab_size=1024, num_layers=2)  # untied, ids past the tokenizer
    model = write_model_dir(spec, tmp_path / "llama")
    proc, result = _run_demo("--model", str(model), "--steps", "2", "--device", "cpu", "--batch", "4")
    assert result["ok"] and result["model"] == str(model) and result["reward_kind"] == "ids"
    assert result["params"] == sum(math.prod(s) for s in weight_shapes(spec).values())
    settings = (result["dtype"], result["backend"], result["rollouts_per_step"], result["lr"])
    assert settings == ("float32", "gloo", 32, 1e-3)
    assert result["audits"] == ["ok"] * 2 and result["versions"] == [0, 1, 2]
    assert result["logprob_max_abs_diff"] < 1e-3
    assert all(0.0 <= r <= 1.0 for r in result["rewards"])
    assert result["sync_ms_median"] > result["audit_ms_median"] > 0 and result["sleep_ms_median"] > 0
    assert [line.split()[0] for line in proc.stdout.splitlines()[2:5]] == ["0", "1", "2"]


def test_demo_task_ids_reward_prompts_and_the_qwen2_05b_shape() -> None:
    assert sum(math.prod(s) for s in weight_shapes(QWEN2_05B).values()) == 494_032_768  # Qwen2-0.5B's count
    model = DemoModel("x", Path("x"), "bfloat16", 151936, kv_bytes_per_token=12288)
    reward = make_reward("auto", model)
    assert reward.kind == "ids" and len(reward.targets) == 151936 // TARGET_EVERY
    assert reward([0, 16, 17, 151920]) == 0.75 and reward([]) == 0.0
    prompts = make_prompts(reward, model, batch=64, length=8, seed=3)
    assert prompts == make_prompts(reward, model, batch=64, length=8, seed=3)
    ids = [t for p in prompts for t in p]
    assert len(prompts) == 64 and min(ids) >= 4 and max(ids) < 151936 and max(ids) > 100_000
    assert kv_cache_bytes(model, "cuda", 64, 16) == 64 * 2**20  # the floor: 64 x 2 blocks x 16 x 12 KB x 2 < 64 MiB
    assert kv_cache_bytes(model, "cuda", 4096, 64) == 2 * 4096 * 5 * 16 * 12288


def test_demo_rejects_bad_arguments_before_launching(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from sidecar.cli.main import main

    assert main(["demo", "--model", str(tmp_path / "missing")]) == 2
    assert "model" in capsys.readouterr().err
    assert main(["demo", "--device", "cpu", "--backend", "ipc"]) == 2
    assert "--backend ipc" in capsys.readouterr().err
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 64}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert main(["demo", "--model", str(tmp_path), "--device", "cpu"]) == 2
    assert "lacks the field 'num_attention_heads'" in capsys.readouterr().err
    shutil.copy(default_model_dir() / "config.json", tmp_path / "config.json")  # valid, but no tokenizer.json
    assert main(["demo", "--model", str(tmp_path), "--reward", "digits", "--device", "cpu"]) == 2
    assert "--reward ids" in capsys.readouterr().err


@pytest.mark.cuda
def test_demo_on_the_qwen2_05b_shape_with_ipc(tmp_path: Path) -> None:
    _, result = _run_demo("--model", "qwen2-0.5b", "--device", "cuda", "--backend", "ipc", "--steps", "3",
                          home=tmp_path, timeout=540)
    assert result["ok"] and result["model"] == "qwen2-0.5b" and result["params"] == 494_032_768
    assert (result["device"], result["backend"], result["dtype"]) == ("cuda", "ipc", "bfloat16")
    assert result["audits"] == ["ok"] * 3 and result["versions"] == [0, 1, 2, 3]


@pytest.mark.slow
def test_demo_in_fp8_rolls_out_quantized_audits_and_still_learns() -> None:
    """--quantization fp8: the sidecar rolls out from FP8 weights while the trainer trains in fp32; every
    sync passes both audits, the gap shows, and the reward still rises."""
    proc, result = _run_demo("--steps", "5", "--device", "cpu", "--quantization", "fp8")
    assert result["ok"] and result["quantization"] == "fp8" and result["audits"] == ["ok"] * 5
    assert result["logprob_max_abs_diff"] > 1e-3  # the rollouts are not the trainer's exact numbers any more
    assert result["reward_last"] > result["reward_first"] + 0.2, result["rewards"]
    assert "gap_max" in proc.stdout
