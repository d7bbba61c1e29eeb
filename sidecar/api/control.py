"""Control endpoints: state, sleep/wake, pause/resume, weight syncs, checksums and audits.

Each sends one declared command (sidecar/ranks/commands.py) to every rank between two generation steps
(sidecar/ranks/driver.py) and answers with every rank's reply. The weight-sync protocol (its trainer's
side: trainer_hooks/sync.py): POST /weights/init joins the trainer's transfer group and refuses a client
of another protocol version (409 naming `protocol` and both versions); each sync is then ONE POST
/weights/update carrying the start, while the sender sends and delivers its digests over the group:
every rank audits and commits, and the answer is the audit. No session outlives its update (a failed
one ends it on every rank); POST /weights/abort ends one still open. docs/limits.md has the timeouts.

POST /weights/update is answered by `WeightsUpdateGate`, in front of FastAPI's routing, dependencies,
body pass and response model, which cost more than the rest of the app's time on the message
(docs/dev/benchmark-log.md). Its contract is a FastAPI route's all the same (`_lean_body`), and its errors are
answered by the app's own error_answer, so they read and count as every route's.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import APIRouter
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from checksum import ITEMSIZE, Report
from sidecar.api.audit import add_audit_routes, report_dict
from sidecar.api.common import ApiError, ServerState, await_future, call
from sidecar.api.guard import note_handler_time, require_key
from sidecar.api.models import SleepRequest, WakeRequest, WeightsInitRequest, WeightsUpdateRequest
from sidecar.ranks.commands import (
    AbortWeightUpdate,
    Command,
    InitWeightTransfer,
    Sleep,
    SyncResult,
    UpdateReply,
    UpdateWeights,
    WakeUp,
    WeightStart,
)
from trainer_hooks.sync import SYNC_PROTOCOL

_LAYOUTS_KEPT = 16
Body = TypeVar("Body", bound=BaseModel)


def state_dict(state: ServerState) -> dict[str, Any]:
    d = state.driver
    statuses = [st for st in d.statuses if st is not None]
    head = d.statuses[0] if d.statuses else None
    plan = state.plans[0]
    alive = d.pool.alive()
    ranks = []
    for i, (st, pl) in enumerate(zip(d.statuses, state.plans)):
        ranks.append({
            "rank": pl.rank, "pid": pl.pid, "alive": alive[i] if i < len(alive) else False,
            "device": pl.device, "ready": st and st.ready, "sleeping": st and st.sleeping,
            "tags": dict(st.arenas) if st else {}, "weight_versions": dict(st.weight_versions) if st else {},
            "torn": dict(st.torn) if st else {}, "gc_frozen": st.gc_frozen if st else 0,
            "weights_bytes": pl.weights_bytes, "kv_blocks": pl.kv_blocks, "kv_bytes": pl.kv_bytes,
            "warm_up_s": pl.warm_up_s})
    return {
        "healthy": d.failure is None, "failure": d.failure, "paused": d.paused, "busy": d.busy,
        "sleeping": head and head.sleeping, "ready": head and head.ready,
        "tags": dict(head.arenas) if head else {},
        "weight_versions": dict(head.weight_versions) if head else {},
        "torn": {m: any(st.torn.get(m, False) for st in statuses) for m in plan.models},
        "queue_depth": d.queue_depth(), "queued_sequences": d.queued_sequences(),
        "engine_unfinished": head.unfinished if head else 0,
        "tp": len(state.plans), "ranks": ranks,
        "model": {k: getattr(plan, k) for k in ("model", "draft_model", "models", "dtype", "vocab_size",
                                                "max_model_len", "block_size")},
        "transfer": {"backend": state.config.transfer, "bucket_bytes": state.config.bucket_bytes,
                     "num_receivers": len(state.plans)},
        "uptime_s": time.time() - state.started,
        "gc_frozen": state.gc_frozen,  # objects this HTTP process froze once serving (inference/memory/host_heap.py)
    }


def _manifest_bytes(manifest: Any, layouts: dict[str, int]) -> int:
    """The bytes a start manifest describes; a manifest naming its layout alone (no "tensors") counts what
    that layout counted when its tensors came (`layouts`, bounded: at most _LAYOUTS_KEPT)."""
    layout = manifest.get("layout") if isinstance(manifest, dict) else None
    if isinstance(manifest, dict) and "tensors" not in manifest:
        return layouts.get(layout, 0) if isinstance(layout, str) else 0
    total = _tensor_bytes(manifest.get("tensors", []) if isinstance(manifest, dict) else manifest)
    if isinstance(layout, str):
        layouts[layout] = total
        while len(layouts) > _LAYOUTS_KEPT:
            layouts.pop(next(iter(layouts)))
    return total


def _tensor_bytes(tensors: Any) -> int:
    total = 0
    for t in tensors if isinstance(tensors, list) else []:
        if isinstance(t, dict) and isinstance(t.get("shape"), list):
            n = 1
            for dim in t["shape"]:
                n *= dim if isinstance(dim, int) else 0
            total += n * ITEMSIZE.get(str(t.get("dtype")), 0)
    return total


def add_control_routes(router: APIRouter, state: ServerState) -> None:
    _add_lifecycle_routes(router, state)
    _add_weight_routes(router, state)
    add_audit_routes(router, state)


def _add_lifecycle_routes(router: APIRouter, state: ServerState) -> None:
    @router.get("/state", summary="Sleep state per tag, weight versions, torn flags, ranks, queue depth")
    async def get_state() -> dict[str, Any]:
        return state_dict(state)

    @router.post("/sleep", summary="Release device memory (level 1 keeps a host copy of the weights)")
    async def sleep(body: SleepRequest | None = None) -> dict[str, Any]:
        body = body or SleepRequest()
        t0 = time.perf_counter()
        ranks = [r.as_dict() for r in await call(state, Sleep(body.level, body.in_flight))]
        state.metrics.sleep_seconds.labels(str(body.level)).observe(time.perf_counter() - t0)
        return {"ranks": ranks, "state": state_dict(state)}

    @router.post("/wake_up", summary="Map memory back: tags 'weights' and/or 'kv_cache' (null: all)")
    async def wake_up(body: WakeRequest | None = None) -> dict[str, Any]:
        t0 = time.perf_counter()
        tags = body.tags if body is not None else None
        ranks = [r.as_dict() for r in await call(state, WakeUp(tuple(tags) if tags is not None else None))]
        state.metrics.wake_seconds.observe(time.perf_counter() - t0)
        return {"ranks": ranks, "state": state_dict(state)}

    @router.post("/pause", summary="Stop scheduling generation steps; requests wait")
    async def pause() -> dict[str, Any]:
        state.driver.pause()
        return {"paused": True}

    @router.post("/resume", summary="Resume generation steps")
    async def resume() -> dict[str, Any]:
        state.driver.resume()
        return {"paused": False}


async def _weight_call(state: ServerState, cmd: Command) -> list[Any]:
    """A weight command on every rank. The driver waits --rpc-timeout-s plus the longest wire timeout a
    trainer may choose (--max-transfer-timeout-s), so the rank's own wire timeout always fires first: a
    dead or hung trainer is a TransferError (502, model torn, a re-init heals), never a rank that looks
    hung (503 for good)."""
    timeout = state.config.rpc_timeout_s + state.config.max_transfer_timeout_s
    return await await_future(None, state.driver.call(cmd, timeout), state.driver)


def _check_init_info(state: ServerState, init_info: dict[str, Any]) -> None:
    """The client-chosen parts of init_info that the sidecar bounds (400 naming the field)."""
    backend = init_info.get("backend")
    if state.config.transfer is not None and backend != state.config.transfer:
        raise ApiError(400, "InvalidRequestError", f"this sidecar was launched with --transfer "
                       f"{state.config.transfer}, the sender uses {backend!r}", "init_info.backend")
    if state.config.api_key is not None and not init_info.get("auth"):
        raise ApiError(400, "InvalidRequestError", "this sidecar has an API key, so the weight transfer's store "
                       "clients authenticate: the sender must name a session secret (WeightSender.init_info() "
                       "does)", "init_info.auth")
    timeout_s, limit = init_info.get("timeout_s"), state.config.max_transfer_timeout_s
    if isinstance(timeout_s, (int, float)) and not isinstance(timeout_s, bool) and timeout_s > limit:
        raise ApiError(400, "InvalidRequestError", f"is {timeout_s:g} s, more than this sidecar allows "
                       f"({limit:g} s, --max-transfer-timeout-s): a trainer that hangs must not hold the ranks "
                       "longer", "init_info.timeout_s")


def _check_protocol(protocol: int | None) -> None:
    """A client of another weight-sync protocol (or of none: one that sends no version) is refused at init."""
    if protocol != SYNC_PROTOCOL:
        spoken = "no protocol version (an older client)" if protocol is None else f"protocol {protocol}"
        raise ApiError(409, "ProtocolMismatch", f"the client speaks weight-sync {spoken}, this sidecar speaks "
                       f"protocol {SYNC_PROTOCOL}: use the trainer_hooks of the sidecar's own release", "protocol")


def _add_weight_routes(router: APIRouter, state: ServerState) -> None:
    @router.post("/weights/init", summary="Join the trainer's transfer group (run while the sender connects)")
    async def weights_init(body: WeightsInitRequest) -> dict[str, Any]:
        _check_protocol(body.protocol)
        _check_init_info(state, body.init_info)
        ranks = await _weight_call(state, InitWeightTransfer(body.init_info))
        return {"ranks": ranks, "protocol": SYNC_PROTOCOL}

    @router.post("/weights/abort", summary="End the open update session now; generation resumes")
    async def weights_abort() -> dict[str, Any]:
        opened = await _weight_call(state, AbortWeightUpdate("aborted by POST /weights/abort"))
        if any(opened):
            _failed(state)
        return {"aborted": any(opened), "state": state_dict(state)}


class WeightsUpdateGate:
    """ASGI middleware (inside RequestGuard) that answers POST /weights/update itself, before FastAPI's
    routing (module docstring); every other request goes on to the app. `on_error(exc)`: the app's
    answer to an exception (sidecar/api/app.py, error_answer), None for an unexpected one, which is
    re-raised to RequestGuard's JSON 500."""

    def __init__(self, app: ASGIApp, state: ServerState, on_error: Callable[[Exception], Response | None]) -> None:
        self.app, self.state, self.on_error = app, state, on_error
        self.layout_bytes: dict[str, int] = {}  # per manifest layout key, its bytes (a layout-only start's metric)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != "/weights/update" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        try:
            body = await _lean_body(Request(scope, receive), WeightsUpdateRequest, self.state.config.api_key)
            response = await self.update(body, scope)
        except Exception as e:
            answer = self.on_error(e)
            if answer is None:
                raise
            response = answer
        await response(scope, receive, send)

    async def update(self, body: WeightsUpdateRequest, scope: Scope) -> Response:
        """The one request of a sync (module docstring): start, receive, audit and commit."""
        state, info, start = self.state, body.update_info, body.start
        if isinstance(info, list) and len(info) != len(state.plans):
            raise ApiError(400, "InvalidRequestError", f"a list needs one entry per rank ({len(state.plans)}), got "
                           f"{len(info)}", "update_info")
        opening = WeightStart(start.model, start.version, start.manifest, start.allow_cast)
        t0 = time.perf_counter()
        # While another update is in flight the ranks refuse this start: that one's start time stays.
        opens = not state.sync_started
        if opens:
            state.sync_started[start.model] = (t0, _manifest_bytes(start.manifest, self.layout_bytes))
        try:
            replies: list[UpdateReply] = await _weight_call(state, UpdateWeights(opening, info))
        except ApiError as e:
            if e.kind == "checksum":
                state.metrics.audit_failures.inc()
            if opens:  # a failed update ends its session on every rank
                _failed(state)
            else:
                state.metrics.syncs.labels(start.model, "failed").inc()
            raise
        start_s = max(r.start_s for r in replies)
        state.metrics.sync_seconds.labels(start.model, "start").observe(start_s)
        results = [r.result for r in replies if r.result is not None]
        assert len(results) == len(replies), "a rank answered an update without its audit"
        audit_s = max(r.audit_s for r in results)
        state.metrics.sync_seconds.labels(start.model, "update").observe(time.perf_counter() - t0 - start_s - audit_s)
        note_handler_time(scope, t0, max(r.rank_s for r in replies))
        return JSONResponse(_finished(state, start.model, results, audit_s))


async def _lean_body(request: Request, model: type[Body], key: str | None) -> Body:
    """What FastAPI does before a route's handler, for WeightsUpdateGate: the API key (401 naming
    `authorization`), then the body parsed as JSON (400 MalformedJSON naming `body`) and validated with
    `model` in python mode (422 naming the field), raised as FastAPI raises them."""
    require_key(key, request.headers)
    raw = await request.body()  # the body limit's 413 is raised here (sidecar/api/guard.py)
    try:
        data = json.loads(raw)
    except ValueError as e:  # json's errors are ValueErrors (bad UTF-8 too)
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", 0), "msg": "JSON decode error",
                                       "input": {}, "ctx": {"error": str(e)}}]) from None  # FastAPI's own
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise RequestValidationError([{**err, "loc": ("body", *err["loc"])}
                                      for err in e.errors(include_url=False)]) from None


def _finished(state: ServerState, model: str, results: list[SyncResult], finish_s: float) -> dict[str, Any]:
    """The answer of a sync every rank audited and committed, with its metrics. `finish_s`: the seconds of
    the ranks' audit inside the update. Answered with a JSONResponse of plain JSON types: FastAPI's encoder
    and response-model pass would cost time on the critical path for nothing to convert."""
    now = time.perf_counter()
    state.metrics.sync_seconds.labels(model, "finish").observe(finish_s)
    state.metrics.sync_seconds.labels(model, "audit").observe(max(r.audit_s for r in results))
    started, nbytes = state.sync_started.pop(model, (now, 0))
    state.metrics.sync_seconds.labels(model, "total").observe(now - started)
    state.metrics.sync_bytes.labels(model).inc(nbytes)
    state.metrics.syncs.labels(model, "ok").inc()
    # Every rank passed its comparison with the same digests, so every rank holds the sent bytes and the
    # ranks agree with each other: that IS POST /audit's verdict for source=received with these digests
    # expected, sent back here instead of in a second round trip.
    audit = Report.build([], [r.rank for r in results], sum(r.tensors_checked for r in results))
    return {"model": results[0].model, "version": results[0].version, "ok": all(r.ok for r in results),
            "algorithm": results[0].algorithm,
            "ranks": [{"rank": r.rank, "ok": r.ok, "summary": r.summary} for r in results],
            "audit": {**report_dict(audit, results[0].model, "received"), "algorithm": results[0].algorithm,
                      "audit_ms": round(max(r.audit_s for r in results) * 1e3, 3)}}


def _open_model(state: ServerState) -> str:
    return next(iter(state.sync_started), "target")


def _failed(state: ServerState) -> None:
    model = _open_model(state)
    state.sync_started.pop(model, None)
    state.metrics.syncs.labels(model, "failed").inc()
