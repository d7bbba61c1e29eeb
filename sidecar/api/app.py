"""The HTTP control plane: a FastAPI app over the driver (generation here, control in sidecar/api/control.py,
checksums and audits in sidecar/api/audit.py, what they share in sidecar/api/common.py).

Errors: every error response is {"error": {"type", "message", "field", "rank", "param", "code"}} (param
repeats field, code is OpenAI's where one applies: OpenAI's error shape is a subset). Status codes:
400 a bad value (malformed JSON, a value out of range; `field` names it), 422 a wrong type or an
unknown field (pydantic), 401 a missing or wrong API key, 404 an unknown route, 409 a state conflict
(asleep, torn, an update without start, a checksum mismatch: the model is torn), 413 a body over
--max-body-mb, 429 too many queued sequences (docs/limits.md), 502 the weight wire failed (trainer
gone, timeout), 503 a rank is dead or hung (`rank` names it), 507 not enough device memory to wake,
500 a bug (sidecar/api/guard.py answers it; the connection stays usable).

Auth (decision): when an API key is set, every endpoint requires `Authorization: Bearer KEY` except
GET /health and GET /metrics (probes and scrapers) and the OpenAPI docs. Reads such as /state and
/checksums need it too: they describe the model and the weights.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from inference.core import (
    DEFAULT_SYNC_POLICY,
    InvalidRequestError,
    RequestOutput,
    SamplingParams,
    StateError,
    SyncPolicy,
    encode_routing,
)
from sidecar.api.common import ApiError, ServerState, await_future, error_response, rank_error_to_api
from sidecar.api.control import WeightsUpdateGate, add_control_routes
from sidecar.api.guard import RequestGuard, require_key
from sidecar.api.intake import build_intake, encode_group
from sidecar.api.models import (
    CompletionOut,
    ErrorResponse,
    GenerateRequest,
    GenerateResponse,
    PromptOut,
    RoutingOut,
    WeightsUpdateRequest,
)
from sidecar.api.openai import add_openai_routes
from sidecar.api.rollouts import add_rollout_routes
from sidecar.ranks.driver import RankError

__all__ = ["ApiError", "ServerState", "create_app"]

log = logging.getLogger(__name__)


def create_app(state: ServerState) -> FastAPI:
    # redirect_slashes off: /generate/ is a 404 naming the route, not a 307 that drops a POST's body
    app = FastAPI(title="Sidecar", version="0.1.0", responses={"4XX": {"model": ErrorResponse}}, redirect_slashes=False,
                  description="Rollouts, sleep/wake, weight syncs and checksum audits of one sidecar.")
    app.state.sidecar = state
    state.intake = build_intake(state.tokenizer, state.config, state.plans[0])
    _install_error_handlers(app, state)
    open_router = APIRouter()
    router = APIRouter(dependencies=[Depends(_auth(state.config.api_key))])
    _add_open_routes(open_router, state)
    _add_generation_routes(router, state)
    add_control_routes(router, state)
    add_openai_routes(router, state, check_params, submit_group, rename_group_error)
    app.state.rollouts = add_rollout_routes(router, state, check_params, _prompt_out)
    app.include_router(open_router)
    app.include_router(router)
    _document_lean_update(app)
    # inside RequestGuard: Starlette wraps each later-added middleware around the earlier ones
    app.add_middleware(WeightsUpdateGate, state=state, on_error=partial(error_answer, state))  # type: ignore[arg-type]
    app.add_middleware(RequestGuard, max_body_bytes=state.config.max_body_mb << 20,  # type: ignore[arg-type]
                       on_error=lambda status: state.metrics.http_errors.labels(str(status)).inc(),
                       body_timeout_s=state.config.body_timeout_s)
    return app


def _document_lean_update(app: FastAPI) -> None:
    """POST /weights/update is answered before FastAPI's routing (sidecar/api/control.py says why), so
    FastAPI leaves it out of its schema: it is added from its body model, for /docs and schema clients."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()  # cached by FastAPI from here on: extended once
        body = WeightsUpdateRequest.model_json_schema(ref_template="#/components/schemas/{model}")
        models = schema.setdefault("components", {}).setdefault("schemas", {})
        models.update({**body.pop("$defs", {}), "WeightsUpdateRequest": body})
        schema["paths"]["/weights/update"] = {"post": {
            "summary": "One weight sync: start, receive every bucket while the sender sends, audit and commit",
            "operationId": "weights_update",
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": {"$ref": "#/components/schemas/WeightsUpdateRequest"}}}},
            "responses": {"200": {"description": "the sync's audit"},
                          "4XX": {"description": "an error", "content": {"application/json": {
                              "schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}}}}
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def _auth(key: str | None) -> Any:
    # async, though it awaits nothing: FastAPI runs a plain `def` dependency in its thread pool, a thread
    # hop on every authenticated call (0.2 ms of each weight-sync message on a busy 2-core box).
    async def key_required(request: Request) -> None:
        require_key(key, request.headers)

    return key_required


def _install_error_handlers(app: FastAPI, state: ServerState) -> None:
    for kind in (ApiError, RankError, InvalidRequestError, StateError, RequestValidationError,
                 StarletteHTTPException):
        app.add_exception_handler(kind, partial(_error_handler, state))
    # No handler for Exception here: sidecar/api/guard.py answers those (a handler here would run in
    # Starlette's ServerErrorMiddleware, which re-raises, and the kept-alive connection would be dropped).


async def _error_handler(state: ServerState, _: Request, e: Exception) -> JSONResponse:
    answer = error_answer(state, e)
    assert answer is not None, f"no answer for {type(e).__name__}"  # registered for the kinds it answers
    return answer


def error_answer(state: ServerState, e: Exception) -> JSONResponse | None:
    """The app's JSON error answer to an exception a handler (or FastAPI) raised, counted in the metrics;
    None for an unexpected one (RequestGuard answers it with a 500). Every route answers through it (the
    POST /weights/update of sidecar/api/control.py too), so every error reads the same."""
    code = None
    if isinstance(e, ApiError):
        headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else e.headers
        status, args, code = e.status, (e.type, e.message, e.field, e.rank), e.code
    elif isinstance(e, RankError):
        a = rank_error_to_api(e)
        status, args, headers = a.status, (a.type, a.message, a.field, a.rank), None
    elif isinstance(e, InvalidRequestError):
        status, args, headers = 400, (type(e).__name__, e.message, e.field), None
    elif isinstance(e, StateError):
        status, args, headers = 409, (type(e).__name__, str(e)), None
    elif isinstance(e, RequestValidationError):
        (status, args), headers = _validation_error(e), None
    elif isinstance(e, StarletteHTTPException):
        kind = {400: "MalformedBody", 404: "NotFound", 405: "MethodNotAllowed", 408: "RequestTimeout",
                413: "PayloadTooLarge"}.get(e.status_code, "HTTPError")
        # FastAPI's own 400 is a body it could not parse (bytes that are not JSON in the declared encoding)
        status, args = e.status_code, (kind, str(e.detail), "body" if e.status_code in (400, 408, 413) else None)
        headers = e.headers
    else:
        return None
    state.metrics.http_errors.labels(str(status)).inc()
    return error_response(status, *args, headers=headers, code=code)


def _validation_error(e: RequestValidationError) -> tuple[int, tuple[str, str, str]]:
    errors = list(e.errors()) or [{"loc": ("body",), "msg": "invalid request", "type": ""}]
    if any(err.get("type") == "json_invalid" for err in errors):
        return 400, ("MalformedJSON", f"the body is not valid JSON: {errors[0].get('msg')}", "body")
    # A union reports one error per member: the deepest location is the most specific one.
    best = max(errors, key=lambda err: len(field_path(err.get("loc", ()))))
    name = field_path(best.get("loc", ())) or "body"
    return 422, ("ValidationError", f"{name}: {best.get('msg')}", name)


def field_path(loc: Any) -> str:
    """pydantic's loc -> "sampling_params[0].temperature": drops "body"/"query" and union member tags
    (type names such as "str", "list[int]", "SamplingParamsModel"; our fields are snake_case)."""
    out = ""
    parts = list(loc)
    for part in parts[1:] if parts and parts[0] in ("body", "query", "path", "header") else parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in part or part[:1].isupper() or part in ("str", "int", "float", "bool", "list", "dict"):
            continue
        else:
            out += f".{part}" if out else part
    return out


def _add_open_routes(router: APIRouter, state: ServerState) -> None:
    @router.api_route("/health", methods=["GET", "HEAD"],
                      summary="200 while every rank is alive and answering, else 503")
    async def health() -> JSONResponse:
        failure = state.driver.failure
        if failure is None:
            return JSONResponse({"status": "ok", "ranks": len(state.plans)})
        error = {"type": "RankFailure", "message": failure, "rank": state.driver.failure_rank}
        return JSONResponse({"status": "unhealthy", "error": error}, status_code=503)

    @router.get("/metrics", summary="Prometheus metrics")
    async def metrics() -> Response:
        body, content_type = state.metrics.render()
        return Response(body, media_type=content_type)


def check_params(body: Any, state: ServerState, prefix: str) -> SamplingParams:
    """The SamplingParams of a request body, refused before queueing by the rules the engine applies
    (SamplingParams' own, then check_limits before the prompt's length is known: inference/core.py);
    the ranks check the prompt's length with the same code. A 400 naming the field otherwise."""
    try:
        params: SamplingParams = body.to_params()
        params.check_limits(state.vocab_size, state.plans[0].max_model_len)
        state.intake.check_params(params)  # the per-step work it causes (stops) and its answer's size
    except InvalidRequestError as e:
        name = e.field.removeprefix("sampling_params.")
        raise ApiError(400, type(e).__name__, e.message, f"{prefix}.{name}" if prefix else name) from None
    return params


def _rename_prompt_errors(e: ApiError, prompts_field: str, params_field: str, per_prompt_params: bool,
                          index: int | None) -> ApiError:
    """Engine fields ("prompt", "sampling_params.x") -> the fields of this endpoint's body."""
    f = e.field
    if f == "prompt":
        e.field = prompts_field if index is None else f"{prompts_field}[{index}]"
    elif f is not None and f.startswith("sampling_params"):
        rest = f.removeprefix("sampling_params")
        base = f"{params_field}[{index}]" if per_prompt_params and index is not None else params_field
        e.field = (base + rest) if base else rest.lstrip(".")
    return e


async def submit_group(state: ServerState, prompts: list[Any], params: list[SamplingParams], wait: bool,
                       names: tuple[str, str, bool], sync: SyncPolicy = DEFAULT_SYNC_POLICY,
                       on_progress: Callable[[int, Any], None] | None = None) -> Future:
    """Check, tokenize (off the loop) and queue a group; the driver's future of its outputs. `names`:
    the body's prompts field, params field, and whether params are per prompt (for error fields);
    `on_progress`: stream it (Driver.submit)."""
    try:
        inputs = await encode_group(state.intake, prompts, params)  # limits, then tokenization off the loop
        return state.driver.submit(list(zip(inputs, params)), wait=wait, sync=sync, on_progress=on_progress)
    except ApiError as e:
        raise _rename_prompt_errors(e, *names, e.index) from None


def rename_group_error(e: ApiError, names: tuple[str, str, bool]) -> ApiError:
    """An error of a queued group (`submit_group`) with the body's field names."""
    return _rename_prompt_errors(e, *names, e.index)


async def run_group(request: Request, state: ServerState, prompts: list[Any], params: list[SamplingParams],
                    wait: bool, names: tuple[str, str, bool],
                    sync: SyncPolicy = DEFAULT_SYNC_POLICY) -> list[RequestOutput]:
    fut = await submit_group(state, prompts, params, wait, names, sync)
    try:
        return await await_future(request, fut, state.driver)
    except ApiError as e:
        raise rename_group_error(e, names) from None


def _add_generation_routes(router: APIRouter, state: ServerState) -> None:
    @router.post("/generate", response_model=GenerateResponse, summary="Generate: token ids, logprobs, weight version")
    async def generate(body: GenerateRequest, request: Request) -> GenerateResponse:
        sp = body.sampling_params
        per_prompt = isinstance(sp, list)
        models = sp if isinstance(sp, list) else [sp] * len(body.prompts)
        if len(models) != len(body.prompts):
            raise ApiError(400, "InvalidRequestError", f"{len(models)} given for {len(body.prompts)} prompts",
                           "sampling_params")
        params = [check_params(m, state, f"sampling_params[{i}]" if per_prompt else "sampling_params")
                  for i, m in enumerate(models)]
        outs = await run_group(request, state, list(body.prompts), params, body.wait,
                               ("prompts", "sampling_params", per_prompt), body.sync_policy())
        return GenerateResponse(outputs=[_prompt_out(o) for o in outs])


def _prompt_out(o: RequestOutput) -> PromptOut:
    return PromptOut(
        prompt=o.prompt, prompt_token_ids=o.prompt_token_ids, weight_version=o.weight_version,
        num_cached_tokens=o.num_cached_tokens,
        completions=[CompletionOut(
            index=c.index, text=c.text, token_ids=c.token_ids, logprobs=c.logprobs,
            finish_reason=c.finish_reason.value if c.finish_reason is not None else None,
            stop_reason=c.stop_reason,
            top_logprobs=[{str(k): v for k, v in d.items()} for d in c.top_logprobs] if c.top_logprobs else None,
            weight_version_spans=[tuple(s) for s in c.weight_version_spans],
            draft_version_spans=[tuple(s) for s in c.draft_version_spans], restarts=c.restarts,
            routing=RoutingOut(**encode_routing(c.routing)) if c.routing is not None else None)
            for c in o.outputs])
