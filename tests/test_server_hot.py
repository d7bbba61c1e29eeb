"""POST /weights/update, the one request of every sync, is answered by sidecar/http/hot.py's HotRoutes
without FastAPI's routing and validation pass; every answer a client can get must read exactly as the
FastAPI route's (SIDECAR_HOT_ROUTES=0): the sync's answer, each 4xx naming its field, a rank's error, the
body limit, the API key. In-process, on a stub driver that answers at once (the real sidecar's syncs go
through the hot path in every client test)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient

from sidecar.config import LaunchConfig
from sidecar.http.app import ServerState, create_app
from sidecar.http.hot import HotRoutes
from sidecar.http.metrics import Metrics
from sidecar.ranks.commands import ErrorInfo, RankPlan, SyncResult, UpdateReply
from sidecar.ranks.driver import RankError

KEY = "k-123"
RANK = "dp0:pp0:tp0"
START = {"model": "target", "version": 3, "manifest": {"layout": "abc", "weight_version": 3, "rank": RANK}}


class StubDriver:
    """Answers every UpdateWeights at once: the audit passed, or `error` (a RankError) when set."""

    failure = None
    failure_rank = None
    paused = False
    busy = None
    tokens_total = 0
    statuses: list[Any] = [None]  # noqa: RUF012
    pool = SimpleNamespace(alive=lambda: [True])

    def __init__(self) -> None:
        self.calls: list[Any] = []
        self.error: RankError | None = None

    def call(self, cmd: Any, timeout: float | None = None) -> Future:
        self.calls.append(cmd)
        fut: Future = Future()
        if self.error is not None:
            fut.set_exception(self.error)
        elif type(cmd).__name__ == "UpdateWeights":
            result = SyncResult("target", 3, RANK, True, "ok", 7, "xxh3_64_seg64k", 0.0015) if cmd.finish else None
            fut.set_result([UpdateReply(0.001 if cmd.start is not None else 0.0, result)])
        else:
            fut.set_result([False])  # AbortWeightUpdate: no session was open
        return fut

    def queue_depth(self) -> int:
        return 0

    def queued_sequences(self) -> int:
        return 0

    def tokens_per_second(self) -> float:
        return 0.0


def _app(hot: bool, monkeypatch: pytest.MonkeyPatch, key: str | None = None) -> tuple[Any, StubDriver, Metrics]:
    monkeypatch.setenv("SIDECAR_HOT_ROUTES", "1" if hot else "0")
    plan = RankPlan(**{"rank": RANK, "pid": 1, "device": "cpu", "weights_bytes": {}, "kv_blocks": 1, "kv_bytes": 1,
            "vocab_size": 512, "max_model_len": 64, "model": "m", "draft_model": None, "models": ("target",),
            "dtype": "float32", "block_size": 16, "has_tokenizer": False, "num_threads": 1})
    driver = StubDriver()
    metrics = Metrics(driver)  # type: ignore[arg-type]
    app = create_app(ServerState(driver, LaunchConfig(api_key=key, max_body_mb=1), [plan], metrics))  # type: ignore[arg-type]
    return app, driver, metrics


def _hot(app: Any) -> HotRoutes | None:
    """The app's HotRoutes layer (None when it has none)."""
    layer = app.middleware_stack
    while layer is not None and not isinstance(layer, HotRoutes):
        layer = getattr(layer, "app", None)
    return layer


@pytest.fixture
def both(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[bool, tuple[TestClient, Any, StubDriver, Metrics]]]:
    """The same app with and without HotRoutes, each with its own stub driver, the API key set."""
    apps = {hot: _app(hot, monkeypatch, KEY) for hot in (True, False)}
    clients = {hot: TestClient(app, raise_server_exceptions=False) for hot, (app, _, _) in apps.items()}
    try:
        yield {hot: (clients[hot], *apps[hot]) for hot in apps}
    finally:
        for c in clients.values():
            c.close()


def _post(client: TestClient, body: Any = None, *, key: str | None = KEY, raw: bytes | None = None,
          content_type: str = "application/json") -> tuple[int, Any]:
    headers = {"content-type": content_type, **({"authorization": f"Bearer {key}"} if key else {})}
    if raw is None and body is not None:
        raw = json.dumps(body).encode()
    resp = client.post("/weights/update", content=raw or b"", headers=headers)
    return resp.status_code, resp.json()


def test_a_valid_sync_is_served_hot_with_the_routes_answer(both: dict) -> None:
    hot_client, hot_app, hot_driver, _ = both[True]
    full_client, full_app, _, _ = both[False]
    body = {"start": START, "finish": True}
    hot = _post(hot_client, body)
    assert _hot(hot_app) is not None and _hot(hot_app).served == 1
    assert _hot(full_app) is None  # SIDECAR_HOT_ROUTES=0: FastAPI's route answered
    full = _post(full_client, body)
    assert hot == full
    status, answer = hot
    assert status == 200 and answer["version"] == 3 and answer["audit"]["ok"] is True
    assert answer["audit"]["audit_ms"] == 1.5 and answer["ranks"] == [{"rank": RANK, "ok": True, "summary": "ok"}]
    (cmd,) = hot_driver.calls
    assert cmd.finish is True and cmd.start.version == 3 and cmd.start.manifest == START["manifest"]
    # without finish: the two-request path's update, hot too
    assert _post(hot_client, {"update_info": None}) == _post(full_client, {"update_info": None})
    assert _hot(hot_app).served == 2


def test_a_timed_answer_says_its_handler_time(both: dict) -> None:
    client = both[True][0]
    resp = client.post("/weights/update", json={"start": START, "finish": True},
                       headers={"authorization": f"Bearer {KEY}"})
    assert resp.status_code == 200
    timing = resp.headers["server-timing"]
    assert timing.startswith("app;dur=") and ", handler;dur=" in timing, timing


@pytest.mark.parametrize(("body", "raw", "status", "field"), [
    ({"start": {**START, "version": "three"}, "finish": True}, None, 422, "start.version"),
    ({"finish": "maybe"}, None, 422, "finish"),
    ({"update_info": None, "surprise": 1}, None, 422, "surprise"),
    ({"update_info": [{}, {}]}, None, 400, "update_info"),  # valid shape, refused by the handler
    (None, b'{"start": ', 400, "body"),  # not JSON
    (None, b"[1, 2]", 422, "body"),
])
def test_every_refusal_reads_as_the_routes(both: dict, body: Any, raw: bytes | None, status: int,
                                           field: str) -> None:
    answers = {hot: _post(c, body, raw=raw) for hot, (c, *_rest) in both.items()}
    assert answers[True] == answers[False]
    got_status, answer = answers[True]
    assert got_status == status and answer["error"]["field"] == field, answer
    assert not both[True][2].calls and not both[False][2].calls  # nothing reached the ranks


def test_a_wrong_key_or_content_type_gets_the_routes_answer(both: dict) -> None:
    for kwargs in ({"key": "wrong"}, {"key": None}, {"content_type": "text/plain"}):
        answers = {hot: _post(c, {"finish": False}, **kwargs) for hot, (c, *_rest) in both.items()}
        assert answers[True] == answers[False], kwargs
    status, answer = _post(both[True][0], {"finish": False}, key="wrong")
    assert status == 401 and answer["error"]["field"] == "authorization"
    assert not both[True][2].calls  # nothing reached the ranks
    assert _hot(both[True][1]).served == 0


def test_a_ranks_error_reads_and_counts_as_the_routes(both: dict) -> None:
    answers = {}
    for hot, (client, _, driver, metrics) in both.items():
        driver.error = RankError(ErrorInfo("ChecksumMismatch", "tensor w: digest differs", "checksum", None, RANK))
        answers[hot] = _post(client, {"start": START, "finish": True})
        counted = {s.labels["status"]: s.value for m in metrics.registry.collect() if m.name == "sidecar_http_errors"
                   for s in m.samples if s.name.endswith("_total")}
        assert counted == {"409": 1.0}, (hot, counted)
    assert answers[True] == answers[False]
    status, answer = answers[True]
    assert status == 409 and answer["error"]["rank"] == RANK and "tensor w" in answer["error"]["message"]


def test_a_streamed_body_over_the_limit_is_413_on_both_paths(both: dict) -> None:
    def chunks() -> Iterator[bytes]:  # no content-length: the limit is found while reading
        yield b'{"update_info": null, "pad": "'
        for _ in range(40):
            yield b"x" * 32768
        yield b'"}'

    for client, *_rest in both.values():
        resp = client.post("/weights/update", content=chunks(), headers={
            "authorization": f"Bearer {KEY}", "content-type": "application/json"})
        assert resp.status_code == 413 and resp.json()["error"]["field"] == "body", resp.text
