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

import asyncio
import json
import logging
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
from inference.core import INT64_MAX
from inference.transfer.groups import JOIN_TIMEOUTS, new_session_secret
from sidecar.api.audit import add_audit_routes, report_dict
from sidecar.api.common import ApiError, ServerState, await_future, call
from sidecar.api.guard import note_handler_time, require_key
from sidecar.api.models import PauseRequest, SleepRequest, WakeRequest, WeightsInitRequest, WeightsUpdateRequest
from sidecar.log_format import fields
from sidecar.ranks.commands import (
    AbortWeightUpdate,
    Command,
    InitWeightTransfer,
    Sleep,
    SyncResult,
    TransferJoined,
    UpdateReply,
    UpdateWeights,
    WakeUp,
    WeightStart,
)
from trainer_hooks.sync import SYNC_PROTOCOL

log = logging.getLogger("sidecar.api")
_LAYOUTS_KEPT = 16
Body = TypeVar("Body", bound=BaseModel)


def state_dict(state: ServerState) -> dict[str, Any]:
    d = state.driver
    head = d.statuses[0] if d.statuses else None
    plan = state.plans[0]
    alive = d.rank_alive()
    held = d.held_weights()
    activity = getattr(d, "activity", [])
    ranks = []
    for i, (st, pl) in enumerate(zip(d.statuses, state.plans)):
        live = alive[i] if i < len(alive) else False
        beat = activity[i] if i < len(activity) else None
        ranks.append({
            "rank": pl.rank, "pid": pl.pid, "alive": live, "status": "ready" if live and st and st.ready
            else "dead" if not live else "not ready",
            "device": pl.device, "ready": bool(live and st and st.ready), "sleeping": st and st.sleeping,
            "tags": dict(st.arenas) if st else {}, "weight_versions": dict(st.weight_versions) if st else {},
            "torn": dict(st.torn) if st else {}, "needs_sync": dict(st.needs_sync) if st else {},
            "gc_frozen": st.gc_frozen if st else 0,
            "doing": None if beat is None or not live else {"what": beat.doing, "for_s": round(beat.for_s, 3),
                                                            "steps": beat.steps},
            "weights_bytes": pl.weights_bytes, "kv_blocks": pl.kv_blocks, "kv_bytes": pl.kv_bytes,
            "warm_up_s": pl.warm_up_s})
    return {
        "healthy": d.failure is None, "failure": d.failure, "paused": d.paused, "busy": d.busy,
        "pause_left_s": d.pause_left_s() if hasattr(d, "pause_left_s") else None,
        "sleeping": head and head.sleeping, "ready": bool(head and head.ready and all(alive)),
        "tags": dict(head.arenas) if head else {},
        "weight_versions": {m: v["version"] for m, v in held.items()},
        "torn": {m: held.get(m, {}).get("torn", False) for m in plan.models},
        "needs_sync": {m: held.get(m, {}).get("needs_sync") for m in plan.models},
        "queue_depth": d.queue_depth(), "queued_sequences": d.queued_sequences(),
        "engine_unfinished": head.unfinished if head else 0,
        # since start, over finished requests (the counters of /metrics): tokens generated, prompt tokens from the
        # prefix cache, draft tokens proposed and accepted, preemptions for KV blocks
        "engine": {"generated_tokens": d.tokens_total, **getattr(d, "engine_counters", {})},
        "tp": len(state.plans), "ranks": ranks,
        "model": {k: getattr(plan, k) for k in ("model", "draft_model", "models", "dtype", "vocab_size",
                                                "max_model_len", "block_size")},
        "transfer": {"backend": state.config.transfer, "bucket_bytes": state.config.bucket_bytes,
                     "num_receivers": len(state.plans)},
        "uptime_s": time.time() - state.started,
        "gc_frozen": state.gc_frozen,  # objects this HTTP process froze once serving (inference/memory/host_heap.py)
    }


MAX_SHAPE_DIMS = 64  # more dimensions than any tensor torch builds: a shape past it is not a tensor's


def check_manifest_shapes(manifest: Any) -> None:
    """Every tensor shape of a start manifest is at most MAX_SHAPE_DIMS integers in [0, INT64_MAX] whose
    product (the element count) fits int64; else a 400 naming the field. Checked before any product is
    taken, so the work is linear in the body: a shape of huge integers cannot make the event loop
    multiply big numbers (quadratic in their digits)."""
    tensors = manifest.get("tensors", []) if isinstance(manifest, dict) else manifest
    for i, t in enumerate(tensors if isinstance(tensors, list) else []):
        shape = t.get("shape") if isinstance(t, dict) else None
        if not isinstance(shape, list):
            continue  # the ranks' manifest parser names a missing or mistyped shape
        where = f"start.manifest.tensors[{i}].shape"
        if len(shape) > MAX_SHAPE_DIMS:
            raise ApiError(400, "InvalidRequestError", f"has {len(shape)} dimensions, more than {MAX_SHAPE_DIMS}",
                           where)
        count = 1
        for dim in shape:
            if type(dim) is not int or not 0 <= dim <= INT64_MAX:
                big = type(dim) is int and dim.bit_length() > 128
                shown = f"an integer of {dim.bit_length()} bits" if big else dim
                raise ApiError(400, "InvalidRequestError", f"dimensions must be integers in [0, 2**63 - 1], "
                               f"got {shown!r}", where)
            count = min(count * dim, INT64_MAX + 1)  # both factors < 2**64: a bounded product
        if count > INT64_MAX:
            raise ApiError(400, "InvalidRequestError", "holds more than 2**63 - 1 elements", where)


def _manifest_bytes(manifest: Any, layouts: dict[str, int]) -> int:
    """The bytes a start manifest describes (its shapes passed check_manifest_shapes); a manifest naming
    its layout alone (no "tensors") counts what that layout counted when its tensors came (`layouts`,
    bounded: at most _LAYOUTS_KEPT)."""
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
        _log_event("sleep", f"slept at level {body.level} (in flight: {body.in_flight})", t0,
                   level=body.level, in_flight=body.in_flight)
        return {"ranks": ranks, "state": state_dict(state)}

    @router.post("/wake_up", summary="Map memory back: tags 'weights' and/or 'kv_cache' (null: all)")
    async def wake_up(body: WakeRequest | None = None) -> dict[str, Any]:
        t0 = time.perf_counter()
        tags = body.tags if body is not None else None
        ranks = [r.as_dict() for r in await call(state, WakeUp(tuple(tags) if tags is not None else None))]
        state.metrics.wake_seconds.observe(time.perf_counter() - t0)
        _log_event("wake", f"woke {', '.join(tags) if tags else 'everything'}", t0, tags=tags)
        return {"ranks": ranks, "state": state_dict(state)}

    @router.post("/pause", summary="Stop scheduling generation steps for a lease; requests wait")
    async def pause(body: PauseRequest | None = None) -> dict[str, Any]:
        limit = state.config.max_pause_s
        lease_s = body.lease_s if body is not None and body.lease_s is not None else limit
        if lease_s > limit:
            raise ApiError(400, "InvalidRequestError", f"is {lease_s:g} s, more than this sidecar allows ({limit:g} s, "
                           "--max-pause-s): renew the pause with another POST /pause instead", "lease_s")
        state.driver.pause(lease_s)
        return {"paused": True, "lease_s": lease_s}

    @router.post("/resume", summary="Resume generation steps")
    async def resume() -> dict[str, Any]:
        state.driver.resume()
        return {"paused": False}


async def _weight_call(state: ServerState, cmd: Command, wire_waits: int = 1) -> list[Any]:
    """A weight command on every rank. The driver waits --rpc-timeout-s plus `wire_waits` times the longest
    wire timeout a trainer may choose (--max-transfer-timeout-s): the most wire timeouts the command may
    wait out in a row (a join: JOIN_TIMEOUTS), so the rank's own wire timeout always fires first: a dead
    or hung trainer is a TransferError (502, model torn, a re-init heals), never a rank that looks hung
    (503 for good)."""
    timeout = state.config.rpc_timeout_s + wire_waits * state.config.max_transfer_timeout_s
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


def _check_session(state: ServerState, body: WeightsUpdateRequest) -> None:
    """An update belongs to the init that opened the ranks' group: its session id and nonce (409 naming
    `session` otherwise, before the ranks see it: the bytes on that group are another sender's)."""
    owner, given = state.weight_session, body.session
    if owner is not None and given is not None and (given.session_id, given.nonce) == owner:
        return
    if owner is None:
        why = "no transfer group is joined now (or an init is under way): POST /weights/init first"
    elif given is None:
        why = f"the update names no session; the ranks' group is session {owner[0]}'s"
    elif given.session_id != owner[0]:
        why = (f"session {given.session_id} was replaced by another init (session {owner[0]}): the bytes on the "
               "ranks' group are another sender's")
    else:
        why = f"the nonce is not the one the init of session {owner[0]} answered"
    raise ApiError(409, "SessionMismatch", why, "session")


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
        # From now on no update of the group being replaced is let through; the ranks run commands in order.
        state.weight_session = None
        joined: list[TransferJoined] = await _weight_call(state, InitWeightTransfer(body.init_info), JOIN_TIMEOUTS)
        session = {"session_id": str(body.init_info.get("session_id")), "nonce": body.nonce or new_session_secret()}
        state.weight_session = (session["session_id"], session["nonce"])
        # the models every rank holds in FP8: the ones a sender that quantizes on send may send FP8 payloads
        fp8 = sorted(set.intersection(*(set(j.fp8_models) for j in joined))) if joined else []
        return {"ranks": [{"fp8_models": list(j.fp8_models)} for j in joined], "protocol": SYNC_PROTOCOL,
                "session": session, "fp8_models": fp8}

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
        check_manifest_shapes(start.manifest)
        _check_session(state, body)
        opening = WeightStart(start.model, start.version, start.manifest, start.allow_cast)
        t0 = time.perf_counter()
        # While another update is in flight the ranks refuse this start: that one's start time stays.
        opens = not state.sync_started
        if opens:
            state.sync_started[start.model] = (t0, 0)  # its bytes are counted once the ranks accepted it
        try:
            owner = body.session
            bound = owner.nonce if owner is not None and owner.bind_sender else None
            replies: list[UpdateReply] = await _weight_call(
                state, UpdateWeights(opening, info, owner.session_id if owner is not None else None, bound))
        except ApiError as e:
            log.warning("sync of %s v%s refused (%d %s): %s", start.model, start.version, e.status, e.kind,
                        e.message, extra=fields(event="sync_refused", model=start.model, version=start.version,
                                                status=e.status, kind=e.kind, field=e.field))
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
        if opens:  # off the event loop: a manifest of many tensors is a long sum
            nbytes = await asyncio.to_thread(_manifest_bytes, start.manifest, self.layout_bytes)
            state.sync_started[start.model] = (state.sync_started.get(start.model, (t0, 0))[0], nbytes)
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
    ok = all(r.ok for r in results)
    log.info("synced %s v%d: %.1f MiB in %.0f ms, audit %s (%d tensors on %d rank(s), %s)", model,
             results[0].version, nbytes / (1 << 20), (now - started) * 1e3, "ok" if ok else "FAILED",
             sum(r.tensors_checked for r in results), len(results), results[0].algorithm,
             extra=fields(event="sync", model=model, version=results[0].version, bytes=nbytes,
                          ms=round((now - started) * 1e3, 3), audit="ok" if ok else "failed",
                          tensors=sum(r.tensors_checked for r in results), algorithm=results[0].algorithm))
    # Every rank passed its comparison with the same digests, so every rank holds the sent bytes and the
    # ranks agree with each other: that IS POST /audit's verdict for source=received with these digests
    # expected, sent back here instead of in a second round trip.
    audit = Report.build([], [r.rank for r in results], sum(r.tensors_checked for r in results))
    return {"model": results[0].model, "version": results[0].version, "ok": all(r.ok for r in results),
            "algorithm": results[0].algorithm,
            "ranks": [{"rank": r.rank, "ok": r.ok, "summary": r.summary} for r in results],
            "audit": {**report_dict(audit, results[0].model, "received"), "algorithm": results[0].algorithm,
                      "audit_ms": round(max(r.audit_s for r in results) * 1e3, 3),
                      # FP8 tensors the ranks checked against the sender's expected installed digests
                      "installed_checked": sum(r.installed_checked for r in results)}}


def _log_event(event: str, message: str, t0: float, **values: Any) -> None:
    """The INFO line of a sleep or a wake (sidecar/log_format.py): what, and how long it took."""
    ms = (time.perf_counter() - t0) * 1e3
    log.info("%s in %.0f ms", message, ms, extra=fields(event=event, ms=round(ms, 3), **values))


def _open_model(state: ServerState) -> str:
    return next(iter(state.sync_started), "target")


def _failed(state: ServerState) -> None:
    model = _open_model(state)
    state.sync_started.pop(model, None)
    state.metrics.syncs.labels(model, "failed").inc()
