"""Launch a real `sidecar launch` subprocess on a free port for tests, and always clean it up."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KV_BYTES = 4_000_000  # ~160 blocks of the tiny model: room for 64 short requests at once
START_TIMEOUT_S = 120.0


@dataclass
class Sidecar:
    proc: subprocess.Popen
    url: str
    log_path: Path

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        """Signal the sidecar and wait for it; kill it (and fail loudly later) if it hangs."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
                raise AssertionError(f"sidecar did not stop within {timeout} s after signal {sig}") from None
        return int(self.proc.returncode)


def launch(*args: str, env: dict[str, str] | None = None, timeout: float = START_TIMEOUT_S) -> Sidecar:
    """Start `sidecar launch --port 0 --device cpu ...` and wait for its "serving on" line."""
    cmd = [sys.executable, "-m", "sidecar.cli", "launch", "--port", "0", "--device", "cpu",
           "--kv-cache-bytes", str(KV_BYTES), "--log-level", "warning", *args]
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    full_env = {**os.environ, "PYTHONPATH": path, **(env or {})}
    log = Path(tempfile.mkstemp(prefix="sidecar-test-", suffix=".log")[1])
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=err, text=True)
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout
    try:
        while True:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            if line is None:
                raise AssertionError(f"sidecar exited with {proc.wait(10)} before serving:\n{log.read_text()}")
            match = re.search(r"Sidecar serving on (http://\S+)", line)
            if match:
                return Sidecar(proc, match.group(1), log)
    except BaseException:
        proc.kill()
        proc.wait(10)
        raise


def pid_exists(pid: int) -> bool:
    """True if a process (not a zombie) with this pid exists."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status


def cmdline(pid: int) -> str:
    try:
        return f"{pid}: " + Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except FileNotFoundError:
        return f"{pid}: gone"


def child_pids(pid: int) -> list[int]:
    """Pids whose parent is `pid` (rank processes, multiprocessing's resource tracker)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, IndexError, ProcessLookupError):
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def port_is_free(url: str) -> bool:
    import socket

    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.socket() as s:
        try:
            s.bind((host, int(port)))
        except OSError:
            return False
    return True
