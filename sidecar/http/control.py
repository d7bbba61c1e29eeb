"""Control endpoints: state, sleep/wake, pause/resume, weight syncs, checksums and audits.

Each control endpoint sends one declared command (sidecar/ranks/commands.py) to every rank between two
generation steps (sidecar/ranks/driver.py) and answers with every rank's reply: Sleep, WakeUp, and the
weight sync's InitWeightTransfer, StartWeightUpdate, UpdateWeights, FinishWeightUpdate and
AbortWeightUpdate (handled in sidecar/ranks/server.py, which calls the engine's weight-update API,
inference/weights/updater.py). POST /weights/update may carry the start (UpdateWeights(start=...)): one
round trip fewer per sync, what SidecarClient sends when /weights/init answered `start_in_update`. An open
session has a lease (sidecar/http/lease.py): idle past --weight-session-lease-s, or at POST
/weights/abort, it is aborted. docs/limits.md has the timeouts.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.types import Scope

from checksum import ITEMSIZE, Report
from sidecar.http.audit import add_audit_routes, report_dict
from sidecar.http.common import ApiError, ServerState, await_future, call
from sidecar.http.guard import note_handler_time
from sidecar.http.hot import HotRoute
from sidecar.http.lease import SessionLease
from sidecar.http.models import (
    SleepRequest,
    WakeRequest,
    WeightsFinishRequest,
    WeightsInitRequest,
    WeightsStartRequest,
    WeightsUpdateRequest,
)
from sidecar.ranks.commands import (
    AbortWeightUpdate,
    Command,
    FinishWeightUpdate,
    InitWeightTransfer,
    Sleep,
    StartWeightUpdate,
    SyncResult,
    UpdateReply,
    UpdateWeights,
    WakeUp,
)

_LAYOUTS_KEPT = 16


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
            "weights_bytes": pl.weights_bytes, "kv_blocks": pl.kv_blocks, "kv_bytes": pl.kv_bytes})
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
        "gc_frozen": state.gc_frozen,  # objects this HTTP process froze once serving (host_heap.py)
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


def add_control_routes(router: APIRouter, state: ServerState) -> dict[tuple[str, str], HotRoute]:
    """Adds the control routes; returns those HotRoutes serves too (sidecar/http/hot.py)."""
    _add_lifecycle_routes(router, state)
    hot = _add_weight_routes(router, state)
    add_audit_routes(router, state)
    return hot


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


def _add_weight_routes(router: APIRouter, state: ServerState) -> dict[tuple[str, str], HotRoute]:
    layout_bytes: dict[str, int] = {}  # per manifest layout key, its bytes (for a layout-only start's metric)

    async def expire() -> None:
        opened = await _weight_call(state, AbortWeightUpdate(f"the session sat idle for {lease.lease_s:g} s "
                                                             "(--weight-session-lease-s)"))
        if any(opened):
            _failed(state)

    lease = SessionLease(state.config.weight_session_lease_s, expire)

    @router.post("/weights/init", summary="Join the trainer's transfer group (run while the sender connects)")
    async def weights_init(body: WeightsInitRequest) -> dict[str, Any]:
        _check_init_info(state, body.init_info)
        with lease.call():
            ranks = await _weight_call(state, InitWeightTransfer(body.init_info))
        lease.closed()  # the ranks abandoned any open session for the new group
        # /weights/update takes a "start", and "finish" with digests the sender delivers (SidecarClient uses both)
        return {"ranks": ranks, "start_in_update": True, "audit_in_update": True}

    @router.post("/weights/start", summary="Open an update session: validate the whole manifest first")
    async def weights_start(body: WeightsStartRequest, request: Request) -> dict[str, Any]:
        t0 = time.perf_counter()
        with lease.call():
            await _weight_call(state, StartWeightUpdate(body.model, body.version, body.manifest, body.allow_cast))
        lease.opened()
        state.metrics.sync_seconds.labels(body.model, "start").observe(time.perf_counter() - t0)
        state.sync_started[body.model] = (t0, _manifest_bytes(body.manifest, layout_bytes))
        note_handler_time(request.scope, t0)
        return {"model": body.model, "version": body.version, "started": True}

    @router.post("/weights/update", summary="Receive every bucket (blocks while the sender sends); with "
                 "\"start\", open the session first in the same call")
    async def weights_update(request: Request, body: WeightsUpdateRequest | None = None) -> JSONResponse:
        return await update(body or WeightsUpdateRequest(), request.scope)

    async def update(body: WeightsUpdateRequest, scope: Scope) -> JSONResponse:
        """The update's handler, on both paths: the FastAPI route above and HotRoutes."""
        info, start = body.update_info, body.start
        if isinstance(info, list) and len(info) != len(state.plans):
            raise ApiError(400, "InvalidRequestError", f"a list needs one entry per rank ({len(state.plans)}), got "
                           f"{len(info)}", "update_info")
        opening = None if start is None else StartWeightUpdate(start.model, start.version, start.manifest,
                                                               start.allow_cast)
        t0 = time.perf_counter()
        # A start opens its session here, before the ranks run it: the trainer may send finish as soon as its
        # send() returned, and that finish may be handled before this update's answer (SidecarClient does).
        # While a session is open the ranks refuse a second start: its lease and start time stay untouched.
        opens = False
        if start is not None and not lease.is_open:
            opens = True
            lease.opened()
            state.sync_started[start.model] = (t0, _manifest_bytes(start.manifest, layout_bytes))
        model = _open_model(state) if start is None else start.model
        try:
            with lease.call():
                replies: list[UpdateReply] = await _weight_call(state, UpdateWeights(info, opening, body.finish))
        except ApiError as e:
            if body.finish and e.kind == "checksum":
                state.metrics.audit_failures.inc()
            if start is None or opens:  # a failed update ends the session on every rank
                lease.closed()
                _failed(state)
            else:
                state.metrics.syncs.labels(model, "failed").inc()
            raise
        start_s = max(r.start_s for r in replies)
        if start is not None:
            state.metrics.sync_seconds.labels(model, "start").observe(start_s)
        results = [r.result for r in replies if r.result is not None]
        audit_s = max((r.audit_s for r in results), default=0.0)
        state.metrics.sync_seconds.labels(model, "update").observe(time.perf_counter() - t0 - start_s - audit_s)
        if body.finish:  # every rank audited and committed in this call: the answer is finish's
            lease.closed()
            assert len(results) == len(replies), "a rank answered an update with finish without its audit"
            note_handler_time(scope, t0, max(r.rank_s for r in replies))
            return JSONResponse(_finished(state, model, results, audit_s))
        note_handler_time(scope, t0, max(r.rank_s for r in replies))
        return JSONResponse({"received": True} if start is None else {"received": True, "model": model,
                                                                      "version": start.version, "started": True})

    @router.post("/weights/finish", summary="Audit received digests against the sender's; make the version live")
    async def weights_finish(body: WeightsFinishRequest, request: Request) -> JSONResponse:
        model = _open_model(state)
        t0 = time.perf_counter()
        try:
            with lease.call():
                results: list[SyncResult] = await _weight_call(state, FinishWeightUpdate(body.digests))
        except ApiError as e:
            if e.kind == "checksum":
                state.metrics.audit_failures.inc()
            _failed(state)
            raise
        finally:
            lease.closed()  # finish ends the session, passed or failed
        note_handler_time(request.scope, t0)
        return JSONResponse(_finished(state, model, results, time.perf_counter() - t0))

    @router.post("/weights/abort", summary="End the open update session now; generation resumes")
    async def weights_abort() -> dict[str, Any]:
        lease.closed()
        opened = await _weight_call(state, AbortWeightUpdate("aborted by POST /weights/abort"))
        if any(opened):
            _failed(state)
        return {"aborted": any(opened), "state": state_dict(state)}

    return {("POST", "/weights/update"): HotRoute(WeightsUpdateRequest, update)}


def _finished(state: ServerState, model: str, results: list[SyncResult], finish_s: float) -> dict[str, Any]:
    """The answer of a sync every rank audited and committed (/weights/finish, or /weights/update with
    "finish"), with its metrics. `finish_s`: the seconds of that part (the ranks' audit, inside an
    update). The weight routes answer with a JSONResponse of plain JSON types: FastAPI's encoder and
    response-model pass would cost ~40 us a message on the critical path, for nothing to convert."""
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
