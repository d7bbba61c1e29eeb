"""The rank side of sidecar/ranks/pool.py: one TP rank's process, its LLM, and the command loop.

Commands (sidecar/ranks/commands.py) arrive over the Pipe in the same order on every rank and are
dispatched by their type through one table (`RankServer.handlers`) to the handler below; a message
the table does not hold is refused with UnknownCommandError naming it. `Step` aborts, adds the new
request groups (a group is all-or-nothing: the prompts of one HTTP call, already tokenized by the
sidecar process; one the engine cannot serve now is refused or held as its `wait` says) and runs one
llm.step(); every rank returns the rejected groups (the same on every rank: validation is
deterministic), rank 0 also the finished RequestOutputs. `Stop` ends the loop without a reply.
Every reply carries this rank's status (sleep state per tag, weight versions, torn flags), so the
parent always has a fresh snapshot without asking. Exceptions travel back as ErrorInfo. What the
weights are (versions, torn, received manifests) and whether a step may run are asked of the engine
(`worker.weights`, `worker.is_ready()`) at each use; this server keeps no copy.

The engine's modules (torch, the LLM) are imported inside the functions that run on the rank: the
sidecar process imports this module for `rank_main` and stays free of them.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
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
from sidecar.ranks.commands import (
    AbortWeightUpdate,
    Command,
    ErrorInfo,
    FinishWeightUpdate,
    InitWeightTransfer,
    RankPlan,
    RankSpec,
    RankStatus,
    ReadManifest,
    Rejections,
    Reply,
    RequestGroup,
    Sleep,
    StartWeightUpdate,
    Step,
    Stop,
    SyncResult,
    TokenizedPrompt,
    UnknownCommandError,
    UpdateReply,
    UpdateWeights,
    WaitMode,
    WakeUp,
)

log = logging.getLogger(__name__)


def rank_main(spec: RankSpec, conn: Connection) -> None:
    """Entry point of a rank process (multiprocessing spawn)."""
    die_with_parent(spec.parent_pid, signal.SIGKILL)  # else the closed Pipe ends the command loop
    # Ctrl-C in a terminal signals the whole process group: the parent decides how the ranks stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=spec.log_level.upper(),
                        format=f"%(asctime)s rank{spec.rank} %(levelname)s %(name)s: %(message)s")
    try:
        llm = _build_llm(spec)
        server = RankServer(llm, conn, spec.rank)
        server.gc_frozen = freeze_startup_heap().objects
        conn.send(Reply(True, server.plan(), status=server.status()))
    except BaseException as e:
        log.exception("rank %d failed to start", spec.rank)
        conn.send(Reply(False, error=error_info(e)))
        return
    try:
        server.serve()
    finally:
        server.shutdown()


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
    """Serves one rank's commands; `request_ids` are the requests this rank's engine still holds.

    `handlers` is the command table: every command of sidecar/ranks/commands.py except Stop (which ends
    `serve`) maps to one method here, and nothing else is dispatched.
    """

    def __init__(self, llm: Any, conn: Connection, rank: int) -> None:
        self.llm = llm
        self.weights = llm.worker.weights  # a sync runs through the engine's WeightUpdater directly
        self.conn = conn
        self.rank = rank
        self.request_ids: set[str] = set()
        self._finished: list[RequestOutput] = []  # finished by the current command's steps, not yet sent
        self.gc_frozen = 0  # objects rank_main froze once this server was built (inference/memory/host_heap.py)
        self.handlers: dict[type[Command], Callable[[Any], Any]] = {
            Step: self._step, Sleep: self._sleep, WakeUp: self._wake_up,
            InitWeightTransfer: self._init_weight_transfer, StartWeightUpdate: self._start_weight_update,
            UpdateWeights: self._update_weights, FinishWeightUpdate: self._finish_weight_update,
            AbortWeightUpdate: self._abort_weight_update, ReadManifest: self._read_manifest,
        }

    # ---- the loop ---------------------------------------------------------------------------
    def serve(self) -> None:
        while True:
            try:
                cmd = self.conn.recv()
            except (EOFError, OSError):
                log.warning("rank %d: the sidecar process is gone; exiting", self.rank)
                return
            if isinstance(cmd, Stop):
                return
            self._send(self.handle(cmd))

    def handle(self, cmd: object) -> Reply:
        """Run one command through the table; any failure becomes the reply's ErrorInfo."""
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
        return reply

    def _send(self, reply: Reply) -> None:
        try:
            self.conn.send(reply)
        except (TypeError, AttributeError, ValueError) as e:  # an unpicklable result: report, don't die
            self.conn.send(Reply(False, error=ErrorInfo(type(e).__name__, f"reply not serializable: {e}",
                                                        "internal", None, self.rank_key), status=reply.status))

    # ---- generation -------------------------------------------------------------------------
    def _step(self, cmd: Step) -> Rejections:
        for rid in cmd.aborts:
            self.llm.abort(rid)
            self.request_ids.discard(rid)
        rejected = {}
        for group in cmd.groups:
            error = self._add_group(group)
            if error is not None:
                rejected[group.group_id] = error
        if cmd.run and self.request_ids and self.llm.worker.is_ready():
            try:
                self._finished += self.llm.step()
            except Exception:
                self._abort_all()  # the engine's state is suspect: drop every request, report the error
                raise
        return Rejections(rejected)

    def _add_group(self, group: RequestGroup) -> ErrorInfo | None:
        try:
            self._admit(group.wait)
        except StateError as e:
            return error_info(e, self.rank_key)
        added: list[str] = []
        for index, (rid, prompt, params) in enumerate(group.requests):
            try:
                if isinstance(prompt, TokenizedPrompt):
                    self.llm.add_request(prompt.token_ids, params, rid, prompt_text=prompt.text)
                else:
                    self.llm.add_request(prompt, params, rid)
            except Exception as e:
                for done in added:  # all or nothing: the caller gets one answer for the whole group
                    self.llm.abort(done)
                    self.request_ids.discard(done)
                return error_info(e, self.rank_key, index)
            added.append(rid)
            self.request_ids.add(rid)
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

    def _take_finished(self) -> list[RequestOutput]:
        """What finished in this command: its steps' outputs, then those sleep() drained."""
        outs, self._finished = self._finished + self.llm.take_finished(), []
        for out in outs:
            self.request_ids.discard(out.request_id)
        return outs if self.rank == 0 else []

    def _abort_all(self) -> None:
        for rid in sorted(self.request_ids):
            self.llm.abort(rid)
        self.request_ids.clear()

    # ---- control commands -------------------------------------------------------------------
    def _sleep(self, cmd: Sleep) -> TransitionStats:
        return self.llm.sleep(cmd.level, cmd.in_flight)

    def _wake_up(self, cmd: WakeUp) -> TransitionStats:
        return self.llm.wake_up(list(cmd.tags) if cmd.tags is not None else None)

    def _init_weight_transfer(self, cmd: InitWeightTransfer) -> None:
        self.weights.init_transfer(cmd.info)

    def _start_weight_update(self, cmd: StartWeightUpdate) -> None:
        self.weights.start(cmd.model, cmd.version, cmd.manifest, allow_cast=cmd.allow_cast)

    def _update_weights(self, cmd: UpdateWeights) -> UpdateReply:
        begin = time.perf_counter()
        start_s = 0.0
        if cmd.start is not None:
            t0 = time.perf_counter()
            try:
                self._start_weight_update(cmd.start)
            except Exception as e:
                # The trainer's send() waits in the plan agreement: refuse it, so it fails now, not at its timeout.
                try:
                    self.weights.refuse_update()
                except Exception as refusal:  # the group is broken now; the start's error is the answer
                    log.warning("rank %d: refusing the update after its failed start failed too: %s", self.rank,
                                refusal)
                    e.add_note(f"refusing the sender's plan agreement failed too: {refusal}")
                raise
            start_s = time.perf_counter() - t0
        delivered = self.weights.update(cmd.info, digests_follow=cmd.finish)
        result = self._finish(delivered) if cmd.finish else None
        return UpdateReply(start_s, result, time.perf_counter() - begin)

    def _finish_weight_update(self, cmd: FinishWeightUpdate) -> SyncResult:
        return self._finish(cmd.digests)

    def _finish(self, digests: Any) -> SyncResult:
        # The audit is the whole of finish; nobody reads a held manifest here (GET /checksums digests afresh).
        t0 = time.perf_counter()
        result = self.weights.finish(digests, held_manifest=False)
        audit_s = time.perf_counter() - t0
        report = result.report
        return SyncResult(result.model, result.version, result.rank, report.ok, report.summary(),
                          report.tensors_checked, result.received.algorithm, audit_s)

    def _abort_weight_update(self, cmd: AbortWeightUpdate) -> bool:
        weights = self.weights
        was_open = any(weights.state(m)["session_open"] for m in weights.versions)
        weights.abort(cmd.reason)
        return was_open

    def _read_manifest(self, cmd: ReadManifest) -> Manifest:
        """A manifest of `cmd.model`; while the updater says the model is torn it carries the torn_reason,
        and its weight_version is then the live version the bytes are NOT."""
        weights = self.weights
        if cmd.source == "held":
            manifest = weights.held_manifest(cmd.model, cmd.algorithm)
        elif cmd.source == "received":
            manifest = weights.received_manifest(cmd.model, cmd.algorithm)
        else:
            raise InvalidRequestError("source", f"must be 'held' or 'received', got {cmd.source!r}")
        state = weights.state(cmd.model)
        return dataclasses.replace(manifest, torn_reason=state["torn_reason"]) if state["torn"] else manifest

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
            has_tokenizer=llm.tokenizer is not None, num_threads=torch.get_num_threads())

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
            unfinished=len(self.request_ids), gc_frozen=self.gc_frozen)

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
