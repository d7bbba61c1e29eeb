"""What a parent needs of the processes it starts (rank processes, `sidecar launch` children of
`sidecar fleet`, the demo and a Ray replica): they die with it, and their stdout is read line by line.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import threading


def die_with_parent(parent_pid: int, sig: int = signal.SIGTERM) -> None:
    """In the child: ask Linux to send it `sig` when its parent dies (PR_SET_PDEATHSIG), so a killed
    parent leaves no orphan; exit at once if the parent died before the request took effect.
    Elsewhere nothing is asked (callers say what then ends the child)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)  # 1: PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() != parent_pid:
        os._exit(1)


def stdout_lines(proc: subprocess.Popen) -> queue.Queue[str | None]:
    """A queue of the child's stdout lines (None at its end), drained by a daemon thread."""
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        for line in proc.stdout or ():
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True, name=f"stdout-{proc.pid}").start()
    return lines
