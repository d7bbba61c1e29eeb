"""The HTTP control plane: a FastAPI app over the driver (generation here, control in server_control.py).

Errors: every error response is {"error": {"type", "message", "field", "rank"}}. Status codes:
400 a bad value (malformed JSON, a value out of range; `field` names it), 422 a wrong type or an
unknown field (pydantic), 401 a missing or wrong API key, 404 an unknown route, 409 a state conflict
(asleep with wait=false, an update without start, a checksum mismatch: the model is torn),
429 too many queued prompts, 502 the weight wire failed (trainer gone, timeout), 503 a rank is dead
or hung, 507 not enough device memory to wake, 500 a bug.

Auth (decision): when an API key is set, every endpoint requires `Authorization: Bearer KEY` except
GET /health and GET /metrics (probes and scrapers) and the OpenAPI docs. Reads such as /state and
/checksums need it too: they describe the model and the weights.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from inference.core import InvalidRequestError, RequestOutput, SamplingParams, StateError
from sidecar.api_models import (
    CompletionOut,
    CompletionRequest,
    ErrorResponse,
    GenerateRequest,
    GenerateResponse,
    PromptOut,
)
from sidecar.config import LaunchConfig
from sidecar.driver import Driver, RankError
from sidecar.metrics import Metrics

log = logging.getLogger(__name__)

STATUS_OF_KIND = {"invalid": 400, "state": 409, "checksum": 409, "busy": 429, "transfer": 502,
                  "unavailable": 503, "memory": 507, "internal": 500}
DISCONNECT_POLL_S = 1.0


class ApiError(Exception):
    """An error raised by the HTTP layer itself."""

    def __init__(self, status: int, type_: str, message: str, field: str | None = None,
                 rank: str | None = None, index: int | None = None) -> None:
        super().__init__(message)
        self.status, self.type, self.message, self.field, self.rank = status, type_, message, field, rank
        self.index = index  # the prompt of a group that failed, when the ranks said which


@dataclass
class ServerState:
    """What the endpoints share. `plans` are the ranks' startup reports (memory plan, model facts)."""

    driver: Driver
    config: LaunchConfig
    plans: list[dict[str, Any]]
    metrics: Metrics
    tokenizer: Any = None  # inference.tokenizer.Tokenizer, for the token strings of OpenAI logprobs
    started: float = field(default_factory=time.time)
    sync_started: dict[str, tuple[float, int]] = field(default_factory=dict)  # model -> (t0, bytes)

    @property
    def vocab_size(self) -> int:
        return int(self.plans[0]["vocab_size"])

    @property
    def served_model_name(self) -> str:
        return str(self.plans[0]["model"]).rstrip("/").rsplit("/", 1)[-1]


def error_response(status: int, type_: str, message: str, field: str | None = None,
                   rank: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"type": type_, "message": message, "field": field, "rank": rank}}
    return JSONResponse(body, status_code=status, headers=headers)


def rank_error_to_api(e: RankError) -> ApiError:
    info = e.info
    message = info.message if info.kind == "invalid" else str(e)  # a bad value is the same on every rank
    return ApiError(STATUS_OF_KIND.get(info.kind, 500), info.type, message, info.field, info.rank, info.index)


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="Sidecar", version="0.1.0", responses={"4XX": {"model": ErrorResponse}},
                  description="Rollouts, sleep/wake, weight syncs and checksum audits of one sidecar.")
    app.state.sidecar = state
    _install_error_handlers(app, state)
    open_router = APIRouter()
    router = APIRouter(dependencies=[Depends(_auth(state.config.api_key))])
    _add_open_routes(open_router, state)
    _add_generation_routes(router, state)
    from sidecar.server_control import add_control_routes

    add_control_routes(router, state)
    app.include_router(open_router)
    app.include_router(router)
    return app


def _auth(key: str | None) -> Any:
    def require_key(request: Request) -> None:
        if key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise ApiError(401, "Unauthorized", "missing or wrong API key: send 'Authorization: Bearer KEY'",
                           "authorization")

    return require_key


def _install_error_handlers(app: FastAPI, state: ServerState) -> None:
    def respond(status: int, *args: Any, **kwargs: Any) -> JSONResponse:
        state.metrics.http_errors.labels(str(status)).inc()
        return error_response(status, *args, **kwargs)

    @app.exception_handler(ApiError)
    async def _api(_: Request, e: ApiError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
        return respond(e.status, e.type, e.message, e.field, e.rank, headers=headers)

    @app.exception_handler(RankError)
    async def _rank(_: Request, e: RankError) -> JSONResponse:
        a = rank_error_to_api(e)
        return respond(a.status, a.type, a.message, a.field, a.rank)

    @app.exception_handler(InvalidRequestError)
    async def _invalid(_: Request, e: InvalidRequestError) -> JSONResponse:
        return respond(400, type(e).__name__, e.message, e.field)

    @app.exception_handler(StateError)
    async def _state(_: Request, e: StateError) -> JSONResponse:
        return respond(409, type(e).__name__, str(e))

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError) -> JSONResponse:
        errors = list(e.errors()) or [{"loc": ("body",), "msg": "invalid request", "type": ""}]
        if any(err.get("type") == "json_invalid" for err in errors):
            return respond(400, "MalformedJSON", f"the body is not valid JSON: {errors[0].get('msg')}", "body")
        # A union reports one error per member: the deepest location is the most specific one.
        best = max(errors, key=lambda err: len(field_path(err.get("loc", ()))))
        name = field_path(best.get("loc", ())) or "body"
        return respond(422, "ValidationError", f"{name}: {best.get('msg')}", name)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = {404: "NotFound", 405: "MethodNotAllowed"}.get(e.status_code, "HTTPError")
        return respond(e.status_code, kind, str(e.detail))

    @app.exception_handler(Exception)
    async def _bug(_: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return respond(500, type(e).__name__, str(e) or type(e).__name__)


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
    @router.get("/health", summary="200 while every rank is alive and answering, else 503")
    async def health() -> JSONResponse:
        failure = state.driver.failure
        if failure is None:
            return JSONResponse({"status": "ok", "ranks": len(state.plans)})
        return JSONResponse({"status": "unhealthy", "error": {"type": "RankFailure", "message": failure}},
                            status_code=503)

    @router.get("/metrics", summary="Prometheus metrics")
    async def metrics() -> Response:
        body, content_type = state.metrics.render()
        return Response(body, media_type=content_type)


async def await_future(request: Request | None, fut: Future, driver: Driver) -> Any:
    """Await a driver future; if the HTTP client goes away first, abort its requests."""
    wrapped = asyncio.wrap_future(fut)
    while True:
        done, _ = await asyncio.wait({wrapped}, timeout=DISCONNECT_POLL_S)
        if done:
            try:
                return wrapped.result()
            except RankError as e:
                raise rank_error_to_api(e) from None
        if request is not None and await request.is_disconnected():
            driver.abort(fut)
            raise ApiError(499, "ClientClosedRequest", "the client went away; its requests were aborted")


def check_params(params: SamplingParams, state: ServerState, prefix: str) -> None:
    """Validate before queueing. max_tokens beyond max_model_len can never be produced: refused as
    absurd here (the engine itself would cap it at max_model_len)."""
    try:
        params.validate(state.vocab_size)
        limit = int(state.plans[0]["max_model_len"])
        if params.max_tokens > limit:
            raise InvalidRequestError("sampling_params.max_tokens",
                                      f"{params.max_tokens} exceeds max_model_len ({limit})")
    except InvalidRequestError as e:
        name = e.field.removeprefix("sampling_params.")
        raise ApiError(400, type(e).__name__, e.message, f"{prefix}.{name}" if prefix else name) from None


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


async def run_group(request: Request, state: ServerState, prompts: list[Any], params: list[SamplingParams],
                    wait: bool, names: tuple[str, str, bool]) -> list[RequestOutput]:
    fut = state.driver.submit(list(zip(prompts, params)), wait=wait)
    try:
        return await await_future(request, fut, state.driver)
    except ApiError as e:
        raise _rename_prompt_errors(e, *names, e.index) from None


def _add_generation_routes(router: APIRouter, state: ServerState) -> None:
    @router.post("/generate", response_model=GenerateResponse, summary="Generate: token ids, logprobs, weight version")
    async def generate(body: GenerateRequest, request: Request) -> GenerateResponse:
        sp = body.sampling_params
        per_prompt = isinstance(sp, list)
        models = sp if isinstance(sp, list) else [sp] * len(body.prompts)
        if len(models) != len(body.prompts):
            raise ApiError(400, "InvalidRequestError", f"{len(models)} given for {len(body.prompts)} prompts",
                           "sampling_params")
        params = []
        for i, m in enumerate(models):
            p = m.to_params()
            check_params(p, state, f"sampling_params[{i}]" if per_prompt else "sampling_params")
            params.append(p)
        outs = await run_group(request, state, list(body.prompts), params, body.wait,
                               ("prompts", "sampling_params", per_prompt))
        return GenerateResponse(outputs=[_prompt_out(o) for o in outs])

    @router.post("/v1/completions", summary="OpenAI-compatible completions (a subset)")
    async def completions(body: CompletionRequest, request: Request) -> dict[str, Any]:
        if body.stream:
            raise ApiError(400, "InvalidRequestError", "streaming is not supported", "stream")
        params = body.to_params()
        check_params(params, state, "")
        prompts = body.prompts()
        if not prompts:
            raise ApiError(400, "InvalidRequestError", "must not be empty", "prompt")
        outs = await run_group(request, state, prompts, [params] * len(prompts), body.wait, ("prompt", "", False))
        from sidecar.openai_format import completion_response

        return completion_response(outs, state.served_model_name, body.logprobs, state.tokenizer,
                                   f"cmpl-{uuid.uuid4().hex}")


def _prompt_out(o: RequestOutput) -> PromptOut:
    return PromptOut(
        prompt=o.prompt, prompt_token_ids=o.prompt_token_ids, weight_version=o.weight_version,
        num_cached_tokens=o.num_cached_tokens,
        completions=[CompletionOut(
            index=c.index, text=c.text, token_ids=c.token_ids, logprobs=c.logprobs,
            finish_reason=c.finish_reason.value if c.finish_reason is not None else None,
            stop_reason=c.stop_reason,
            top_logprobs=[{str(k): v for k, v in d.items()} for d in c.top_logprobs] if c.top_logprobs else None,
            weight_version_spans=[tuple(s) for s in c.weight_version_spans]) for c in o.outputs])
