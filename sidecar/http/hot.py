"""`lean_route`: a POST route answered without FastAPI's per-request machinery, for POST /weights/update,
the one request of every weight sync.

Why: dependency solving, FastAPI's body pass and its response model were most of what a sync's message
cost beyond its handler (docs/benchmarks.md: a control message's time beyond its handler went from
1.41-1.55 ms through the FastAPI route to 1.12-1.17 ms without that pass, on the 2-core CPU box).

Contract, the same as a FastAPI route's: the API key is checked first (401 naming `authorization`); the
body is parsed as JSON (400 MalformedJSON naming `body`) and validated with the route's pydantic model
as FastAPI validates it, in python mode (422 naming the field). Every error, raised here or by the
handler, goes through the app's exception handlers (sidecar/http/app.py, error_answer), so it reads and
is counted as every other route's. It is a plain Starlette route, so it is not in the OpenAPI schema.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Scope

from sidecar.http.guard import require_key

Handler = Callable[[Any, Scope], Awaitable[Response]]


def lean_route(body: type[BaseModel], handler: Handler, key: str | None) -> Callable[[Request], Awaitable[Response]]:
    """A Starlette endpoint: `handler(parsed body, scope)` for a request that passes the module's checks."""

    async def endpoint(request: Request) -> Response:
        require_key(key, request.headers)
        raw = await request.body()  # the body limit's 413 is raised here (sidecar/http/guard.py)
        try:
            data = json.loads(raw)
        except ValueError as e:  # json's errors are ValueErrors (bad UTF-8 too)
            raise RequestValidationError([{"type": "json_invalid", "loc": ("body", 0), "msg": "JSON decode error",
                                           "input": {}, "ctx": {"error": str(e)}}]) from None  # FastAPI's own
        try:
            parsed = body.model_validate(data)
        except ValidationError as e:
            raise RequestValidationError([{**err, "loc": ("body", *err["loc"])}
                                          for err in e.errors(include_url=False)]) from None
        return await handler(parsed, request.scope)

    return endpoint
