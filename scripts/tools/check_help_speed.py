"""Measure `sidecar <cmd> --help` for every command: each must print in under a second.

    python scripts/tools/check_help_speed.py [--runs 5] [--limit 1.0]

Runs the installed `sidecar` script when it is on PATH (what a user types), else `python -m sidecar.cli.main`,
each command `--runs` times in a fresh process, and prints the median and worst wall time per command.
Exit status 1 when any command's worst time reaches --limit seconds. A script rather than a timed test:
on a shared machine a test would fail for reasons of load, not of code; run it on an idle one.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _command() -> list[str]:
    script = shutil.which("sidecar")
    return [script] if script else [sys.executable, "-m", "sidecar.cli.main"]


def time_help(command: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run([*command, "--help"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0 or "usage:" not in proc.stdout:
        raise SystemExit(f"{' '.join(command)} --help failed ({proc.returncode}):\n{proc.stderr}")
    return seconds


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5, help="fresh processes per command (default 5)")
    p.add_argument("--limit", type=float, default=1.0, help="seconds every run must stay under (default 1.0)")
    args = p.parse_args()
    sys.path.insert(0, str(REPO))
    from sidecar.cli.main import COMMANDS

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(x for x in (str(REPO), os.environ.get("PYTHONPATH")) if x)}
    base = _command()
    slow = []
    where = f"{' '.join(base)}, {args.runs} runs, {os.cpu_count()} cores"
    print(f"{'command':<28} {'median s':>9} {'worst s':>8}   ({where})")
    for name in ["", *COMMANDS]:
        times = [time_help([*base, name] if name else base, env) for _ in range(args.runs)]
        label = f"sidecar {name} --help".replace("  ", " ")
        worst = max(times)
        flag = "  SLOW" if worst >= args.limit else ""
        print(f"{label:<28} {statistics.median(times):>9.3f} {worst:>8.3f}{flag}")
        if flag:
            slow.append(label)
    if slow:
        print(f"over {args.limit} s: {', '.join(slow)}")
        return 1
    print(f"every command's help printed in under {args.limit} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
