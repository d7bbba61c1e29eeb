"""`sidecar fleet`: N replicas of `sidecar launch` on one machine, each with its dp rank, devices and port.

Replica i runs `sidecar launch --dp-rank i --tp T_i --host H --port P_i --device D [--devices G_i]`
plus the launch flags given after `--`, as a child process. Placement (`plan_replicas`): --tp is one
size for every replica or one per replica (2,1,1); on CUDA replica i takes the next T_i entries of
--gpus (default one GPU per rank), which may repeat a GPU across replicas. Ports: P_i = --port + i, or
each a free one with --port 0.

Prints one line per replica, then `Sidecar fleet serving on URL0 URL1 ...`: the URLs of
trainer_hooks.Fleet([...]), in dp order (scripts wait for that line). SIGTERM or SIGINT stops every
replica (SIGTERM, joined with a timeout, then SIGKILL); should this command die without cleaning up,
each replica gets SIGTERM (PR_SET_PDEATHSIG). A replica that exits on its own is reported on stderr
with the command that restarts it on the port it served, and the others keep serving; when none is
left the command exits.
Exit status: 0 after a signal, 1 when a replica failed to start or every replica exited, 2 for bad
arguments. Declaring the arguments imports no torch.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import queue
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from inference.core import InvalidRequestError
from sidecar.child_process import die_with_parent, stdout_lines
from sidecar.config import DEVICES, LaunchConfig
from sidecar.log_format import LOG_FORMATS, line

STOP_TIMEOUT_S = 60.0
SERVING_LINE = "Sidecar fleet serving on {urls}"
_RESERVED = ("--dp-rank", "--tp", "--host", "--port", "--device", "--devices")  # set per replica here


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", type=int, default=2, metavar="N", help="how many replicas to start")
    p.add_argument("--tp", default="1", metavar="LIST",
                   help="tensor-parallel size: one for every replica, or one per replica (2,1,1)")
    p.add_argument("--gpus", default=None, metavar="LIST",
                   help="GPU indices for the replicas' ranks in order: replica i takes the next tp of them, and "
                        "replicas may share one (0,0,0,0). Unset on cuda: 0, 1, 2, ... (one GPU per rank)")
    p.add_argument("--device", default="auto", choices=DEVICES, help="device of every replica")
    p.add_argument("--host", default=LaunchConfig.host, metavar="ADDR", help="address every replica binds")
    p.add_argument("--port", type=int, default=LaunchConfig.port, metavar="N",
                   help="replica i serves on PORT + i; 0: each picks a free port")
    p.add_argument("--log-dir", default=None, metavar="DIR",
                   help="write replica i's log to DIR/replica<i>.log; unset: to this command's stderr")
    p.add_argument("--log-format", default="text", choices=LOG_FORMATS,
                   help="every replica's log and this command's own messages on stderr: text, or json (one "
                        "JSON object a line)")
    p.add_argument("--startup-timeout-s", type=float, default=LaunchConfig.startup_timeout_s, metavar="S",
                   help="seconds for every replica to serve")
    p.add_argument("launch_args", nargs=argparse.REMAINDER, metavar="-- LAUNCH FLAGS",
                   help="more `sidecar launch` flags for every replica, after -- (default: none)")


@dataclass(frozen=True)
class ReplicaPlan:
    """Where replica `dp_rank` runs: its TP size, port (0: a free one) and GPUs (None on the CPU)."""

    dp_rank: int
    tp: int
    port: int
    gpus: tuple[int, ...] | None

    def command(self, host: str, device: str, extra: list[str]) -> list[str]:
        cmd = [sys.executable, "-m", "sidecar.cli.main", "launch", "--dp-rank", str(self.dp_rank), "--tp", str(self.tp),
               "--host", host, "--port", str(self.port), "--device", device]
        if self.gpus is not None:
            cmd += ["--devices", ",".join(map(str, self.gpus))]
        return cmd + extra


def plan_replicas(replicas: int, tp: str, gpus: str | None, device: str, port: int) -> list[ReplicaPlan]:
    """Each replica's placement (module docstring); InvalidRequestError naming the flag otherwise.
    `device` is resolved already ("cuda" or "cpu")."""
    if replicas < 1:
        raise InvalidRequestError("replicas", f"must be >= 1, got {replicas}")
    try:
        sizes = [int(x) for x in tp.split(",")]
    except ValueError:
        raise InvalidRequestError("tp", f"must be sizes like 2 or 2,1,1, got {tp!r}") from None
    if len(sizes) == 1:
        sizes *= replicas
    if len(sizes) != replicas or any(s < 1 for s in sizes):
        raise InvalidRequestError("tp", f"give one size >= 1, or one per replica ({replicas}), got {tp!r}")
    if port != 0 and not 0 < port + replicas - 1 < 65536:
        raise InvalidRequestError("port", f"{port} + {replicas - 1} replicas leaves the TCP port range")
    placed: list[tuple[int, ...] | None] = [None] * replicas
    if device == "cpu" and gpus is not None:
        raise InvalidRequestError("gpus", "GPU indices need --device cuda (or auto on a GPU machine), not cpu")
    if device != "cpu":
        flat = list(range(sum(sizes))) if gpus is None else _indices(gpus)
        if len(flat) != sum(sizes):
            raise InvalidRequestError("gpus", f"lists {len(flat)} GPU(s) for {sum(sizes)} rank(s) (--tp {tp})")
        start = 0
        for i, size in enumerate(sizes):
            placed[i] = tuple(flat[start:start + size])
            start += size
            if len(set(placed[i] or ())) != size:
                raise InvalidRequestError("gpus", f"replica dp{i} would put two of its {size} ranks on one GPU "
                                          f"({placed[i]}); only different replicas may share a GPU")
    return [ReplicaPlan(i, sizes[i], port + i if port else 0, placed[i]) for i in range(replicas)]


def _indices(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise InvalidRequestError("gpus", f"must be GPU indices like 0,1 or 0,0,0,0, got {text!r}") from None
    if any(v < 0 for v in values):
        raise InvalidRequestError("gpus", f"GPU indices are >= 0, got {text!r}")
    return values


def launch_flags(args: list[str]) -> list[str]:
    """The flags after `--`, refusing those this command sets per replica."""
    extra = args[1:] if args[:1] == ["--"] else list(args)
    for a in extra:
        if a.split("=", 1)[0] in _RESERVED:
            raise InvalidRequestError(a.split("=", 1)[0].lstrip("-"), "is set per replica by `sidecar fleet`; "
                                      "use its own flags (--replicas, --tp, --gpus, --host, --port, --device)")
    return extra


def run(args: argparse.Namespace) -> int:
    try:
        extra = launch_flags(args.launch_args)
        device = _resolve_device(args.device)
        plans = plan_replicas(args.replicas, args.tp, args.gpus, device, args.port)
    except InvalidRequestError as e:
        print(f"sidecar fleet: error: {e}", file=sys.stderr)
        return 2
    fleet = _Replicas(plans, args.host, device, ["--log-format", args.log_format, *extra], args.log_dir,
                      args.log_format)
    stop = threading.Event()
    old = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        urls = fleet.start(args.startup_timeout_s, stop)
        if urls is None:
            return 0 if stop.is_set() else 1
        print(SERVING_LINE.format(urls=" ".join(urls)), flush=True)
        return 0 if fleet.serve(stop) else 1
    finally:
        fleet.stop()
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _resolve_device(device: str) -> str:
    if device == "cpu":
        return device
    from sidecar.cli.common import check_device  # torch, only when a GPU may be meant

    return check_device(device)


class _Replicas:
    """The child processes and what they printed."""

    def __init__(self, plans: list[ReplicaPlan], host: str, device: str, extra: list[str], log_dir: str | None,
                 log_format: str = "text") -> None:
        self.plans, self.host, self.device, self.extra = plans, host, device, extra
        self.log_format = log_format
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.procs: list[subprocess.Popen] = []
        self.lines: list[queue.Queue[str | None]] = []
        self.exited: set[int] = set()

    def start(self, timeout: float, stop: threading.Event) -> list[str] | None:
        """Start every replica and wait for each to serve; the URLs, or None (reported on stderr)."""
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        for plan in self.plans:  # every fork before any thread starts (preexec_fn)
            log = self._log(plan)
            try:
                self.procs.append(subprocess.Popen(plan.command(self.host, self.device, self.extra),
                                                   stdout=subprocess.PIPE, stderr=log, text=True,
                                                   preexec_fn=functools.partial(die_with_parent, os.getpid())))
            finally:
                if log is not None:
                    log.close()
        for proc in self.procs:
            self.lines.append(stdout_lines(proc))
        deadline = time.monotonic() + timeout
        urls = []
        for plan, proc, lines in zip(self.plans, self.procs, self.lines):
            url = _serving_url(lines, deadline, stop)
            if url is None:
                why = "stopped by a signal" if stop.is_set() else (
                    f"exited with {proc.poll()}" if proc.poll() is not None else f"did not serve within {timeout:g} s")
                self.say(f"sidecar fleet: replica dp{plan.dp_rank} {why}", "error", replica=plan.dp_rank)
                return None
            urls.append(url)
            # the restart command brings it back where the fleet's clients look for it: the port it
            # serves, not the planned 0 (a new free port would never be re-admitted)
            served = int(url.rsplit(":", 1)[1].split("/", 1)[0])
            self.plans[plan.dp_rank] = dataclasses.replace(plan, port=served)
            gpus = f", GPUs {','.join(map(str, plan.gpus))}" if plan.gpus is not None else ""
            print(f"replica dp{plan.dp_rank}: {url} (pid {proc.pid}, tp {plan.tp}{gpus})", flush=True)
        return urls

    def say(self, message: str, level: str, **values: object) -> None:
        """One message of this command on stderr, in its --log-format."""
        print(line(message, self.log_format, "fleet", level, **values), file=sys.stderr, flush=True)

    def _log(self, plan: ReplicaPlan) -> IO[str] | None:
        return None if self.log_dir is None else open(self.log_dir / f"replica{plan.dp_rank}.log", "a")

    def serve(self, stop: threading.Event) -> bool:
        """Until a signal (True) or every replica exited (False); reports each exit on stderr."""
        while not stop.wait(0.25):
            for plan, proc in zip(self.plans, self.procs):
                if proc.poll() is not None and plan.dp_rank not in self.exited:
                    self.exited.add(plan.dp_rank)
                    again = shlex.join(plan.command(self.host, self.device, self.extra))
                    self.say(f"sidecar fleet: replica dp{plan.dp_rank} (pid {proc.pid}) exited with {proc.returncode}; "
                             f"the others keep serving. Restart it with: {again}", "error", replica=plan.dp_rank,
                             event="replica_exited", exit_code=proc.returncode, restart=again)
            if len(self.exited) == len(self.procs):
                return False
        return True

    def stop(self) -> None:
        """SIGTERM every live replica, wait for all (STOP_TIMEOUT_S in all), SIGKILL what is left."""
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for plan, proc in zip(self.plans, self.procs):
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.say(f"sidecar fleet: replica dp{plan.dp_rank} did not stop in {STOP_TIMEOUT_S:g} s: killed",
                         "warning", replica=plan.dp_rank)
                proc.kill()
                proc.wait(10)


def _serving_url(lines: queue.Queue[str | None], deadline: float, stop: threading.Event) -> str | None:
    """The URL of the child's "Sidecar serving on" line (sidecar/cli/launch.py SERVING_LINE), None if it ended,
    the deadline passed or a signal came first."""
    from sidecar.cli.launch import SERVING_LINE as LAUNCH_LINE  # the line's owner (not at --help time)

    pattern = re.compile(re.escape(LAUNCH_LINE).replace(re.escape("{url}"), r"(\S+)"))
    while not stop.is_set() and time.monotonic() < deadline:
        try:
            line = lines.get(timeout=min(0.25, max(0.01, deadline - time.monotonic())))
        except queue.Empty:
            continue
        if line is None:
            return None
        match = pattern.search(line)
        if match:
            return match.group(1)
    return None
