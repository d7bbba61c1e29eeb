"""Tensor-parallel worker processes: one spawned process per rank, each running its own LLM (SPMD).

Parent side: `RankPool` starts the processes and owns one Pipe per rank: it sends every command to
rank 0 (`send`) and reads what any rank says (`receive`), with the process sentinels watched, so a
dead rank is reported (RankFailure, naming it) instead of waited for. Rank side: `rank_main` builds
the TP group (gloo on CPU, NCCL on CUDA, device cuda:<rank>) and the LLM, reports its plan, then
runs its engine loop (sidecar/ranks/server.py) until told to stop or the parent goes away. Rank 0
holds a one-way pipe to every other rank, over which it hands on the commands of each step boundary.

A timeout names its culprit from the processes' states (`timed_out`): a stopped or exited rank
before a busy one, a busy one before one that only waits; `interrupt()` ends a wait at once when the
sidecar stops (a stalled weight sync must not hold the shutdown for its timeout).

Invariant: a pool that failed (a timeout, a dead rank) is `broken` for good and refuses every command.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import socket
import time
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from inference.core import SidecarError
from sidecar.config import LaunchConfig, engine_config
from sidecar.ranks.commands import Command, RankPlan, RankSpec, RankStatus, Reply, Stop, check_declared
from sidecar.ranks.server import rank_main

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 10.0  # a rank told to stop gets this long before it is terminated, then killed
BROKEN_JOIN_TIMEOUT_S = 2.0
# Linux process states (/proc/PID/stat), most to least likely to be the culprit of a timeout: a stopped
# or dead rank holds the others up, a running one is busy (slow), a sleeping one waits (on the others).
_STATES = {"T": "stopped (SIGSTOP or a debugger)", "t": "stopped by a debugger", "Z": "exited (a zombie)",
           "D": "in uninterruptible I/O", "R": "running (busy)", "S": "sleeping (waiting)"}


class RankFailure(SidecarError):
    """The pool cannot serve: a rank died, hung past a timeout, or failed to start."""

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def rank_threads(chosen: int | None, device: str, tp: int, cores: int | None = None) -> int:
    """The torch thread count of each rank process: `chosen` (--threads) when given; else 1 on cuda (the
    GPU computes; a host thread only schedules and launches) and min(4, cores // (2 * tp)), at least 1,
    on cpu. Why not every core: the sidecar runs beside a trainer, and torch threads that outnumber the
    free cores spin against it (16 x 64 tokens took 25.8 s beside a busy 2-thread process, 0.3 s with
    one thread). Half the usable cores, shared by the ranks, capped at 4 (more gain little at these
    sizes). `cores` default: the cores this process may run on."""
    if chosen is not None:
        return chosen
    if device.startswith("cuda"):
        return 1
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(4, cores // (2 * tp)))


class RankPool:
    """The rank processes of one sidecar and their control channels (used by one thread at a time)."""

    def __init__(self, cfg: LaunchConfig, model_dir: str, device: str) -> None:
        self.cfg = cfg
        self.size = cfg.tp
        self.device = device
        self.broken: str | None = None
        self.plans: list[RankPlan] = []
        self.startup_statuses: list[RankStatus | None] = []  # each rank's status as it reported at startup
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        self._peer_ends: list[Connection] = []  # rank 0 -> rank r pipes, this process's copies until spawned
        self._wake_r, self._wake_w = os.pipe()  # interrupt() makes a gather return at once
        threads = rank_threads(cfg.threads, device, self.size)
        port = free_port() if self.size > 1 else 0
        engine = engine_config(cfg, model_dir, device)
        self._specs = [RankSpec(r, self.size, engine, port, "nccl" if device == "cuda" else "gloo", threads,
                                cfg.log_level, max(cfg.rpc_timeout_s, cfg.step_timeout_s), os.getpid(),
                                dp_rank=cfg.dp_rank, log_format=cfg.log_format)
                       for r in range(self.size)]

    # ---- lifecycle --------------------------------------------------------------------------
    def start(self) -> list[RankPlan]:
        """Spawn every rank and wait for each to report its memory plan (RankFailure otherwise)."""
        ctx = mp.get_context("spawn")
        peers = [ctx.Pipe(duplex=False) for _ in self._specs[1:]]  # (rank r's end, rank 0's end)
        self._peer_ends = [end for pair in peers for end in pair]
        for spec in self._specs:
            parent, child = ctx.Pipe()
            followers = tuple(send for _, send in peers) if spec.rank == 0 else ()
            leader = peers[spec.rank - 1][0] if spec.rank > 0 else None
            proc = ctx.Process(target=rank_main, args=(spec, child, followers, leader), name=f"sidecar-rank{spec.rank}")
            proc.start()
            child.close()  # the parent keeps only its end, so a dead rank reads as EOF
            self._procs.append(proc)
            self._conns.append(parent)
        for end in self._peer_ends:  # only the ranks hold them: a dead rank 0 reads as EOF on the others
            end.close()
        self._peer_ends = []
        replies = self._gather(self.cfg.startup_timeout_s, "startup")
        failed = [(r, rep) for r, rep in enumerate(replies) if not rep.ok]
        if failed:
            rank, rep = failed[0]
            assert rep.error is not None
            self.broken = f"rank {rank} failed to start"
            raise RankFailure(f"rank {rank} failed to start: {rep.error.type}: {rep.error.message}", rank)
        self.plans = [rep.value for rep in replies]
        self.startup_statuses = [rep.status for rep in replies]
        return self.plans

    def close(self, timeout: float = JOIN_TIMEOUT_S) -> None:
        """Stop every rank: ask politely, join with a timeout, then terminate, then kill. Idempotent.

        A broken pool gets a short grace period: its live ranks may be stuck in a collective with
        the dead one and would only time out.
        """
        if self.broken is not None:
            timeout = min(timeout, BROKEN_JOIN_TIMEOUT_S)
        if self._conns and self._procs[0].is_alive():  # rank 0 hands it on; the others also stop at EOF
            with contextlib.suppress(OSError):  # it died meanwhile; reaped below
                self._conns[0].send(Stop())
        deadline = time.monotonic() + timeout
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                log.warning("rank process %s did not stop in %.0f s; terminating it", proc.pid, timeout)
                proc.terminate()
                proc.join(3.0)
            if proc.is_alive():
                proc.kill()
                proc.join(3.0)
        for conn in self._conns:
            conn.close()
        self._conns = []
        self.broken = self.broken or "closed"

    def interrupt(self) -> None:
        """Make a gather in progress (on another thread) fail now with RankFailure, and every later one:
        the sidecar is stopping and must not wait out a command's timeout (a stalled weight sync's is
        the trainer's). Thread-safe; idempotent."""
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"!")

    @property
    def pids(self) -> list[int | None]:
        return [p.pid for p in self._procs]

    def alive(self) -> list[bool]:
        return [p.is_alive() for p in self._procs]

    def dead_rank(self) -> tuple[int, int | None] | None:
        """(rank, exit code) of the first rank process that is gone, or None."""
        for rank, proc in enumerate(self._procs):
            if not proc.is_alive():
                return rank, proc.exitcode
        return None

    # ---- commands ---------------------------------------------------------------------------
    def send(self, cmd: Command) -> None:
        """Send `cmd` to rank 0, which hands it to every rank at its next step boundary."""
        check_declared(cmd, "RankPool.send")
        if self.broken is not None:
            raise RankFailure(f"the rank processes cannot serve: {self.broken}")
        try:
            self._conns[0].send(cmd)
        except OSError as e:
            raise self._fail(f"rank 0 is gone ({e}) while sending {type(cmd).__name__}", 0) from e

    def receive(self, timeout: float, wake_fd: int | None = None) -> list[tuple[int, Any]]:
        """Every message any rank has sent, as (rank, message) in each rank's order; waits up to
        `timeout` for the first (or for `wake_fd` to turn readable, which it drains). RankFailure when
        a rank died or the sidecar is stopping."""
        if self.broken is not None:
            raise RankFailure(f"the rank processes cannot serve: {self.broken}")
        extra = [self._wake_r] + ([wake_fd] if wake_fd is not None else [])
        ready = wait([*self._conns, *(p.sentinel for p in self._procs), *extra], timeout=timeout)
        if self._wake_r in ready:
            raise self._fail("the sidecar is stopping: stopped waiting for the ranks", None, stopping=True)
        if wake_fd is not None and wake_fd in ready:
            os.read(wake_fd, 4096)
        messages: list[tuple[int, Any]] = []
        for rank, conn in enumerate(self._conns):
            try:
                while conn.poll():
                    messages.append((rank, conn.recv()))
            except (EOFError, OSError):
                raise self._fail(self._death(rank, "its engine loop"), rank) from None
        for rank, proc in enumerate(self._procs):
            if proc.sentinel in ready:
                raise self._fail(self._death(rank, "its engine loop"), rank)
        return messages

    def timed_out(self, pending: list[int], what: str, timeout: float) -> RankFailure:
        """The failure of ranks `pending` not answering `what` within `timeout` (the pool breaks)."""
        return self._timed_out(pending, what, timeout)

    def _gather(self, timeout: float, what: str) -> list[Reply]:
        replies: dict[int, Reply] = {}
        deadline = time.monotonic() + timeout
        while len(replies) < self.size:
            pending = [r for r in range(self.size) if r not in replies]
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._timed_out(pending, what, timeout)
            ready = wait([self._conns[r] for r in pending] + [self._procs[r].sentinel for r in pending]
                         + [self._wake_r], timeout=min(left, 1.0))
            if self._wake_r in ready:
                raise self._fail(f"the sidecar is stopping: stopped waiting for {what}", None, stopping=True)
            for r in pending:
                if self._conns[r] in ready:
                    try:
                        replies[r] = self._conns[r].recv()
                    except (EOFError, OSError):
                        raise self._fail(self._death(r, what), r) from None
                elif self._procs[r].sentinel in ready:
                    raise self._fail(self._death(r, what), r)
        return [replies[r] for r in range(self.size)]

    def _timed_out(self, pending: list[int], what: str, timeout: float) -> RankFailure:
        """Name the culprit of a timeout: a stopped or dead rank before a busy one, a busy one before
        one that only waits (in TP the healthy ranks wait in a collective for the stuck one)."""
        states = {r: process_state(self._procs[r].pid) for r in pending}
        order = list(_STATES)
        ranked = sorted(pending, key=lambda r: order.index(states[r]) if states[r] in order else len(order))
        culprit = ranked[0]
        state = states[culprit]
        if state in ("T", "t", "Z"):
            others = [r for r in pending if r != culprit]
            waited = f"; rank(s) {', '.join(map(str, others))} waited for it" if others else ""
            return self._fail(f"rank {culprit} (pid {self._procs[culprit].pid}) is {_STATES[state]} and did not "
                              f"answer {what} within {timeout:g} s{waited}", culprit)
        described = "; ".join(f"rank {r} (pid {self._procs[r].pid}) {_STATES.get(states[r] or '', 'state unknown')}"
                              for r in ranked)
        return self._fail(f"rank(s) {', '.join(map(str, ranked))} did not answer {what} within {timeout:g} s "
                          f"({described})", culprit)

    def _death(self, rank: int, what: str) -> str:
        proc = self._procs[rank]
        proc.join(0.5)
        return f"rank {rank} (pid {proc.pid}) died during {what} (exit code {proc.exitcode})"

    def _fail(self, message: str, rank: int | None, stopping: bool = False) -> RankFailure:
        """Mark the pool broken; a stop asked for is no error (the driver waits on the ranks all the time)."""
        self.broken = message
        log.log(logging.INFO if stopping else logging.ERROR, "%s", message)
        return RankFailure(message, rank)


def process_state(pid: int | None) -> str | None:
    """The kernel's one-letter state of a process (Linux /proc; None elsewhere or when it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()
    return fields[0] if fields else None
