"""The rank side of sidecar/ranks.py: one TP rank's process, its LLM, and the command loop.

Commands arrive over the Pipe as (op, payload), in the same order on every rank:
- ("step", {"aborts", "groups", "run"}): abort, add the new request groups (a group is all-or-nothing:
  the prompts of one HTTP call), then run one llm.step() when `run` and the engine can step.
  Rank 0 returns the finished RequestOutputs; every rank returns the rejected groups (the same on
  every rank: validation is deterministic).
- ("call", (method, args, kwargs)): a dotted method of the LLM ("sleep", "worker.compute_weight_
  checksums"; a name the LLM lacks is looked up on its worker) or of this server ("rank.manifest").
- ("stop", None): shut the engine down and exit.
Every reply carries this rank's status (sleep state per tag, weight versions, torn flags), so the
parent always has a fresh snapshot without asking. Exceptions travel back as ErrorInfo.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import signal
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

from inference.core import InvalidRequestError, StateError
from sidecar.ranks import ErrorInfo, RankSpec, Reply

log = logging.getLogger(__name__)


def rank_main(spec: RankSpec, conn: Connection) -> None:
    """Entry point of a rank process (multiprocessing spawn)."""
    _die_with_parent(spec.parent_pid)
    # Ctrl-C in a terminal signals the whole process group: the parent decides how the ranks stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=spec.log_level.upper(),
                        format=f"%(asctime)s rank{spec.rank} %(levelname)s %(name)s: %(message)s")
    try:
        llm = _build_llm(spec)
        server = RankServer(llm, conn, spec.rank)
        conn.send(Reply(True, server.plan(), status=server.status()))
    except BaseException as e:
        log.exception("rank %d failed to start", spec.rank)
        conn.send(Reply(False, error=error_info(e)))
        return
    try:
        server.serve()
    finally:
        server.shutdown()


def _die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL this process when its parent dies, so a killed sidecar leaves no orphan."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        return  # not Linux: the closed Pipe still ends the command loop
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        os._exit(1)


def _build_llm(spec: RankSpec) -> Any:
    import torch
    import torch.distributed as dist

    from inference.llm import LLM
    from inference.parallel import TPInfo

    torch.set_num_threads(spec.num_threads)
    engine = spec.engine
    if engine.device == "cuda":
        torch.cuda.set_device(spec.rank)
        engine = dataclasses.replace(engine, device=f"cuda:{spec.rank}")
    tp = None
    if spec.size > 1:
        device_id = torch.device("cuda", spec.rank) if spec.backend == "nccl" else None  # bind NCCL to our GPU
        dist.init_process_group(spec.backend, init_method=f"tcp://127.0.0.1:{spec.dist_port}", rank=spec.rank,
                                world_size=spec.size, timeout=timedelta(seconds=spec.dist_timeout_s),
                                device_id=device_id)
        tp = TPInfo(rank=spec.rank, size=spec.size, group=dist.group.WORLD)
    return LLM(config=engine, tp=tp)


def error_info(e: BaseException, rank: str | None = None, index: int | None = None) -> ErrorInfo:
    """Classify an exception for the HTTP layer (the kind picks the status code)."""
    from checksum import ChecksumMismatch
    from inference.memory import DeviceMemoryError
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


def to_plain(value: Any) -> Any:
    """JSON-ready (and torch-free) form of a result: to_dict()/as_dict() objects, dataclasses, enums."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, enum.Enum):
        return value.value
    for method in ("to_dict", "as_dict"):
        if callable(getattr(value, method, None)):
            return to_plain(getattr(value, method)())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return to_plain(dataclasses.asdict(value))
    if isinstance(value, dict):
        return {str(k): to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [to_plain(v) for v in value]
    return repr(value)


class RankServer:
    """Serves one rank's commands; `request_ids` are the requests this rank's engine still holds."""

    def __init__(self, llm: Any, conn: Connection, rank: int) -> None:
        self.llm = llm
        self.conn = conn
        self.rank = rank
        self.request_ids: set[str] = set()
        self.received: dict[str, Any] = {}  # model -> Manifest of what its last finished sync delivered

    # ---- the loop ---------------------------------------------------------------------------
    def serve(self) -> None:
        while True:
            try:
                op, payload = self.conn.recv()
            except (EOFError, OSError):
                log.warning("rank %d: the sidecar process is gone; exiting", self.rank)
                return
            if op == "stop":
                return
            try:
                reply = Reply(True, self._dispatch(op, payload))
            except Exception as e:
                log.debug("rank %d: %s failed", self.rank, op, exc_info=True)
                reply = Reply(False, error=error_info(e, self.rank_key))
            reply.status = self.status()
            self._send(reply)

    def _send(self, reply: Reply) -> None:
        try:
            self.conn.send(reply)
        except (TypeError, AttributeError, ValueError) as e:  # an unpicklable result: report, don't die
            self.conn.send(Reply(False, error=ErrorInfo(type(e).__name__, f"reply not serializable: {e}",
                                                        "internal", None, self.rank_key), status=reply.status))

    def _dispatch(self, op: str, payload: Any) -> Any:
        if op == "step":
            return self._step(payload)
        if op == "call":
            method, args, kwargs = payload
            result = self._resolve(method)(*args, **kwargs)
            received = getattr(result, "received", None)  # a finished sync's UpdateResult
            if method.endswith("finish_weight_update") and received is not None:
                self.received[result.model] = received
            return {"result": to_plain(result), "finished": self._take_finished()}
        raise InvalidRequestError("op", f"unknown rank command {op!r}")

    def _resolve(self, method: str) -> Any:
        if method.startswith("rank."):
            return getattr(self, "op_" + method.removeprefix("rank."))
        obj: Any = self.llm
        parts = method.split(".")
        if not hasattr(obj, parts[0]) and hasattr(self.llm.worker, parts[0]):
            obj = self.llm.worker  # generic: weight-update methods live on the worker
        for part in parts:
            if part.startswith("_"):
                raise InvalidRequestError("method", f"private method {method!r} cannot be called")
            obj = getattr(obj, part)
        return obj

    # ---- generation -------------------------------------------------------------------------
    def _step(self, cmd: dict[str, Any]) -> dict[str, Any]:
        for rid in cmd["aborts"]:
            self.llm.abort(rid)
            self.request_ids.discard(rid)
        rejected = {}
        for group_id, requests, wait in cmd["groups"]:
            error = self._add_group(requests, wait)
            if error is not None:
                rejected[group_id] = error
        finished = []
        if cmd["run"] and self.request_ids and self.can_step():
            try:
                finished = self.llm.step()
            except Exception:
                self.op_abort_all()  # the engine's state is suspect: drop every request, report the error
                raise
            for out in finished:
                self.request_ids.discard(out.request_id)
        finished += self._take_finished()
        return {"finished": finished if self.rank == 0 else [], "rejected": rejected}

    def _add_group(self, requests: list[tuple[str, Any, Any]], wait: bool) -> ErrorInfo | None:
        added: list[str] = []
        for index, (rid, prompt, params) in enumerate(requests):
            try:
                self.llm.add_request(prompt, params, rid, wait=wait)
            except Exception as e:
                for done in added:  # all or nothing: the caller gets one answer for the whole group
                    self.llm.abort(done)
                    self.request_ids.discard(done)
                return error_info(e, self.rank_key, index)
            added.append(rid)
            self.request_ids.add(rid)
        return None

    def _take_finished(self) -> list[Any]:
        outs = self.llm.take_finished()
        for out in outs:
            self.request_ids.discard(out.request_id)
        return outs if self.rank == 0 else []

    def can_step(self) -> bool:
        """Awake, weights valid and servable: a step would generate (otherwise requests are held)."""
        worker = self.llm.worker
        if not worker.is_ready():
            return False
        servable = getattr(worker, "is_servable", None)
        return servable is None or all(servable(m) for m in worker.models)

    # ---- rank operations ("rank.<name>") -----------------------------------------------------
    def op_abort_all(self) -> int:
        ids = sorted(self.request_ids)
        for rid in ids:
            self.llm.abort(rid)
        self.request_ids.clear()
        return len(ids)

    def op_manifest(self, which: str = "target") -> dict[str, Any]:
        """The digests of what this rank holds of `which` (its shards, engine names)."""
        from checksum import manifest_from_tensors

        worker = self.llm.worker
        if which not in worker.models:
            raise InvalidRequestError("model", f"rank {self.rank_key}: no {which} model loaded "
                                      f"(models: {sorted(worker.models)})")
        version = getattr(worker, "weight_versions", {}).get(which, self.llm.weight_version)
        params = list(worker.models[which].named_parameters())
        return manifest_from_tensors(params, model=which, weight_version=version, rank=self.rank_key).to_dict()

    def op_received_manifest(self, which: str = "target") -> dict[str, Any]:
        """The received digests (full tensors, trainer names) of the last finished sync of `which`."""
        if which not in self.received:
            raise StateError(f"rank {self.rank_key}: no sync of the {which} model has finished on this rank")
        return self.received[which].to_dict()

    def plan(self) -> dict[str, Any]:
        """This rank's device memory plan and model facts (reported once, at startup)."""
        from inference.memory import KV_TAG, WEIGHT_TAGS

        llm, worker = self.llm, self.llm.worker
        mem = worker.memory
        assert mem is not None
        return {
            "rank": self.rank_key, "pid": os.getpid(), "device": str(worker.device),
            "dtype": str(worker.dtype).removeprefix("torch."),
            "weights_bytes": {t: mem.arena(t).nbytes for t in WEIGHT_TAGS if t in mem.tags},
            "kv_blocks": worker.num_blocks, "kv_bytes": mem.arena(KV_TAG).nbytes if KV_TAG in mem.tags else 0,
            "block_size": llm.config.cache.block_size, "max_model_len": llm.max_model_len,
            "vocab_size": llm.model_config.vocab_size, "models": sorted(worker.models),
            "model": llm.config.model, "draft_model": llm.config.draft_model,
            "has_tokenizer": llm.tokenizer is not None,
        }

    @property
    def rank_key(self) -> str:
        return str(self.llm.worker.rank_key)

    def status(self) -> dict[str, Any]:
        worker = self.llm.worker
        versions = getattr(worker, "weight_versions", None) or {"target": self.llm.weight_version}
        return {
            "rank": self.rank_key, "pid": os.getpid(), "ready": self.can_step(), "sleeping": self.llm.is_sleeping,
            "arenas": worker.memory.states() if worker.memory is not None else {},
            "weight_versions": dict(versions), "torn": dict(getattr(worker, "torn", {})),
            "loaded": dict(getattr(worker, "weights_loaded", {})), "unfinished": len(self.request_ids),
        }

    def shutdown(self) -> None:
        worker = self.llm.worker
        close = getattr(worker, "close_weight_transfer_engine", None)
        for step in (close, worker.shutdown, _destroy_group):
            if step is None:
                continue
            try:
                step()
            except Exception:  # exiting anyway: log and keep releasing the rest
                log.exception("rank %d: shutdown step %s failed", self.rank, getattr(step, "__name__", step))


def _destroy_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
