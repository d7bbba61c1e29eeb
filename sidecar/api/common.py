"""What the HTTP modules share (server.py, server_control.py, server_audit.py): the endpoints' state,
the HTTP-layer error, the rank error kind -> status code table, and awaiting a driver future.

Kept apart so that the route modules import it and server.py imports the route modules, never the
other way round (no import circle).
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from inference.models.hub_cache import is_model_id
from sidecar.api.metrics import Metrics
from sidecar.config import LaunchConfig
from sidecar.ranks.commands import Command, RankPlan
from sidecar.ranks.driver import Driver, RankError

STATUS_OF_KIND = {"invalid": 400, "state": 409, "checksum": 409, "busy": 429, "transfer": 502,
                  "unavailable": 503, "memory": 507, "internal": 500}
DISCONNECT_POLL_S = 1.0


class ApiError(Exception):
    """An error raised by the HTTP layer itself. `kind` is the rank error kind when it came from one."""

    def __init__(self, status: int, type_: str, message: str, field: str | None = None,
                 rank: str | None = None, index: int | None = None, kind: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.type, self.message, self.field, self.rank = status, type_, message, field, rank
        self.code = code  # OpenAI's error code ("model_not_found", ...), when one applies
        self.index = index  # the prompt of a group that failed, when the ranks said which
        self.kind = kind
        self.headers = headers  # extra response headers (Retry-After)


@dataclass
class ServerState:
    """What the endpoints share. `plans` are the ranks' startup reports (memory plan, model facts)."""

    driver: Driver
    config: LaunchConfig
    plans: list[RankPlan]
    metrics: Metrics
    tokenizer: Any = None  # inference.text.tokenizer.Tokenizer, for the token strings of OpenAI logprobs
    intake: Any = None  # sidecar.api.intake.Intake: limits and tokenization of generation calls (create_app)
    started: float = field(default_factory=time.time)
    sync_started: dict[str, tuple[float, int]] = field(default_factory=dict)  # model -> (t0, bytes)
    # The transfer group the ranks joined last and who may drive it: (session id, nonce) of the init that
    # opened it; None while none is joined or an init is under way (sidecar/api/control.py).
    weight_session: tuple[str, str] | None = None
    gc_frozen: int = 0  # objects this process froze once serving (launch_cli.serve, inference/memory/host_heap.py)

    @property
    def vocab_size(self) -> int:
        return self.plans[0].vocab_size

    @property
    def served_model_name(self) -> str:
        """--served-model-name; else the --model id as given (ORG/NAME from the hub cache); else the
        model directory's name."""
        if self.config.served_model_name:
            return str(self.config.served_model_name)
        if self.config.model and is_model_id(self.config.model):
            return str(self.config.model)
        return self.plans[0].model.rstrip("/").rsplit("/", 1)[-1]


def check_model(state: ServerState, name: str | None) -> None:
    """404 in OpenAI's shape unless `name` is the served model's (None: the served model)."""
    served = state.served_model_name
    if name is not None and name != served:
        raise ApiError(404, "NotFoundError", f"the model {name!r} does not exist: this sidecar serves {served!r} "
                       "(--served-model-name); send that name or leave model out", "model", code="model_not_found")


def error_response(status: int, type_: str, message: str, field: str | None = None,
                   rank: str | None = None, headers: dict[str, str] | None = None,
                   code: str | None = None) -> JSONResponse:
    """The one error body: {"error": {type, message, field, rank, param, code}}; `param` (= field) and
    `code` make it OpenAI's shape too, so OpenAI clients read the culprit where they look for it."""
    body = {"error": {"type": type_, "message": message, "field": field, "rank": rank, "param": field, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def rank_error_to_api(e: RankError) -> ApiError:
    """The HTTP error of a failed rank call. `rank` names every rank that failed (comma-separated), and
    the message says what each found when they differ (a TP=2 checksum mismatch names both shards'
    tensors); a bad value is the same on every rank, so its message is said once."""
    info = e.info
    failed = [err for err in e.errors if err.rank] or [info]
    ranks = ", ".join(dict.fromkeys(str(err.rank) for err in failed if err.rank)) or None
    if info.kind == "invalid":
        message = info.message
    elif len({err.message for err in failed}) == 1:
        message = f"rank(s) {ranks}: {info.message}" if len(failed) > 1 else str(e)
    else:
        message = "; ".join(str(RankError(err)) for err in failed)
    return ApiError(STATUS_OF_KIND.get(info.kind, 500), info.type, message, info.field, ranks, info.index,
                    info.kind)


async def await_future(request: Request | None, fut: Future, driver: Driver) -> Any:
    """Await a driver future; if the HTTP client goes away first (with `request`), abort its requests."""
    wrapped = asyncio.wrap_future(fut)
    if request is None:  # nothing to poll: awaited directly, no timer a second (the weight calls)
        try:
            return await wrapped
        except RankError as e:
            raise rank_error_to_api(e) from None
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


async def call(state: ServerState, cmd: Command) -> list[Any]:
    """Run the command on every rank; the per-rank reply values in rank order (or an ApiError)."""
    return await await_future(None, state.driver.call(cmd), state.driver)
