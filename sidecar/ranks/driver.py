"""The driver thread: the only user of the rank pool's pipes. It queues requests on the ranks and
reads back what they produce; it does not drive their steps.

HTTP handlers never touch the ranks: they `submit` prompts or `call` a declared control command
(sidecar/ranks/commands.py) and await a Future. The driver thread sends each request group, abort
and pause to rank 0 as it comes, and control commands one at a time; the ranks run their own engine
loop (sidecar/ranks/server.py) and answer: rank 0's Events resolve the futures of finished and
refused requests, every rank's Reply the control call's. Idle, it waits on the pipes (no busy loop).

Failure rule: a dead or hung rank breaks the pool for good (the SPMD ranks cannot continue without
it); every pending and later call fails at once with a RankError of kind "unavailable" naming the
rank, and /health turns 503. Busy is not hung: every rank sends a Heartbeat at least every 0.25 s
whatever it does, so a step that runs long is waited for (its progress in `activity`, a warning in
the log once it runs past --step-timeout-s). Hung: while work is owed (commands rank 0 has not
reported taking, a step it said it steps on, a control command), a rank was silent for
--step-timeout-s; or a control command ran past its own timeout, counted from when rank 0 took it
(a step in progress before it is waited for). The culprit is named from the processes' states.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any

from inference.core import DEFAULT_SYNC_POLICY, RequestOutput, SamplingParams, SidecarError, SyncPolicy
from sidecar.ranks.commands import (
    QUEUE_COMMANDS,
    AbortRequests,
    AddRequests,
    Command,
    ErrorInfo,
    Events,
    Heartbeat,
    RankStatus,
    Reply,
    RequestGroup,
    SetPaused,
    StreamDelta,
    UnknownCommandError,
    WaitMode,
    check_declared,
)
from sidecar.ranks.pool import RankFailure, RankPool

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.5  # the longest the driver waits without looking at its queues and clocks
TOKENS_WINDOW_S = 10.0  # tokens/s is measured over this trailing window
# the engine's counters on /metrics, summed over finished requests: prefix-cache hits (RequestOutput's
# num_cached_tokens), then these keys of RequestOutput.metrics (a draft model's or the batch-invariant mode's own)
METRICS_COUNTERS = ("draft_tokens_proposed", "draft_tokens_accepted", "preemptions")
ENGINE_COUNTERS = ("prefix_cache_hit_tokens", *METRICS_COUNTERS)


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
    sync: SyncPolicy = DEFAULT_SYNC_POLICY
    outputs: dict[str, RequestOutput] = field(default_factory=dict)
    sent: bool = False
    pending: int = 0  # sequences (n per prompt) not answered yet: what the queue limit counts
    on_progress: Callable[[int, StreamDelta], None] | None = None  # streamed: (prompt index, delta), driver thread

    def sequences_of(self, request_id: str) -> int:
        return int(self.requests[int(request_id.rsplit("-", 1)[1])][2].n)

    def command(self) -> AddRequests:
        return AddRequests(RequestGroup(self.group_id, tuple(self.requests), self.wait, self.sync,
                                        stream=self.on_progress is not None))


@dataclass
class _Control:
    cmd: Command
    timeout: float
    future: Future
    deadline: float = float("inf")  # set when rank 0 takes it
    index: int = 0  # rank 0 took it once it reports `applied` >= this
    replies: dict[int, Reply] = field(default_factory=dict)


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
        self._outbox: deque[_Group | Command] = deque()  # queue commands for rank 0, in order
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
        # rank 0 owes word while it has not reported taking every command sent, or said it steps on
        self._sent = 0
        self._applied = 0
        self._stepping = False
        self._heard = [time.monotonic()] * pool.size  # when each rank last said anything
        self._owed_since: float | None = None  # since when work is owed (None: nothing is)
        self._warned_step = -1  # the step whose overrun was logged
        self.activity: list[Heartbeat | None] = [None] * pool.size  # each rank's last heartbeat
        self._pause_until: float | None = None  # a pause's lease ends then (None: not paused)
        self._steps = 0  # the steps rank 0 reported running
        self._failed_steps: deque[int] = deque(maxlen=64)  # those of them that raised
        self._follower_failures: dict[int, tuple[int, str]] = {}  # step -> (rank, why), until rank 0 tells
        self._wake_r, self._wake_w = os.pipe()  # a new request or command wakes the thread's wait
        os.set_blocking(self._wake_w, False)
        self.busy: str | None = None  # the name of the control command running now
        # each rank's last reported status (its startup report until it sends another)
        self.statuses: list[RankStatus | None] = list(getattr(pool, "startup_statuses", None) or [None] * pool.size)
        self.tokens_total = 0
        # summed over finished requests (RequestOutput's num_cached_tokens and metrics): nothing extra crosses
        self.engine_counters = dict.fromkeys(ENGINE_COUNTERS, 0)
        self._token_events: deque[tuple[float, int]] = deque()
        self._thread = threading.Thread(target=self._loop, name="sidecar-driver", daemon=True)
        # Sends run on a thread of their own: a large command must not block the reads (rank 0 may be
        # sending a large report meanwhile, and waits for us to read it before it reads again).
        self._outgoing: queue.SimpleQueue[Command | None] = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_loop, name="sidecar-driver-send", daemon=True)

    # ---- entry points (any thread) ------------------------------------------------------------
    def start(self) -> None:
        self._sender.start()
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
        self._wake()
        self._outgoing.put(None)
        for thread in (self._thread, self._sender):
            if thread.is_alive():
                thread.join(timeout)

    def submit(self, requests: list[tuple[Any, SamplingParams]], wait: bool | WaitMode = True,
               sync: SyncPolicy = DEFAULT_SYNC_POLICY,
               on_progress: Callable[[int, StreamDelta], None] | None = None) -> Future:
        """Queue one group of prompts; the future resolves to their RequestOutputs in order, or to a
        RankError (a rejected prompt names its index; the whole group is then refused). The queue limit
        counts sequences (n per prompt), the unit of work and memory of the engine. `wait`: the call's
        own; what it holds through is commands.RequestGroup's `wait` (hold_while_asleep: "always"); a
        WaitMode string is used as is (the rollout pool's groups are held through every state).
        `sync`: what a weight sync does to them while they run (commands.RequestGroup). `on_progress`:
        stream them: called on the driver thread with (the prompt's index, each StreamDelta) before the future resolves
        (it must only hand the delta on, e.g. loop.call_soon_threadsafe)."""
        mode: WaitMode = (wait if isinstance(wait, str) else "never" if not wait
                          else "always" if self.hold_while_asleep else "sync")
        fut: Future = Future()
        sequences = sum(int(params.n) for _, params in requests)
        with self._cv:
            if self._refuse_locked(fut):
                return fut
            if self._paused and mode == "never":
                left = self.pause_left_s() or 0.0
                fut.set_exception(RankError(ErrorInfo(
                    "StateError", f"generation is paused (POST /pause; {left:.0f} s left on its lease, or until "
                    "POST /resume) and the call says wait: false", "state", "wait")))
                return fut
            if self._queued_sequences + sequences > self.max_queued:
                fut.set_exception(RankError(ErrorInfo(
                    "QueueFull", f"{self._queued_sequences} sequences are queued and this call adds {sequences}; "
                    f"the limit is {self.max_queued} (--max-queued-sequences): retry later", "busy")))
                return fut
            gid = f"g{next(self._ids)}"
            reqs = [(f"{gid}-{i}", prompt, params) for i, (prompt, params) in enumerate(requests)]
            group = _Group(gid, reqs, mode, fut, sync, pending=sequences, on_progress=on_progress)
            self._queued_sequences += sequences
            self._groups[gid] = group
            self._owner.update((rid, gid) for rid, _, _ in reqs)
            self._outbox.append(group)
        self._wake()
        return fut

    def abort(self, future: Future) -> None:
        """Cancel the group behind `future` (its caller went away)."""
        with self._cv:
            group = next((g for g in self._groups.values() if g.future is future), None)
            if group is None:
                return
            self._drop_locked(group)
            if group.sent:
                self._outbox.append(AbortRequests(tuple(rid for rid, _, _ in group.requests)))
            else:
                self._outbox.remove(group)
            future.cancel()
        self._wake()

    def call(self, cmd: Command, timeout: float | None = None) -> Future:
        """Run the control command `cmd` on every rank between two steps; the future resolves to the
        list of per-rank reply values (each a `type(cmd).reply`, rank order), or a RankError.
        Raises UnknownCommandError for an undeclared command, and for the queue commands (the driver's own)."""
        if isinstance(cmd, QUEUE_COMMANDS):
            raise UnknownCommandError(cmd, "Driver.call (the queue commands are the driver's own)")
        check_declared(cmd, "Driver.call")
        fut: Future = Future()
        with self._cv:
            if self._refuse_locked(fut):
                return fut
            self._controls.append(_Control(cmd, timeout or self.rpc_timeout_s, fut))
        self._wake()
        return fut

    def pause(self, lease_s: float) -> None:
        """Hold generation steps for `lease_s` seconds, or until resume(); another pause renews the lease.
        A client that pauses and goes away thus releases the ranks when its lease runs out."""
        with self._cv:
            if not self._paused:
                self._outbox.append(SetPaused(True))
            self._paused = True
            self._pause_until = time.monotonic() + lease_s
        self._wake()

    def resume(self) -> None:
        with self._cv:
            self._resume_locked()
        self._wake()

    def _resume_locked(self) -> None:
        if self._paused:
            self._outbox.append(SetPaused(False))
        self._paused, self._pause_until = False, None

    def pause_left_s(self) -> float | None:
        """Seconds left on the pause's lease (None: not paused)."""
        until = self._pause_until
        return None if until is None else max(0.0, until - time.monotonic())

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

    def held_weights(self) -> dict[str, dict[str, Any]]:
        """What the ranks hold, per model, from their last reports: the live `version` (rank 0's), `torn`
        (any rank) and `needs_sync` (the first rank's reason its bytes are not that version's, prefixed
        with the rank; None when every rank holds it). The one reading of /state, /v1/models, /metrics."""
        out: dict[str, dict[str, Any]] = {}
        for st in self.statuses:
            if st is None:
                continue
            for model, version in st.weight_versions.items():
                view = out.setdefault(model, {"version": version, "torn": False, "needs_sync": None})
                view["torn"] = view["torn"] or bool(st.torn.get(model))
                reason = st.needs_sync.get(model) or ("torn" if st.torn.get(model) else None)
                if reason is not None and view["needs_sync"] is None:
                    view["needs_sync"] = f"rank {st.rank}: {reason}"
        return out

    def rank_alive(self) -> list[bool]:
        """Whether each rank process is alive now (a dead one's last report is not its state)."""
        alive = getattr(self.pool, "alive", None)
        return list(alive()) if alive is not None else [True] * len(self.statuses)

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

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError):  # the pipe is full: the thread has wake-ups pending anyway
            os.write(self._wake_w, b"!")

    # ---- the thread -----------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while self._failure is not None and not self._stopping:
                    self._cv.wait(IDLE_POLL_S)
                if self._stopping:
                    return
                if self._pause_until is not None and time.monotonic() >= self._pause_until:
                    log.warning("the pause's lease ran out with no POST /resume or renewal: generation resumes")
                    self._resume_locked()
                outbox = self._take_outbox_locked()
            try:
                self._exchange(outbox)
            except RankFailure as e:
                self._broken(e)
            except Exception as e:  # a bug of ours: fail what was in flight, keep the thread alive
                log.exception("driver: unexpected error")
                with self._cv:
                    self._fail_all_locked(RankError(ErrorInfo(type(e).__name__, str(e), "internal")))

    def _send_loop(self) -> None:
        while True:
            cmd = self._outgoing.get()
            if cmd is None:
                return
            try:
                self.pool.send(cmd)
            except RankFailure as e:
                self._broken(e)
            except Exception as e:  # a bug of ours (an unpicklable command, say): the ranks cannot go on
                log.exception("driver: sending %s failed", type(cmd).__name__)
                self._broken(RankFailure(f"sending {type(cmd).__name__} to rank 0 failed: {e}", 0))

    def _broken(self, e: RankFailure) -> None:
        """The pool failed for good: fail every call, the control command on the ranks included."""
        with self._cv:
            self._fail_locked(str(e), e.rank)
            running, self._running, self.busy = self._running, None, None
        if running is not None:
            _settle(running.future, error=unavailable(str(e), self._rank_key(e.rank)))

    def _take_outbox_locked(self) -> list[Command]:
        """The queue commands to send now, then the next control command if none runs."""
        commands: list[Command] = []
        while self._outbox:
            item = self._outbox.popleft()
            if isinstance(item, _Group):
                item.sent = True
                commands.append(item.command())
            else:
                commands.append(item)
        while self._running is None and self._controls:
            ctl = self._controls.popleft()
            if ctl.future.set_running_or_notify_cancel():
                self._running, self.busy = ctl, type(ctl.cmd).__name__
                commands.append(ctl.cmd)
                ctl.index = self._sent + len(commands)
        return commands

    def _exchange(self, commands: list[Command]) -> None:
        """Send `commands` to rank 0, wait for word from any rank (or a wake-up), and absorb it."""
        for cmd in commands:
            self._outgoing.put(cmd)
        self._sent += len(commands)  # owed from now: a rank 0 that stopped reading is silent too
        messages = self.pool.receive(self._wait_s(), self._wake_r)
        now = time.monotonic()
        for rank, message in messages:
            self._heard[rank] = now
            if isinstance(message, Heartbeat):
                self._absorb_heartbeat(rank, message)
            elif isinstance(message, Events):
                self._absorb_events(rank, message)
            elif isinstance(message, Reply):
                self._absorb_reply(rank, message)
            else:
                raise RankFailure(f"rank {rank} sent {type(message).__name__}, which is no reply", rank)
        self._check_clocks()

    def _owes_word(self) -> bool:
        return self._running is not None or self._applied < self._sent or self._stepping

    def _wait_s(self) -> float:
        if self._running is not None:
            return max(0.0, min(IDLE_POLL_S, self._running.deadline - time.monotonic()))
        return IDLE_POLL_S  # heartbeats come every 0.25 s: the silence check needs no closer wake-up

    def _check_clocks(self) -> None:
        now = time.monotonic()
        running = self._running
        if running is not None and now >= running.deadline:
            pending = [r for r in range(self.pool.size) if r not in running.replies]
            raise self.pool.timed_out(pending, type(running.cmd).__name__, running.timeout)
        if not self._owes_word():
            self._owed_since = None
            return
        if self._owed_since is None:
            self._owed_since = now
        since = self._owed_since
        silent = [r for r in range(self.pool.size) if now - max(self._heard[r], since) >= self.step_timeout_s]
        if silent:
            others = [r for r in range(self.pool.size) if r not in silent]
            raise self.pool.timed_out(silent + others, "its heartbeat", self.step_timeout_s)

    def _absorb_heartbeat(self, rank: int, beat: Heartbeat) -> None:
        """A sign of life with what the rank does; rank 0's also tells which commands it took."""
        self.activity[rank] = beat
        if rank == 0:  # busy until its next word says otherwise (the rank orders its messages so)
            self._took(beat.applied)
            self._stepping = self._stepping or beat.doing is not None
        if beat.doing == "step" and beat.for_s >= self.step_timeout_s and self._warned_step != beat.steps:
            self._warned_step = beat.steps
            log.warning("rank %d: step %d has run %.0f s, past --step-timeout-s (%g s); waiting for it: the "
                        "rank still answers its heartbeat (a rank silent that long is hung)", rank, beat.steps,
                        beat.for_s, self.step_timeout_s)

    def _took(self, applied: int) -> None:
        """Rank 0 took `applied` commands: a control command among them has its clock started now."""
        self._applied = max(self._applied, applied)
        running = self._running
        if running is not None and running.deadline == float("inf") and self._applied >= running.index:
            running.deadline = time.monotonic() + running.timeout

    def _absorb_events(self, rank: int, events: Events) -> None:
        if rank != 0:  # another rank speaks up only when its step failed: fine if rank 0's failed too
            info = events.failed
            why = f"{info.type}: {info.message}" if info is not None else "an unexpected report"
            self._follower_failures[events.steps] = (rank, why)
            self._check_follower_failures()
            return
        self._steps = events.steps
        if events.failed is not None:
            self._failed_steps.append(events.steps)
        self._check_follower_failures()
        self._took(events.applied)
        with self._cv:
            self._stepping = events.stepping
            self.statuses[0] = events.status
            for delta in events.progress:  # before `finished`: a group's deltas precede its outputs
                gid = self._owner.get(delta.request_id)
                group = self._groups.get(gid) if gid is not None else None
                if group is not None and group.on_progress is not None:
                    group.on_progress(int(delta.request_id.rsplit("-", 1)[1]), delta)
            for gid, err in events.rejected.items():
                group = self._groups.get(gid)
                if group is not None:
                    self._drop_locked(group)
                    _settle(group.future, error=RankError(err))  # an awaiting HTTP task may have been cancelled
            self._resolve_locked(events.finished)
            if events.failed is not None:  # rank 0 dropped every request it held: fail their groups
                error = RankError(events.failed)
                for gid in dict.fromkeys(rid.rsplit("-", 1)[0] for rid in events.dropped):
                    group = self._groups.get(gid)
                    if group is not None:
                        self._drop_locked(group)
                        _settle(group.future, error=error)

    def _check_follower_failures(self) -> None:
        """A step that raised on another rank but not on rank 0 (once rank 0 reported past it): the ranks
        no longer hold the same requests, and cannot go on."""
        for step, (rank, why) in list(self._follower_failures.items()):
            if step in self._failed_steps:
                del self._follower_failures[step]  # every rank dropped the same requests
            elif self._steps >= step:
                raise RankFailure(f"rank {rank} failed step {step} ({why}) and rank 0 did not: the ranks no longer "
                                  "hold the same requests", rank)

    def _absorb_reply(self, rank: int, reply: Reply) -> None:
        running = self._running
        if running is None or rank in running.replies:
            raise RankFailure(f"rank {rank} answered a control command that is not running", rank)
        running.replies[rank] = reply
        with self._cv:
            if reply.status is not None:
                self.statuses[rank] = reply.status
            self._resolve_locked(reply.finished)
            if len(running.replies) < self.pool.size:
                return
            self._running, self.busy = None, None
        replies = [running.replies[r] for r in range(self.pool.size)]
        failed = next((r.error for r in replies if not r.ok), None)
        if failed is not None:
            _settle(running.future, error=RankError(failed, [r.error for r in replies if r.error]))
        else:
            _settle(running.future, [r.value for r in replies])

    # ---- bookkeeping (caller holds the lock) ----------------------------------------------------
    def _resolve_locked(self, finished: list[RequestOutput]) -> None:
        if finished:
            now = time.monotonic()
            tokens = sum(len(c.token_ids) for out in finished for c in out.outputs)
            self.tokens_total += tokens
            for out in finished:
                self.engine_counters["prefix_cache_hit_tokens"] += out.num_cached_tokens
                for name in METRICS_COUNTERS:
                    self.engine_counters[name] += int(out.metrics.get(name, 0))
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

    def _fail_all_locked(self, error: RankError) -> None:
        """Fail every pending group and control call."""
        for group in list(self._groups.values()):
            self._drop_locked(group)
            if not group.future.done():
                group.future.set_exception(error)
        self._outbox.clear()
        while self._controls:
            ctl = self._controls.popleft()
            if not ctl.future.done():
                ctl.future.set_exception(error)
        self._cv.notify_all()
