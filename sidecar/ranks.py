"""Tensor-parallel worker processes: one spawned process per rank, each running its own LLM (SPMD).

Parent side: `RankPool` starts the processes, owns one Pipe per rank, broadcasts a command to every
rank and gathers every reply, with a timeout on every wait and the process sentinels watched, so a
dead rank is reported (RankFailure, naming it) instead of waited for. Rank side: `rank_main` builds
the TP group (gloo on CPU, NCCL on CUDA, device cuda:<rank>) and the LLM, reports its memory plan,
then serves the declared commands (sidecar/commands.py, sidecar/rank_server.py) until told to stop
or the parent goes away.

Invariants: commands reach every rank in the same order (the engine is SPMD, see
docs/architecture.md), and a command's replies are all read before the next command is sent; a
pool that broke that rule (a timeout, a dead rank) is `broken` for good and refuses every command.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import socket
import time
from multiprocessing.connection import Connection, wait
from typing import Any

from inference.core import SidecarError
from sidecar.commands import Command, RankSpec, Reply, Stop, check_declared
from sidecar.config import LaunchConfig, engine_config
from sidecar.rank_server import rank_main

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 10.0  # a rank told to stop gets this long before it is terminated, then killed
BROKEN_JOIN_TIMEOUT_S = 2.0


class RankFailure(SidecarError):
    """The pool cannot serve: a rank died, hung past a timeout, or failed to start."""

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class RankPool:
    """The rank processes of one sidecar and their control channels (used by one thread at a time)."""

    def __init__(self, cfg: LaunchConfig, model_dir: str, device: str) -> None:
        self.cfg = cfg
        self.size = cfg.tp
        self.device = device
        self.broken: str | None = None
        self.plans: list[dict[str, Any]] = []
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        threads = max(1, (os.cpu_count() or 1) // self.size)
        port = free_port() if self.size > 1 else 0
        engine = engine_config(cfg, model_dir, device)
        self._specs = [RankSpec(r, self.size, engine, port, "nccl" if device == "cuda" else "gloo", threads,
                                cfg.log_level, max(cfg.rpc_timeout_s, cfg.step_timeout_s), os.getpid())
                       for r in range(self.size)]

    # ---- lifecycle --------------------------------------------------------------------------
    def start(self) -> list[dict[str, Any]]:
        """Spawn every rank and wait for each to report its memory plan (RankFailure otherwise)."""
        ctx = mp.get_context("spawn")
        for spec in self._specs:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=rank_main, args=(spec, child), name=f"sidecar-rank{spec.rank}")
            proc.start()
            child.close()  # the parent keeps only its end, so a dead rank reads as EOF
            self._procs.append(proc)
            self._conns.append(parent)
        replies = self._gather(self.cfg.startup_timeout_s, "startup")
        failed = [(r, rep) for r, rep in enumerate(replies) if not rep.ok]
        if failed:
            rank, rep = failed[0]
            assert rep.error is not None
            self.broken = f"rank {rank} failed to start"
            raise RankFailure(f"rank {rank} failed to start: {rep.error.type}: {rep.error.message}", rank)
        self.plans = [rep.value for rep in replies]
        return self.plans

    def close(self, timeout: float = JOIN_TIMEOUT_S) -> None:
        """Stop every rank: ask politely, join with a timeout, then terminate, then kill. Idempotent.

        A broken pool gets a short grace period: its live ranks may be stuck in a collective with
        the dead one and would only time out.
        """
        if self.broken is not None:
            timeout = min(timeout, BROKEN_JOIN_TIMEOUT_S)
        for conn, proc in zip(self._conns, self._procs):
            if proc.is_alive():
                with contextlib.suppress(OSError):  # it died meanwhile; reaped below
                    conn.send(Stop())
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
    def broadcast(self, cmd: Command, timeout: float, what: str) -> list[Reply]:
        """Send `cmd` to every rank and return every rank's reply, in rank order."""
        check_declared(cmd, "RankPool.broadcast")
        if self.broken is not None:
            raise RankFailure(f"the rank processes cannot serve: {self.broken}")
        for rank, conn in enumerate(self._conns):
            try:
                conn.send(cmd)
            except OSError as e:
                raise self._fail(f"rank {rank} is gone ({e}) while sending {what}", rank) from e
        return self._gather(timeout, what)

    def _gather(self, timeout: float, what: str) -> list[Reply]:
        replies: dict[int, Reply] = {}
        deadline = time.monotonic() + timeout
        while len(replies) < self.size:
            pending = [r for r in range(self.size) if r not in replies]
            left = deadline - time.monotonic()
            if left <= 0:
                names = ", ".join(str(r) for r in pending)
                raise self._fail(f"rank(s) {names} did not answer {what} within {timeout:g} s", pending[0])
            ready = wait([self._conns[r] for r in pending] + [self._procs[r].sentinel for r in pending],
                         timeout=min(left, 1.0))
            for r in pending:
                if self._conns[r] in ready:
                    try:
                        replies[r] = self._conns[r].recv()
                    except (EOFError, OSError):
                        raise self._fail(self._death(r, what), r) from None
                elif self._procs[r].sentinel in ready:
                    raise self._fail(self._death(r, what), r)
        return [replies[r] for r in range(self.size)]

    def _death(self, rank: int, what: str) -> str:
        proc = self._procs[rank]
        proc.join(0.5)
        return f"rank {rank} (pid {proc.pid}) died during {what} (exit code {proc.exitcode})"

    def _fail(self, message: str, rank: int) -> RankFailure:
        self.broken = message
        log.error("%s", message)
        return RankFailure(message, rank)
