"""The user-facing sync's control path against a real `sidecar launch` (CPU, gloo): one sync through
SidecarClient.sync_weights is ONE HTTP request (the update carrying the start and "finish": the sender
delivers its digests over the group and the answer is the audit), counted on the wire by a transport, so
a regression to more round trips fails; a flipped byte still fails that audit naming tensor and rank.
A start the ranks refuse inside that update is the sidecar's 400/409 within seconds, not the sender's
wire timeout (the ranks refuse its plan agreement), and the group stays usable; a session opened
before stays open (its lease too) until it is aborted. A sidecar that does not say `audit_in_update`
gets update then finish, one without `start_in_update` the separate start too, as before."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from inference.models.tiny import TinyModelSpec, random_weights
from inference.transfer.sender import WeightSender
from tests.helpers_fault import flip_env
from tests.helpers_sidecar import Sidecar, launch
from tests.helpers_weight_update import RANK
from trainer_hooks.client import SidecarChecksumError, SidecarClient, SidecarRequestError, SidecarStateError

WIRE_TIMEOUT_S = 60.0  # the sender's: every refusal below must come long before it
FAST_S = 20.0  # a refused start's answer, on a loaded CPU box, with margin
WEIGHTS = random_weights(TinyModelSpec(seed=5))


class CountingTransport(httpx.HTTPTransport):
    """Counts the requests that reach the wire, by path."""

    def __init__(self) -> None:
        super().__init__()
        self.paths: list[str] = []
        self.timings: dict[str, str] = {}  # path -> its last answer's Server-Timing header

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.paths.append(request.url.path)
        resp = super().handle_request(request)
        self.timings[request.url.path] = resp.headers.get("server-timing", "")
        return resp


@pytest.fixture(scope="module")
def server() -> Iterator[Sidecar]:
    proc = launch()
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def sender() -> Iterator[WeightSender]:
    s = WeightSender("gloo", num_receivers=1, timeout_s=WIRE_TIMEOUT_S)
    try:
        yield s
    finally:
        s.close()


def _client(server: Sidecar) -> tuple[SidecarClient, CountingTransport]:
    wire = CountingTransport()
    return SidecarClient(server.url, timeout=60, transport=wire), wire


def _live(c: SidecarClient) -> int:
    return int(c.state()["weight_versions"]["target"])


def test_a_sync_is_one_request_carrying_start_and_finish(server: Sidecar, sender: WeightSender) -> None:
    c, wire = _client(server)
    with c:
        init = c.connect_sender(sender)
        assert init["start_in_update"] is True and init["audit_in_update"] is True
        version = _live(c)
        for _ in range(3):  # the first sends the tensors, the later ones the layout key
            version += 1
            wire.paths.clear()
            result = c.sync_weights(sender, WEIGHTS, version=version)
            assert result["ok"] and result["tensors_checked"] == len(WEIGHTS), result["table"]
            assert result["algorithm"] == sender.algorithm and result["source"] == "received"
            assert wire.paths == ["/weights/update"]
            assert _live(c) == version  # committed when the one answer came
            # what scripts/bench_client_sync.py splits a control message's time by
            found = dict(re.findall(r"(app|handler|ranks);dur=([0-9.]+)", wire.timings["/weights/update"]))
            assert 0 < float(found["handler"]) <= float(found["app"]), wire.timings
            # the rank's own time on the update, inside the handler's (the rest: the sidecar's hops)
            assert 0 < float(found["ranks"]) <= float(found["handler"]), wire.timings
        metrics = c.metrics()
        for phase in ("start", "update", "finish", "audit", "total"):  # the server still reports each phase
            assert f'sidecar_weight_sync_seconds_count{{model="target",phase="{phase}"}}' in metrics


@pytest.mark.parametrize("start_in_update, paths", [
    (True, ["/weights/update", "/weights/finish"]),  # a sidecar without audit_in_update
    (False, ["/weights/start", "/weights/update", "/weights/finish"]),  # ... without start_in_update either
])
def test_older_sidecars_get_the_older_paths(server: Sidecar, sender: WeightSender, start_in_update: bool,
                                            paths: list[str]) -> None:
    c, wire = _client(server)
    with c:
        c.connect_sender(sender)
        c._start_in_update, c._audit_in_update = start_in_update, False  # what an older init answer leaves
        version = _live(c) + 1
        wire.paths.clear()
        assert c.sync_weights(sender, WEIGHTS, version=version)["ok"]
        assert wire.paths == paths and _live(c) == version


def test_a_flipped_byte_fails_the_one_request_audit_naming_tensor_and_rank(sender: WeightSender) -> None:
    flipped = next(iter(WEIGHTS))
    proc = launch(env=flip_env(flipped))  # the rank flips a byte of it on arrival
    try:
        c, wire = _client(proc)
        with c:
            c.connect_sender(sender)
            for version in (1, 2):  # a failed audit leaves the group usable: the next sync is audited too
                wire.paths.clear()
                with pytest.raises(SidecarChecksumError) as err:
                    c.sync_weights(sender, WEIGHTS, version=version)
                assert wire.paths == ["/weights/update"] and err.value.status == 409
                assert flipped in err.value.message and err.value.rank == RANK, err.value.message
                state = c.state()
                assert state["torn"] == {"target": True} and state["weight_versions"] == {"target": 0}
            assert 'sidecar_audit_failures_total 2.0' in c.metrics()
    finally:
        assert proc.stop() == 0, proc.log


def test_a_refused_start_is_the_sidecars_error_at_once_and_the_group_stays(server: Sidecar,
                                                                          sender: WeightSender) -> None:
    c, wire = _client(server)
    with c:
        c.connect_sender(sender)
        live = _live(c)
        t0 = time.monotonic()
        with pytest.raises(SidecarRequestError) as stale:
            c.sync_weights(sender, WEIGHTS, version=live)  # not newer than the live version
        assert stale.value.field == "version" and stale.value.status == 400
        assert time.monotonic() - t0 < FAST_S, "send() waited for its wire timeout"
        assert sender.connected and not c.state()["torn"]["target"]
        wire.paths.clear()
        assert c.sync_weights(sender, WEIGHTS, version=live + 1)["ok"]  # no re-init needed
        assert wire.paths == ["/weights/update"]


def test_a_start_refused_while_a_session_is_open_leaves_that_session_open(server: Sidecar,
                                                                         sender: WeightSender) -> None:
    c, _ = _client(server)
    with c:
        c.connect_sender(sender)
        version = _live(c) + 1
        c.start_weights(version, sender.manifest(WEIGHTS, version))  # a session, opened the separate way
        t0 = time.monotonic()
        with pytest.raises(SidecarStateError) as busy:
            c.sync_weights(sender, WEIGHTS, version=version + 1)
        assert "is open" in busy.value.message and time.monotonic() - t0 < FAST_S
        assert c.abort_weights()["aborted"] is True  # it was still open on the rank
        assert c.sync_weights(sender, WEIGHTS, version=version + 1)["ok"]


def test_update_without_start_in_the_body_still_needs_an_open_session(server: Sidecar) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as http:
        r = http.post("/weights/update", json={"update_info": None, "start": None})
        assert r.status_code == 409, r.text
        bad: Any = http.post("/weights/update", json={"start": {"version": "1", "manifest": {}}})
        assert bad.status_code == 422 and bad.json()["error"]["field"] == "start.version"
