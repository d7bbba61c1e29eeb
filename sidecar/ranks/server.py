"""The rank side of sidecar/ranks/pool.py: one TP rank's process, its LLM, and its engine loop.

`RankServer.serve` is the loop: at each step boundary it applies the commands that arrived
(sidecar/ranks/commands.py) in order, then runs one llm.step() when the engine has work, is ready
and is not paused; with nothing to do it blocks on its pipe. Rank 0 reads the sidecar process's pipe
and hands each boundary's commands to every other rank over a pipe of its own, so all ranks apply
the same commands at the same boundary and take the same steps (SPMD). Queue commands add request
groups (all or nothing, already tokenized; one the engine cannot serve now is refused or held as its
`wait` says), abort requests or pause. Control commands run between steps, never mid-step, through
one table (`RankServer.handlers`); every rank answers each with a Reply carrying its status. Rank 0
reports finished outputs, refused groups, the new tokens of streamed groups and its status in
`Events` after each boundary with news.
Every rank also runs a heartbeat thread: whatever its loop does (a step of minutes, a weight command),
it sends a `Heartbeat` (what it does, for how long) whenever it sent nothing for HEARTBEAT_S (rank 0
not while it waits for commands), so the driver tells a busy rank from a stopped one; every send
holds one lock (a pipe is not thread-safe). What the weights are and whether a step may run are
asked of the engine (`worker.weights`, `worker.is_ready()`) at each use; this server keeps no copy.
The engine's modules (torch, the LLM) are imported inside the functions that run on the rank.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

from checksum import Manifest
from inference.core import InvalidRequestError, RequestOutput, StateError
from inference.memory.host_heap import freeze_startup_heap
from inference.memory.sleep import TransitionStats
from sidecar.child_process import die_with_parent
from sidecar.log_format import setup_logging
from sidecar.ranks.commands import (
    AbortRequests,
    AbortWeightUpdate,
    AddRequests,
    Command,
    ErrorInfo,
    Events,
    Heartbeat,
    InitWeightTransfer,
    RankPlan,
    RankSpec,
    RankStatus,
    ReadManifest,
    Reply,
    RequestGroup,
    SetPaused,
    Sleep,
    Stop,
    StreamDelta,
    SyncResult,
    TokenizedPrompt,
    TransferJoined,
    UnknownCommandError,
    UpdateReply,
    UpdateWeights,
    WaitMode,
    WakeUp,
)

log = logging.getLogger(__name__)

HEARTBEAT_S = 0.25  # every rank says something at least this often, busy or not: the driver's sign of life


def rank_main(spec: RankSpec, conn: Connection, followers: tuple[Connection, ...] = (),
              leader: Connection | None = None) -> None:
    """Entry point of a rank process (multiprocessing spawn). Rank 0 gets the sending ends of a pipe to
    every other rank (`followers`); each other rank the receiving end of its own (`leader`)."""
    die_with_parent(spec.parent_pid, signal.SIGKILL)  # else the closed Pipe ends the command loop
    # Ctrl-C in a terminal signals the whole process group: the parent decides how the ranks stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    setup_logging(spec.log_level, spec.log_format, f"rank{spec.rank}")
    try:
        llm = _build_llm(spec)
        server = RankServer(llm, conn, spec.rank, followers=followers, leader=leader)
        server.gc_frozen = freeze_startup_heap().objects
        server.post(Reply(True, server.plan(), status=server.status()))
    except BaseException as e:
        log.exception("rank %d failed to start", spec.rank)
        conn.send(Reply(False, error=error_info(e)))
        return
    try:
        server.serve()
    finally:
        server.shutdown()
    _exit_released()


def _exit_released() -> None:
    """End a rank whose shutdown released what it holds (transfer group, TP group, device memory) without
    the interpreter's teardown: the rank froze its heap (inference/memory/host_heap.py), whose teardown
    costs about a second of deallocation on a small host, against the pool's 2 s for a stop, and frees
    nothing anyone waits for."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)


def _build_llm(spec: RankSpec) -> Any:
    import torch
    import torch.distributed as dist

    from inference.engine.llm import LLM
    from inference.parallel import TPInfo

    torch.set_num_threads(spec.num_threads)
    engine = spec.engine
    if engine.device == "cuda":
        torch.cuda.set_device(spec.rank)
        engine = dataclasses.replace(engine, device=f"cuda:{spec.rank}")
    tp = None
    if spec.size > 1:
        device_id = torch.device("cuda", spec.rank) if spec.backend == "nccl" else None  # bind NCCL to our GPU
        dist.init_process_group(spec.backend, store=_tp_store(spec), rank=spec.rank, world_size=spec.size,
                                timeout=timedelta(seconds=spec.dist_timeout_s), device_id=device_id)
        tp = TPInfo(rank=spec.rank, size=spec.size, group=dist.group.WORLD)
    return LLM(config=engine, tp=tp, dp_rank=spec.dp_rank)


def _tp_store(spec: RankSpec) -> Any:
    """The TP group's store on loopback: rank 0 serves it on 127.0.0.1 only (torch's tcp:// init method
    would listen on every interface, unauthenticated), the other ranks dial it."""
    import torch.distributed as dist

    from inference.transfer.groups import master_store

    if spec.rank == 0:
        return master_store("127.0.0.1", spec.dist_port, spec.size, spec.dist_timeout_s)
    return dist.TCPStore("127.0.0.1", spec.dist_port, spec.size, False, timedelta(seconds=spec.dist_timeout_s))


def error_info(e: BaseException, rank: str | None = None, index: int | None = None) -> ErrorInfo:
    """Classify an exception for the HTTP layer (the kind picks the status code)."""
    from checksum import ChecksumMismatch
    from inference.memory.arenas import DeviceMemoryError
    from inference.transfer.groups import TransferError

    name = type(e).__name__
    if isinstance(e, InvalidRequestError):
        return ErrorInfo(name, e.message, "invalid", e.field, rank, index)
    if isinstance(e, ChecksumMismatch):
        return ErrorInfo(name, str(e), "checksum", None, rank, index)
    if isinstance(e, TransferError):
        return ErrorInfo(name, str(e), "transfer", None, rank, index)
    if isinstance(e, DeviceMemoryError):
        return ErrorInfo(name, str(e), "memory", None, rank, index)
    if isinstance(e, StateError):
        return ErrorInfo(name, str(e), "state", None, rank, index)
    return ErrorInfo(name, str(e) or name, "internal", None, rank, index)


class RankServer:
    """Runs one rank's engine loop; `request_ids` are the requests this rank's engine still holds.

    `handlers` is the table of control commands: each maps to one method here, and nothing else is
    dispatched. Rank 0 has `followers` (pipes to the other ranks); another rank has its `leader`.
    """

    def __init__(self, llm: Any, conn: Connection, rank: int, *, followers: tuple[Connection, ...] = (),
                 leader: Connection | None = None) -> None:
        self.llm = llm
        self.weights = llm.worker.weights  # a sync runs through the engine's WeightUpdater directly
        self.conn = conn
        self.rank = rank
        self.followers = followers
        self.leader = leader
        self.request_ids: set[str] = set()
        self.paused = False
        self.applied = 0  # commands taken from the sidecar process (rank 0)
        self.steps = 0  # steps run (the same count on every rank)
        self.gc_frozen = 0  # objects rank_main froze once this server was built (inference/memory/host_heap.py)
        self._forward: list[Command] = []  # rank 0: commands of its own for the next boundary
        self._rejected: dict[str, ErrorInfo] = {}
        # rank 0: streamed requests -> per sample (tokens reported, restarts when reported)
        self._streams: dict[str, dict[int, tuple[int, int]]] = {}
        self._will_step = False  # can_step() as of the end of the last boundary (no command since)
        self._reported_stepping = False
        self._last_report = 0.0
        self._send_lock = threading.Lock()
        self._last_sent = time.monotonic()
        self._doing: tuple[str | None, float] = (None, time.monotonic())  # read by the heartbeat thread
        self._beating = threading.Event()
        self.handlers: dict[type[Command], Callable[[Any], Any]] = {
            Sleep: self._sleep, WakeUp: self._wake_up,
            InitWeightTransfer: self._init_weight_transfer, UpdateWeights: self._update_weights,
            AbortWeightUpdate: self._abort_weight_update, ReadManifest: self._read_manifest,
        }

    # ---- the loop ---------------------------------------------------------------------------
    def serve(self) -> None:
        """Step while there is work; apply the commands of each boundary first. Returns at Stop, or
        when the sidecar process (or, on another rank, rank 0) is gone."""
        beat = threading.Thread(target=self._heartbeat, name=f"rank{self.rank}-heartbeat", daemon=True)
        self._beating.set()
        beat.start()
        try:
            self._serve()
        finally:
            self._beating.clear()

    def _serve(self) -> None:
        while True:
            commands = self._boundary()
            if commands is None:
                log.warning("rank %d: its command pipe closed (the sidecar process or rank 0 is gone); exiting",
                            self.rank)
                return
            for cmd in commands:
                if isinstance(cmd, Stop):
                    return
                self.apply(cmd)
            self.step(bool(commands))

    def can_step(self) -> bool:
        """Whether this boundary runs a step: the same answer on every rank (their states are SPMD)."""
        return not self.paused and self.llm.has_unfinished() and self.llm.worker.is_ready()

    def _boundary(self) -> list[Command] | None:
        """The commands every rank applies at this boundary, in order (None: the sender is gone). Rank 0
        takes what arrived (waiting only while it has no step to run) and hands it on."""
        try:
            if self.leader is not None:
                return list(self.leader.recv())
            commands, self._forward = self._forward, []
            if not commands and not self._will_step:
                commands.append(self.conn.recv())  # nothing to do until the sidecar process sends
                self.applied += 1
            while self.conn.poll():
                commands.append(self.conn.recv())
                self.applied += 1
            for follower in self.followers:
                follower.send(tuple(commands))
        except (EOFError, OSError):
            return None
        return commands

    def apply(self, cmd: object) -> None:
        """One command at a step boundary: a queue command here, a control command through the table
        (every rank answers it)."""
        if type(cmd) is AddRequests:
            error = self._add_group(cmd.group)
            if error is not None:
                self._rejected[cmd.group.group_id] = error
        elif type(cmd) is AbortRequests:
            for rid in cmd.request_ids:
                self.llm.abort(rid)
                self.request_ids.discard(rid)
                self._streams.pop(rid, None)
        elif type(cmd) is SetPaused:
            self.paused = cmd.paused
        else:
            self._send(self.handle(cmd))

    def step(self, news: bool = False) -> None:
        """Run one engine step if this boundary may; rank 0 then reports what there is to tell (`news`:
        it took commands at this boundary, so the driver awaits word of them). A step that raises
        drops every request (the engine's state is suspect) and every rank says so: the driver fails
        those requests when rank 0 failed that step too, else the ranks no longer hold the same
        requests and it breaks the pool."""
        finished: list[RequestOutput] = []
        failed, dropped = None, ()
        if self._will_step if not news else self.can_step():
            self.steps += 1
            self._set_doing("step")
            try:
                finished = self.llm.step()
            except Exception as e:
                log.exception("rank %d: a step failed; dropping every request", self.rank)
                failed, dropped = error_info(e, self.rank_key), tuple(sorted(self.request_ids))
                self._abort_all()
                if self.followers:  # the others drop them too, at the next boundary
                    self._forward.append(AbortRequests(dropped))
        self._set_doing(None)  # before the report: no heartbeat says "step" after it
        finished = self._take_finished(finished)
        stepping = self._will_step = self.can_step()
        if self.rank != 0:
            if failed is not None:
                self.post(Events(self.applied, False, self.steps, self.status(), failed=failed, dropped=dropped))
            return
        progress = self._take_progress() if self._streams else []
        now = time.monotonic()
        if (news or finished or progress or self._rejected or failed is not None or stepping != self._reported_stepping
                or (stepping and now - self._last_report >= HEARTBEAT_S)):
            rejected, self._rejected = self._rejected, {}
            self.post(Events(self.applied, stepping, self.steps, self.status(), finished, rejected, failed,
                             dropped, progress))
            self._reported_stepping, self._last_report = stepping, now

    def _take_progress(self) -> list[StreamDelta]:
        """The tokens streamed requests committed since their last delta (rank 0)."""
        deltas = []
        for rid, reported in self._streams.items():
            for s in self.llm.live_sequences(rid):
                done, restarts = reported.get(s.index, (0, s.restarts))
                if restarts != s.restarts:
                    done = 0  # sent back to its prompt: its completion starts again
                committed = s.num_generated - s.num_pending
                if committed <= done:
                    continue
                first, stop = s.num_prompt_tokens + done, s.num_prompt_tokens + committed
                tops = tuple(s.top_logprobs[done:committed]) if s.top_logprobs is not None else None
                deltas.append(StreamDelta(rid, s.index, done, s.restarts, tuple(s.token_ids[first:stop]),
                                          tuple(s.logprobs[done:committed]), tops))
                reported[s.index] = (committed, s.restarts)
        return deltas

    def handle(self, cmd: object) -> Reply:
        """Run one control command through the table; any failure becomes the reply's ErrorInfo."""
        self._set_doing(type(cmd).__name__)
        try:
            handler = self.handlers.get(type(cmd))  # exact type: a subclass is not declared
            if handler is None:
                raise UnknownCommandError(cmd, f"rank {self.rank_key}")
            value = handler(cmd)
            assert isinstance(value, type(cmd).reply), f"{type(cmd).__name__} answered {type(value).__name__}"
            reply = Reply(True, value, finished=self._take_finished())
        except Exception as e:
            log.debug("rank %d: %s failed", self.rank, type(cmd).__name__, exc_info=True)
            reply = Reply(False, error=error_info(e, self.rank_key))
        reply.status = self.status()
        self._set_doing(None)  # before the reply: no heartbeat names the command after it
        return reply

    def post(self, message: Reply | Events | Heartbeat) -> None:
        """Send one message to the sidecar process (the loop's and the heartbeat thread's, under one lock)."""
        with self._send_lock:
            self.conn.send(message)
            self._last_sent = time.monotonic()

    def _set_doing(self, what: str | None) -> None:
        """What the loop does now, under the send lock: a heartbeat is either sent before the change or
        says the new state (rank 0's driver reads "busy" from the last word it got)."""
        with self._send_lock:
            self._doing = (what, time.monotonic())

    def _heartbeat(self) -> None:
        """The heartbeat thread: a Heartbeat whenever nothing was sent for HEARTBEAT_S, until serve ends.
        Rank 0 stays silent while it does nothing (it owes nothing then); another rank always beats, as
        it may wait on rank 0 while work is owed."""
        while self._beating.is_set():
            time.sleep(HEARTBEAT_S / 2)
            with self._send_lock:
                doing, since = self._doing
                now = time.monotonic()
                if now - self._last_sent < HEARTBEAT_S or (doing is None and self.rank == 0):
                    continue
                try:
                    self.conn.send(Heartbeat(self.applied, self.steps, doing, now - since))
                except (OSError, ValueError):  # the sidecar process is gone: the loop sees it and returns
                    return
                self._last_sent = now

    def _send(self, reply: Reply) -> None:
        try:
            self.post(reply)
        except (TypeError, AttributeError, ValueError) as e:  # an unpicklable result: report, don't die
            self.post(Reply(False, error=ErrorInfo(type(e).__name__, f"reply not serializable: {e}",
                                                        "internal", None, self.rank_key), status=reply.status))

    # ---- generation -------------------------------------------------------------------------
    def _add_group(self, group: RequestGroup) -> ErrorInfo | None:
        try:
            self._admit(group.wait)
        except StateError as e:
            return error_info(e, self.rank_key)
        added: list[str] = []
        policy = {"on_sync": group.sync.on_sync, "max_staleness": group.sync.max_staleness,
                  "share": group.group_id}  # one HTTP call, one turn of fair admission
        for index, (rid, prompt, params) in enumerate(group.requests):
            try:
                if isinstance(prompt, TokenizedPrompt):
                    self.llm.add_request(prompt.token_ids, params, rid, prompt_text=prompt.text, **policy)
                else:
                    self.llm.add_request(prompt, params, rid, **policy)
            except Exception as e:
                for done in added:  # all or nothing: the caller gets one answer for the whole group
                    self.llm.abort(done)
                    self.request_ids.discard(done)
                return error_info(e, self.rank_key, index)
            added.append(rid)
            self.request_ids.add(rid)
        if group.stream and self.rank == 0:
            self._streams.update((rid, {}) for rid in added)
        return None

    def _admit(self, wait: WaitMode) -> None:
        """Refuse (StateError) a group that the engine cannot serve now unless `wait` holds it through
        the reason (sidecar/ranks/commands.py RequestGroup). Every rank decides the same: the states are SPMD."""
        llm = self.llm
        if wait == "always":
            return
        if wait == "never":
            llm.check_ready()
            return
        if llm.is_sleeping:
            tags = ", ".join(f"{t}: {a['state']}" for t, a in llm.worker.memory.states().items())
            raise StateError(f"the sidecar is asleep ({tags}): wake it first (POST /wake_up, SidecarClient.wake_up() "
                             "or WeightSyncHook.wake()); a sidecar launched with --hold-while-asleep holds "
                             "requests until then instead")
        if llm.worker.weights.needs_trainer():  # torn, or waiting for a first sync
            llm.check_ready()

    def _take_finished(self, stepped: list[RequestOutput] | None = None) -> list[RequestOutput]:
        """What finished: a step's outputs, then those finished outside a step (a sleep's drain, the
        step in flight a weight sync settled); reported by rank 0 only."""
        outs = (stepped or []) + self.llm.take_finished()
        for out in outs:
            self.request_ids.discard(out.request_id)
            self._streams.pop(out.request_id, None)
        return outs if self.rank == 0 else []

    def _abort_all(self) -> None:
        for rid in sorted(self.request_ids):
            self.llm.abort(rid)
        self.request_ids.clear()
        self._streams.clear()

    # ---- control commands -------------------------------------------------------------------
    def _sleep(self, cmd: Sleep) -> TransitionStats:
        return self.llm.sleep(cmd.level, cmd.in_flight)

    def _wake_up(self, cmd: WakeUp) -> TransitionStats:
        return self.llm.wake_up(list(cmd.tags) if cmd.tags is not None else None)

    def _init_weight_transfer(self, cmd: InitWeightTransfer) -> TransferJoined:
        return TransferJoined(self.weights.init_transfer(cmd.info))

    def _update_weights(self, cmd: UpdateWeights) -> UpdateReply:
        begin = time.perf_counter()
        start = cmd.start
        receiver = self.weights.receiver
        joined = receiver.info.session_id if receiver is not None else None
        if cmd.session_id is not None and joined is not None and joined != cmd.session_id:
            raise StateError(f"rank {self.rank_key}: the update belongs to transfer session {cmd.session_id}, this "
                             f"rank's group is session {joined}'s (another init replaced it): nothing was received")
        try:
            self.weights.start(start.model, start.version, start.manifest, allow_cast=start.allow_cast)
        except Exception as e:
            # The trainer's send() waits in the plan agreement: refuse it, so it fails now, not at its timeout.
            try:
                self.weights.refuse_update()
            except Exception as refusal:  # the group is broken now; the start's error is the answer
                log.warning("rank %d: refusing the update after its failed start failed too: %s", self.rank,
                            refusal)
                e.add_note(f"refusing the sender's plan agreement failed too: {refusal}")
            raise
        start_s = time.perf_counter() - begin
        delivered = self.weights.update(cmd.info, digests_follow=True, owner=cmd.nonce)
        return UpdateReply(start_s, self._finish(delivered), time.perf_counter() - begin)

    def _finish(self, digests: Any) -> SyncResult:
        # The audit is the whole of finish; nobody reads a held manifest here (GET /checksums digests afresh).
        t0 = time.perf_counter()
        result = self.weights.finish(digests, held_manifest=False)
        audit_s = time.perf_counter() - t0
        report = result.report
        return SyncResult(result.model, result.version, result.rank, report.ok, report.summary(),
                          report.tensors_checked, result.received.algorithm, audit_s,
                          result.installed_checked)

    def _abort_weight_update(self, cmd: AbortWeightUpdate) -> bool:
        weights = self.weights
        was_open = any(weights.state(m)["session_open"] for m in weights.versions)
        weights.abort(cmd.reason)
        return was_open

    def _read_manifest(self, cmd: ReadManifest) -> Manifest:
        """A manifest of `cmd.model`; while the updater says the bytes are not the live version's (torn, or
        dropped by a level-2 sleep: `needs_sync`) it carries that reason as its torn_reason, and its
        weight_version is then the live version the bytes are NOT."""
        weights = self.weights
        if cmd.source == "held":
            manifest = weights.held_manifest(cmd.model, cmd.algorithm)
        elif cmd.source == "received":
            manifest = weights.received_manifest(cmd.model, cmd.algorithm)
        else:
            raise InvalidRequestError("source", f"must be 'held' or 'received', got {cmd.source!r}")
        reason = weights.needs_sync_reason(cmd.model)
        return dataclasses.replace(manifest, torn_reason=reason) if reason is not None else manifest

    def plan(self) -> RankPlan:
        """This rank's device memory plan and model facts (reported once, at startup), and the torch
        thread count it runs with (--threads, or the default of sidecar/ranks/pool.py `rank_threads`)."""
        import torch

        from inference.memory.arenas import KV_TAG, WEIGHT_TAGS

        llm, worker = self.llm, self.llm.worker
        mem = worker.memory
        assert mem is not None
        return RankPlan(
            rank=self.rank_key, pid=os.getpid(), device=str(worker.device),
            dtype=str(worker.dtype).removeprefix("torch."),
            weights_bytes={t: mem.arena(t).nbytes for t in WEIGHT_TAGS if t in mem.tags},
            kv_blocks=worker.num_blocks, kv_bytes=mem.arena(KV_TAG).nbytes if KV_TAG in mem.tags else 0,
            block_size=llm.config.cache.block_size, max_model_len=llm.max_model_len,
            vocab_size=llm.model_config.vocab_size, models=tuple(sorted(worker.models)),
            model=str(llm.config.model), draft_model=llm.config.draft_model,
            has_tokenizer=llm.tokenizer is not None, num_threads=torch.get_num_threads(), warm_up_s=llm.warm_up_s,
            routing_row_bytes=worker.runner.routing.row_bytes if worker.runner and worker.runner.routing else 0)

    @property
    def rank_key(self) -> str:
        return str(self.llm.worker.rank_key)

    def status(self) -> RankStatus:
        worker = self.llm.worker
        weights = worker.weights
        arenas = worker.memory.states() if worker.memory is not None else {}
        return RankStatus(
            rank=self.rank_key, pid=os.getpid(), ready=worker.is_ready(), sleeping=self.llm.is_sleeping,
            arenas={tag: str(a["state"]) for tag, a in arenas.items()},
            weight_versions=weights.versions, torn=weights.torn, loaded=weights.loaded,
            unfinished=len(self.request_ids), gc_frozen=self.gc_frozen, needs_sync=weights.needs_sync)

    def shutdown(self) -> None:
        worker = self.llm.worker
        for step in (worker.weights.close_transfer, worker.shutdown, _destroy_group):
            try:
                step()
            except Exception:  # exiting anyway: log and keep releasing the rest
                log.exception("rank %d: shutdown step %s failed", self.rank, getattr(step, "__name__", step))


def _destroy_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
