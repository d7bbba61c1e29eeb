"""The driver thread: the only user of the rank pool's channels; it turns HTTP calls into SPMD commands.

HTTP handlers never touch the ranks. They `submit` prompts or `call` a declared command
(sidecar/ranks/commands.py: Sleep, WakeUp, the weight-update commands, ReadManifest) and await a Future.
The driver thread batches every newly arrived request group and abort into one `Step` command
(broadcast to every rank; each adds them and runs one llm.step()), resolves the futures of the
requests rank 0 reports finished, and runs control commands between steps, gathering every rank's
reply. When there is nothing to do it blocks on a condition variable (no busy loop); while asleep,
paused or torn, held requests cost nothing.

Failure rule: a dead or hung rank breaks the pool for good (the SPMD ranks cannot continue without
it). Every pending and later call then fails at once with a RankError of kind "unavailable" naming
the rank; /health turns 503. Restarting the sidecar is the recovery.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any

from inference.core import RequestOutput, SamplingParams, SidecarError
from sidecar.ranks.commands import (
    Command,
    ErrorInfo,
    RankStatus,
    Rejections,
    Reply,
    RequestGroup,
    Step,
    Stop,
    UnknownCommandError,
    WaitMode,
    check_declared,
)
from sidecar.ranks.pool import RankFailure, RankPool

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.5  # how often an idle driver checks that its ranks are alive
TOKENS_WINDOW_S = 10.0  # tokens/s is measured over this trailing window


class RankError(SidecarError):
    """A call failed on the ranks (or the ranks are gone). `info` is the first failing rank's error;
    `errors` every rank's, in rank order."""

    def __init__(self, info: ErrorInfo, errors: list[ErrorInfo] | None = None) -> None:
        where = f"rank {info.rank}: " if info.rank and info.rank not in info.message else ""
        super().__init__(f"{where}{info.message}")
        self.info = info
        self.errors = errors or [info]


def unavailable(message: str, rank: str | None = None) -> RankError:
    return RankError(ErrorInfo("RankFailure", message, "unavailable", None, rank))


def _settle(fut: Future, result: Any = None, error: BaseException | None = None) -> None:
    """Resolve `fut` unless it is already done (failed by stop(), or cancelled by its caller)."""
    try:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)
    except InvalidStateError:
        pass


@dataclass
class _Group:
    """The prompts of one HTTP call; its future gets the outputs in prompt order."""

    group_id: str
    requests: list[tuple[str, Any, SamplingParams]]
    wait: WaitMode
    future: Future
    outputs: dict[str, RequestOutput] = field(default_factory=dict)
    sent: bool = False
    pending: int = 0  # sequences (n per prompt) not answered yet: what the queue limit counts

    def sequences_of(self, request_id: str) -> int:
        return int(self.requests[int(request_id.rsplit("-", 1)[1])][2].n)


@dataclass
class _Control:
    cmd: Command
    timeout: float
    future: Future


class Driver:
    """Owns the RankPool from its own thread. Thread-safe entry points: submit, abort, call, pause,
    resume, snapshot, healthy; stop() ends the thread (the pool is closed by its owner)."""

    def __init__(self, pool: RankPool, *, step_timeout_s: float, rpc_timeout_s: float,
                 max_queued: int = 65536, hold_while_asleep: bool = False) -> None:
        self.pool = pool
        self.step_timeout_s = step_timeout_s
        self.rpc_timeout_s = rpc_timeout_s
        self.max_queued = max_queued  # sequences
        self.hold_while_asleep = hold_while_asleep
        self._cv = threading.Condition()
        self._new: list[_Group] = []
        self._aborts: list[str] = []
        self._controls: deque[_Control] = deque()
        self._groups: dict[str, _Group] = {}  # group_id -> group, from submit until resolved
        self._owner: dict[str, str] = {}  # request_id -> group_id
        self._ids = itertools.count()
        self._paused = False
        self._stopping = False
        self._failure: str | None = None
        self._failure_rank: str | None = None  # the rank key the failure names, when one does
        self._queued_sequences = 0  # sum of every group's `pending`
        self._running: _Control | None = None  # the control command on the ranks now
        self._engine_unfinished = 0
        self._engine_ready = True
        self.busy: str | None = None  # the name of the control command running now
        # each rank's last reported status (None until it reported one)
        self.statuses: list[RankStatus | None] = list(getattr(pool, "startup_statuses", None) or [None] * pool.size)
        self.tokens_total = 0
        self._token_events: deque[tuple[float, int]] = deque()
        self._thread = threading.Thread(target=self._loop, name="sidecar-driver", daemon=True)

    # ---- entry points (any thread) ------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Fail every pending call, the one on the ranks now included (its caller gets a 503 at once, not
        after the command's timeout), interrupt the pool's wait for it, and end the thread."""
        error = unavailable("the sidecar is shutting down")
        with self._cv:
            self._stopping = True
            self._fail_all_locked(error)
            running = self._running
            self._cv.notify_all()
        if running is not None:
            _settle(running.future, error=error)
        interrupt = getattr(self.pool, "interrupt", None)
        if interrupt is not None:
            interrupt()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def submit(self, requests: list[tuple[Any, SamplingParams]], wait: bool = True) -> Future:
        """Queue one group of prompts; the future resolves to their RequestOutputs in order, or to a
        RankError (a rejected prompt names its index; the whole group is then refused). The queue limit
        counts sequences (n per prompt), the unit of work and memory of the engine. `wait`: the call's
        own; what it holds through is commands.RequestGroup's `wait` (hold_while_asleep: "always")."""
        mode: WaitMode = "never" if not wait else "always" if self.hold_while_asleep else "sync"
        fut: Future = Future()
        sequences = sum(int(params.n) for _, params in requests)
        with self._cv:
            if self._refuse_locked(fut):
                return fut
            if self._queued_sequences + sequences > self.max_queued:
                fut.set_exception(RankError(ErrorInfo(
                    "QueueFull", f"{self._queued_sequences} sequences are queued and this call adds {sequences}; "
                    f"the limit is {self.max_queued} (--max-queued-sequences): retry later", "busy")))
                return fut
            gid = f"g{next(self._ids)}"
            reqs = [(f"{gid}-{i}", prompt, params) for i, (prompt, params) in enumerate(requests)]
            group = _Group(gid, reqs, mode, fut, pending=sequences)
            self._queued_sequences += sequences
            self._groups[gid] = group
            self._owner.update((rid, gid) for rid, _, _ in reqs)
            self._new.append(group)
            self._cv.notify_all()
        return fut

    def abort(self, future: Future) -> None:
        """Cancel the group behind `future` (its caller went away)."""
        with self._cv:
            group = next((g for g in self._groups.values() if g.future is future), None)
            if group is None:
                return
            self._drop_locked(group)
            if group.sent:
                self._aborts.extend(rid for rid, _, _ in group.requests)
            else:
                self._new.remove(group)
            future.cancel()
            self._cv.notify_all()

    def call(self, cmd: Command, timeout: float | None = None) -> Future:
        """Run the control command `cmd` on every rank between two steps; the future resolves to the
        list of per-rank reply values (each a `type(cmd).reply`, rank order), or a RankError.
        Raises UnknownCommandError for an undeclared command, and for Step and Stop (the driver's own)."""
        if isinstance(cmd, (Step, Stop)):
            raise UnknownCommandError(cmd, "Driver.call (Step and Stop are the driver's own)")
        check_declared(cmd, "Driver.call")
        fut: Future = Future()
        with self._cv:
            if self._refuse_locked(fut):
                return fut
            self._controls.append(_Control(cmd, timeout or self.rpc_timeout_s, fut))
            self._cv.notify_all()
        return fut

    def pause(self) -> None:
        with self._cv:
            self._paused = True

    def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def failure(self) -> str | None:
        """Why the ranks cannot serve (None while healthy); checks the processes right now."""
        if self._failure is None and not self._stopping:
            dead = self.pool.dead_rank()
            if dead is not None:
                with self._cv:
                    self._fail_locked(f"rank {dead[0]} process exited (exit code {dead[1]})", dead[0])
        return self._failure

    @property
    def failure_rank(self) -> str | None:
        """The rank key of the rank that broke the pool (None while healthy, or when none is known)."""
        return self._failure_rank

    def queued_sequences(self) -> int:
        """Sequences (n per prompt) accepted and not yet answered: what --max-queued-sequences bounds."""
        with self._cv:
            return self._queued_sequences

    def queue_depth(self) -> int:
        """Prompts accepted and not yet answered (waiting in the driver or in the engine)."""
        with self._cv:
            return sum(len(g.requests) - len(g.outputs) for g in self._groups.values())

    def tokens_per_second(self) -> float:
        with self._cv:
            self._prune_token_events_locked(time.monotonic())
            return sum(n for _, n in self._token_events) / TOKENS_WINDOW_S

    def _prune_token_events_locked(self, now: float) -> None:
        """Keep only the window's events: every append prunes, so the deque is bounded by the tokens
        of TOKENS_WINDOW_S whether /metrics is scraped or not."""
        while self._token_events and self._token_events[0][0] < now - TOKENS_WINDOW_S:
            self._token_events.popleft()

    # ---- the thread -----------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            work = self._next_work()
            if work is None:
                return
            try:
                if isinstance(work, _Control):
                    self._run_control(work)
                else:
                    self._run_step(*work)
            except RankFailure as e:
                with self._cv:
                    self._fail_locked(str(e), e.rank)
            except Exception as e:  # a bug of ours: fail what was in flight, keep the thread alive
                log.exception("driver: unexpected error")
                with self._cv:
                    self._fail_all_locked(RankError(ErrorInfo(type(e).__name__, str(e), "internal")))

    def _next_work(self) -> _Control | tuple[list[_Group], list[str], bool] | None:
        with self._cv:
            while True:
                if self._stopping:
                    return None
                if self._failure is None:
                    if self._controls:
                        return self._controls.popleft()
                    run = not self._paused and self._engine_ready
                    if self._new or self._aborts or (run and self._engine_unfinished):
                        groups, aborts = self._new, self._aborts
                        self._new, self._aborts = [], []
                        for g in groups:
                            g.sent = True
                        return groups, aborts, run
                self._cv.wait(IDLE_POLL_S)
                if self._failure is None and not self._stopping:
                    dead = self.pool.dead_rank()
                    if dead is not None:
                        self._fail_locked(f"rank {dead[0]} process exited (exit code {dead[1]})", dead[0])

    def _run_step(self, groups: list[_Group], aborts: list[str], run: bool) -> None:
        cmd = Step(tuple(aborts), tuple(RequestGroup(g.group_id, tuple(g.requests), g.wait) for g in groups), run)
        replies = self.pool.broadcast(cmd, self.step_timeout_s, "a generation step")
        failed = _first_error(replies)
        with self._cv:
            self._absorb_status(replies)
            if failed is not None:  # the ranks dropped every request: fail them all
                self._fail_all_locked(RankError(failed, [r.error for r in replies if r.error]), only_sent=True)
                return
            value: Rejections = replies[0].value
            for gid, err in value.rejected.items():
                group = self._groups.get(gid)
                if group is not None:
                    self._drop_locked(group)
                    if not group.future.done():  # an awaiting HTTP task may have been cancelled
                        group.future.set_exception(RankError(err))
            self._resolve_locked(replies[0].finished)

    def _run_control(self, ctl: _Control) -> None:
        if not ctl.future.set_running_or_notify_cancel():
            return
        what = type(ctl.cmd).__name__
        self.busy = what
        with self._cv:
            self._running = ctl
        try:
            replies = self.pool.broadcast(ctl.cmd, ctl.timeout, what)
        except RankFailure as e:
            _settle(ctl.future, error=unavailable(str(e), self._rank_key(e.rank)))
            raise
        finally:
            self.busy = None
            with self._cv:
                self._running = None
        with self._cv:
            self._absorb_status(replies)
            self._resolve_locked(replies[0].finished)
        failed = _first_error(replies)
        if failed is not None:
            _settle(ctl.future, error=RankError(failed, [r.error for r in replies if r.error]))
        else:
            _settle(ctl.future, [r.value for r in replies])

    # ---- bookkeeping (caller holds the lock) ----------------------------------------------------
    def _absorb_status(self, replies: list[Reply]) -> None:
        for i, r in enumerate(replies):
            if r.status is not None:
                self.statuses[i] = r.status
        head = replies[0].status
        if head is not None:
            self._engine_unfinished = head.unfinished
            self._engine_ready = head.ready

    def _resolve_locked(self, finished: list[RequestOutput]) -> None:
        if finished:
            now = time.monotonic()
            tokens = sum(len(c.token_ids) for out in finished for c in out.outputs)
            self.tokens_total += tokens
            self._token_events.append((now, tokens))
            self._prune_token_events_locked(now)
        for out in finished:
            gid = self._owner.pop(out.request_id, None)
            group = self._groups.get(gid) if gid is not None else None
            if group is None:
                continue  # aborted meanwhile
            group.outputs[out.request_id] = out
            done = group.sequences_of(out.request_id)
            group.pending -= done
            self._queued_sequences -= done
            if len(group.outputs) == len(group.requests):
                self._drop_locked(group)
                if not group.future.done():
                    group.future.set_result([group.outputs[rid] for rid, _, _ in group.requests])

    def _drop_locked(self, group: _Group) -> None:
        self._queued_sequences -= group.pending
        group.pending = 0
        self._groups.pop(group.group_id, None)
        for rid, _, _ in group.requests:
            self._owner.pop(rid, None)

    def _refuse_locked(self, fut: Future) -> bool:
        if self._stopping:
            fut.set_exception(unavailable("the sidecar is shutting down"))
        elif self._failure is not None:
            fut.set_exception(unavailable(self._failure, self._failure_rank))
        else:
            return False
        return True

    def _rank_key(self, rank: int | None) -> str | None:
        plans = getattr(self.pool, "plans", None) or []
        return plans[rank].rank if rank is not None and 0 <= rank < len(plans) else None

    def _fail_locked(self, message: str, rank: int | None = None) -> None:
        if self._failure is None:
            if not self._stopping:
                log.error("ranks unavailable: %s", message)
            self._failure, self._failure_rank = message, self._rank_key(rank)
        self._fail_all_locked(unavailable(self._failure, self._failure_rank))

    def _fail_all_locked(self, error: RankError, only_sent: bool = False) -> None:
        """Fail every pending group and control call (only_sent: just the groups the ranks held)."""
        for group in list(self._groups.values()):
            if only_sent and not group.sent:
                continue
            self._drop_locked(group)
            if not group.future.done():
                group.future.set_exception(error)
        if not only_sent:
            self._new = []
            while self._controls:
                ctl = self._controls.popleft()
                if not ctl.future.done():
                    ctl.future.set_exception(error)
        self._cv.notify_all()


def _first_error(replies: list[Reply]) -> ErrorInfo | None:
    return next((r.error for r in replies if not r.ok), None)
