"""Run a script of scripts/ as a user does (`python -m scripts.bench.<name> ...` from the repo root, in a child
process) and read the JSON lines it prints: the tests hold a benchmark to its output, never to its insides."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping

from tests.helpers_sidecar import REPO


def script_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The checkout first on the path; torch on one thread (on a 2-core box two contend many times slower)."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **(extra or {})}


def run_script(module: str, *args: str, timeout: float = 600,
               env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`python -m <module> args...` from the repo root; stdout and stderr captured."""
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=script_env(env), capture_output=True,
                          text=True, timeout=timeout)


def bench_lines(module: str, *args: str, timeout: float = 600, env: Mapping[str, str] | None = None) -> list[dict]:
    """The JSON lines a successful run printed (every stdout line must be one)."""
    proc = run_script(module, *args, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]


def refused(module: str, *args: str) -> str:
    """Run arguments the script must refuse before doing anything: exit status 2 (argparse); its stderr."""
    proc = run_script(module, *args, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    return proc.stderr
