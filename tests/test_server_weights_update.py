"""POST /weights/update, the one request of every sync, is one lean route (sidecar/api/control.py) without
FastAPI's dependency and validation pass; every answer a client can get must still read as every other
route's: the sync's answer, each 4xx naming its field, a rank's error (counted in the metrics), the body
limit, the API key. In-process, on a stub driver that answers at once (the real sidecar's syncs go
through this route in every client test)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient

from sidecar.api.app import ServerState, create_app
from sidecar.api.metrics import Metrics
from sidecar.config import LaunchConfig
from sidecar.ranks.commands import ErrorInfo, RankPlan, SyncResult, TransferJoined, UpdateReply
from sidecar.ranks.driver import RankError
from trainer_hooks.sync import SYNC_PROTOCOL

KEY = "k-123"
RANK = "dp0:pp0:tp0"
START = {"model": "target", "version": 3, "manifest": {"layout": "abc", "weight_version": 3, "rank": RANK}}
INIT = {"backend": "gloo", "master_host": "127.0.0.1", "master_port": 29999, "world_size": 2, "bucket_bytes": 1 << 20,
        "timeout_s": 10.0, "session_id": "s-1", "auth": "secret"}


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
            result = SyncResult("target", 3, RANK, True, "ok", 7, "xxh3_64_seg64k", 0.0015)
            fut.set_result([UpdateReply(0.001, result)])
        elif type(cmd).__name__ == "InitWeightTransfer":
            fut.set_result([TransferJoined()])  # the rank joined; it holds no model in FP8
        else:
            fut.set_result([False])  # AbortWeightUpdate: no session was open
        return fut

    def queue_depth(self) -> int:
        return 0

    def queued_sequences(self) -> int:
        return 0

    def tokens_per_second(self) -> float:
        return 0.0


def _app(key: str | None = None) -> tuple[Any, StubDriver, Metrics]:
    plan = RankPlan(**{"rank": RANK, "pid": 1, "device": "cpu", "weights_bytes": {}, "kv_blocks": 1, "kv_bytes": 1,
            "vocab_size": 512, "max_model_len": 64, "model": "m", "draft_model": None, "models": ["target"],
            "dtype": "float32", "block_size": 16, "has_tokenizer": False, "num_threads": 1})
    driver = StubDriver()
    metrics = Metrics(driver)  # type: ignore[arg-type]
    app = create_app(ServerState(driver, LaunchConfig(api_key=key, max_body_mb=1), [plan], metrics))  # type: ignore[arg-type]
    return app, driver, metrics


@pytest.fixture
def served() -> Iterator[tuple[TestClient, StubDriver, Metrics]]:
    """The app with the API key set, its stub driver and metrics, after an init (its session is in SESSION)."""
    app, driver, metrics = _app(KEY)
    with TestClient(app, raise_server_exceptions=False) as client:
        status, answer = _post(client, {"init_info": INIT, "protocol": SYNC_PROTOCOL}, path="/weights/init")
        assert status == 200 and answer["session"]["session_id"] == "s-1", answer
        SESSION.clear()
        SESSION.update(answer["session"])
        driver.calls.clear()
        yield client, driver, metrics


SESSION: dict[str, str] = {}  # the session the fixture's init answered; every update body carries it


def _post(client: TestClient, body: Any = None, *, key: str | None = KEY, raw: bytes | None = None,
          path: str = "/weights/update") -> tuple[int, Any]:
    headers = {"content-type": "application/json", **({"authorization": f"Bearer {key}"} if key else {})}
    if path == "/weights/update" and isinstance(body, dict) and "start" in body and "session" not in body:
        body = {**body, "session": SESSION}
    if raw is None and body is not None:
        raw = json.dumps(body).encode()
    resp = client.post(path, content=raw or b"", headers=headers)
    return resp.status_code, resp.json()


def _errors_counted(metrics: Metrics) -> dict[str, float]:
    return {s.labels["status"]: s.value for m in metrics.registry.collect() if m.name == "sidecar_http_errors"
            for s in m.samples if s.name.endswith("_total")}


def test_a_sync_is_one_update_whose_answer_is_the_audit(served: tuple) -> None:
    client, driver, _ = served
    status, answer = _post(client, {"start": START})
    assert status == 200 and answer["version"] == 3 and answer["audit"]["ok"] is True
    assert answer["audit"]["audit_ms"] == 1.5 and answer["ranks"] == [{"rank": RANK, "ok": True, "summary": "ok"}]
    (cmd,) = driver.calls
    assert cmd.start.version == 3 and cmd.start.manifest == START["manifest"]
    documented = client.get("/openapi.json").json()  # one implementation, the lean one, in the schema all the same
    assert documented["paths"]["/weights/update"]["post"]["requestBody"]["content"]["application/json"]
    assert "start" in documented["components"]["schemas"]["WeightsUpdateRequest"]["required"]


def test_a_timed_answer_says_its_handler_time(served: tuple) -> None:
    client = served[0]
    resp = client.post("/weights/update", json={"start": START, "session": SESSION},
                       headers={"authorization": f"Bearer {KEY}"})
    assert resp.status_code == 200
    timing = resp.headers["server-timing"]
    assert timing.startswith("app;dur=") and ", handler;dur=" in timing, timing


@pytest.mark.parametrize(("body", "raw", "status", "field"), [
    ({"start": {**START, "version": "three"}}, None, 422, "start.version"),
    ({"update_info": None}, None, 422, "start"),
    ({"start": START, "finish": True}, None, 422, "finish"),  # an older client's field: unknown now
    ({"start": START, "update_info": [{}, {}]}, None, 400, "update_info"),  # valid shape, refused by the handler
    (None, b'{"start": ', 400, "body"),  # not JSON
    (None, b"[1, 2]", 422, "body"),
])
def test_every_refusal_names_its_field_and_reads_as_every_routes(served: tuple, body: Any, raw: bytes | None,
                                                                 status: int, field: str) -> None:
    client, driver, metrics = served
    got_status, answer = _post(client, body, raw=raw)
    assert got_status == status and answer["error"]["field"] == field, answer
    assert set(answer["error"]) == {"type", "message", "field", "rank", "param", "code"}
    assert not driver.calls  # nothing reached the ranks
    assert _errors_counted(metrics) == {str(status): 1.0}


def test_malformed_json_reads_the_same_on_the_lean_route_and_a_fastapi_one(served: tuple) -> None:
    client = served[0]
    lean = _post(client, raw=b'{"start": ')
    fastapi = _post(client, raw=b'{"start": ', path="/weights/init")
    assert lean == fastapi and lean[0] == 400 and lean[1]["error"]["type"] == "MalformedJSON"


def test_a_wrong_or_missing_key_is_401(served: tuple) -> None:
    client, driver, _ = served
    for key in ("wrong", None):
        status, answer = _post(client, {"start": START}, key=key)
        assert status == 401 and answer["error"]["field"] == "authorization", answer
        assert answer == _post(client, {}, key=key, path="/pause")[1]  # as every guarded route answers
    assert not driver.calls  # nothing reached the ranks


def test_a_ranks_error_reads_and_counts_as_every_routes(served: tuple) -> None:
    client, driver, metrics = served
    driver.error = RankError(ErrorInfo("ChecksumMismatch", "tensor w: digest differs", "checksum", None, RANK))
    status, answer = _post(client, {"start": START})
    assert _errors_counted(metrics) == {"409": 1.0}
    assert status == 409 and answer["error"]["rank"] == RANK and "tensor w" in answer["error"]["message"]


def test_a_streamed_body_over_the_limit_is_413(served: tuple) -> None:
    def chunks() -> Iterator[bytes]:  # no content-length: the limit is found while reading
        yield b'{"update_info": null, "pad": "'
        for _ in range(40):
            yield b"x" * 32768
        yield b'"}'

    resp = served[0].post("/weights/update", content=chunks(), headers={
        "authorization": f"Bearer {KEY}", "content-type": "application/json"})
    assert resp.status_code == 413 and resp.json()["error"]["field"] == "body", resp.text


def test_an_update_of_a_replaced_or_unnamed_session_is_refused_before_the_ranks(served: tuple) -> None:
    """A second trainer's init replaces the ranks' group: the first trainer's update (its session, or none,
    or a guessed nonce) is a 409 naming `session`, and nothing reaches the ranks."""
    client, driver, _ = served
    first = dict(SESSION)
    status, answer = _post(client, {"init_info": {**INIT, "session_id": "s-2"}, "protocol": SYNC_PROTOCOL},
                           path="/weights/init")
    assert status == 200 and answer["session"]["nonce"] != first["nonce"]
    driver.calls.clear()
    for session, why in [(first, "replaced by another init"), (None, "names no session"),
                         ({"session_id": "s-2", "nonce": first["nonce"]}, "nonce")]:
        status, refused = _post(client, {"start": START, "session": session})
        assert status == 409 and refused["error"]["field"] == "session" and why in refused["error"]["message"]
    assert not driver.calls
    status, _ = _post(client, {"start": START, "session": answer["session"]})
    assert status == 200
