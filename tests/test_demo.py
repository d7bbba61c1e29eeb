"""`sidecar demo`: the end-to-end RL loop on CPU (gloo) finishes, every sync passes its audit, the sidecar's
logprobs equal the trainer's recomputed ones, and the reward rises."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_demo_trains_syncs_audits_and_the_reward_rises() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, "-m", "sidecar.cli", "demo", "--steps", "5", "--device", "cpu"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ok"] and result["backend"] == "gloo"
    assert result["audits"] == ["ok"] * 5 and result["versions"] == [0, 1, 2, 3, 4, 5]
    assert result["logprob_max_abs_diff"] < 1e-3  # rollouts came from exactly the trainer's weights
    assert result["reward_last"] > result["reward_first"] + 0.2, result["rewards"]
    table = proc.stdout.splitlines()[0].split()
    assert table == ["step", "reward", "sync_ms", "audit", "sleep_ms", "wake_ms", "version"]
