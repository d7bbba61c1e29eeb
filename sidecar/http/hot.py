"""`HotRoutes`: the one request of every weight sync (POST /weights/update) answered without FastAPI's
per-request machinery, because that machinery is most of what the message costs beyond its handler.

Measured on the 2-core CPU box (a stub driver that answers at once, median of 2,000 kept-alive calls):
the route through FastAPI took 0.74 ms end to end, of which its handler 0.21; the same answer written by
a plain ASGI function at this layer took 0.28-0.34 ms; GET /health 0.29-0.33. Routing through every
route of the app, solving the dependencies, the body's parse-and-validate pass and the response model
cost ~0.3 ms there, on the critical path of every sync (issue 19: a control message "well under a
millisecond").

What it does: a hot route's request whose body is valid (the route's own pydantic model, validated as
FastAPI validates it: JSON parsed, then the model in python mode) and whose API key is right runs the
route's handler here; the handler is the same coroutine the FastAPI route calls, and its errors get the
app's own error answers (`on_error`). Any other request of that route (a body that is not JSON or not
valid, a wrong key, another content type) goes on to the app with the body it sent, so every error a
client can cause is still answered by the FastAPI route, in one place. The FastAPI route stays for the
OpenAPI schema and those answers.

Invariants: sits inside RequestGuard (the body limit, Server-Timing and the last-resort 500 apply to
both paths); reads the body once and hands it on whole; a handler's unexpected exception propagates to
RequestGuard (a JSON 500) as it would from the FastAPI route.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from inference import envs


def hot_routes_enabled() -> bool:
    """SIDECAR_HOT_ROUTES (on by default; off sends these requests through FastAPI, for A/B benchmarks)."""
    return bool(envs.HOT_ROUTES.get())


@dataclass(frozen=True)
class HotRoute:
    """A route HotRoutes serves: its body model and the handler the FastAPI route calls too."""

    body: type[BaseModel]
    handler: Callable[[Any, Scope], Awaitable[Response]]


class HotRoutes:
    """ASGI middleware: serves `routes` ((method, path) -> HotRoute) as the module docstring says.
    `authorized(headers)`: the app's API-key check; `on_error(exc)`: the app's answer to a handler's
    exception, None for an unexpected one (re-raised). `served` counts the requests answered here."""

    def __init__(self, app: ASGIApp, routes: dict[tuple[str, str], HotRoute],
                 authorized: Callable[[dict[str, str]], bool],
                 on_error: Callable[[Exception], Response | None]) -> None:
        self.app, self.routes, self.authorized, self.on_error = app, routes, authorized, on_error
        self.served = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = self.routes.get((scope.get("method", ""), scope.get("path", ""))) if scope["type"] == "http" else None
        if route is None:
            await self.app(scope, receive, send)
            return
        try:
            messages, body = await _read_body(receive)
        except Exception as e:  # the body limit's 413 (RequestGuard's receive raises it)
            answer = self.on_error(e)
            if answer is None:
                raise
            await answer(scope, receive, send)
            return
        parsed = self._parse(scope, route, body) if body is not None else None
        if parsed is None:  # the FastAPI route answers it (errors included), from the same bytes
            await self.app(scope, _replay(messages, receive), send)
            return
        self.served += 1
        try:
            response = await route.handler(parsed, scope)
        except Exception as e:
            answer = self.on_error(e)
            if answer is None:
                raise
            response = answer
        await response(scope, receive, send)

    def _parse(self, scope: Scope, route: HotRoute, body: bytes) -> BaseModel | None:
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", ())}
        if not headers.get("content-type", "").startswith("application/json") or not self.authorized(headers):
            return None
        try:
            return route.body.model_validate(json.loads(body))
        except (ValueError, ValidationError):  # json's errors are ValueErrors
            return None


async def _read_body(receive: Receive) -> tuple[list[Message], bytes | None]:
    """Every message up to the body's end, and the body (None if the client went away first)."""
    messages: list[Message] = []
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            return messages, None
        if not message.get("more_body", False):
            return messages, b"".join(m.get("body", b"") for m in messages)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A receive that gives `messages` again, then the connection's own."""
    pending = list(messages)

    async def replayed() -> Message:
        return pending.pop(0) if pending else await receive()

    return replayed
