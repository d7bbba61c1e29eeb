"""A `sidecar launch` child process for the dev tools (fault_load, creep): started, its URL read from
its serving line, its stdout drained afterwards so the sidecar never blocks on a full pipe."""

from __future__ import annotations

import re
import subprocess
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SERVING = re.compile(r"Sidecar serving on (http://\S+)")  # sidecar/cli/launch.py SERVING_LINE


def start_sidecar(cmd: list[str]) -> tuple[subprocess.Popen, str]:
    """Run `cmd` from the repository root; (the process, its URL) once it serves. RuntimeError with the
    exit status if it ended first."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert proc.stdout is not None
    for line in proc.stdout:
        match = SERVING.search(line)
        if match:
            threading.Thread(target=proc.stdout.read, daemon=True).start()  # drain, never block the sidecar
            return proc, match.group(1)
    raise RuntimeError(f"sidecar exited with {proc.wait()} before serving")
