"""Busy is not dead, and every wait is bounded by what it contains. Against a real `sidecar launch` (TP=1,
CPU) with short timeouts: one generation step that runs several times --step-timeout-s (a long
prefill) is waited for, with its progress in /state and a warning in the log, because the rank
still answers its heartbeat (it used to be declared hung: 503 for good); a /weights/init to a port
where nothing listens fails as a 502 after the join's own timeouts, however much longer than
--rpc-timeout-s they are (it used to outlast the driver's bound: 503 for good); a rank that died
shows as dead in /state, not as its last report. Every wait is on an answer, none is a sleep."""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from inference.core import SamplingParams
from sidecar.client import SidecarClient, SidecarTransferError
from sidecar.ranks.commands import Heartbeat, Reply, Sleep
from sidecar.ranks.driver import Driver, RankError
from sidecar.ranks.pool import RankFailure
from tests.helpers_sidecar import Sidecar, launch
from tests.helpers_tp import free_port

STEP_TIMEOUT_S = 1.5
RPC_TIMEOUT_S = 2.0
MAX_WIRE_TIMEOUT_S = 3.0
LONG_PROMPT = [5 + i % 50 for i in range(2000)]  # one prefill step of seconds on this CPU


@pytest.fixture(scope="module")
def server() -> Iterator[Sidecar]:
    proc = launch("--step-timeout-s", str(STEP_TIMEOUT_S), "--rpc-timeout-s", str(RPC_TIMEOUT_S),
                  "--max-transfer-timeout-s", str(MAX_WIRE_TIMEOUT_S), "--log-level", "warning")
    try:
        yield proc
    finally:
        proc.stop()


@pytest.mark.slow
def test_a_step_longer_than_the_step_timeout_is_waited_for(server: Sidecar) -> None:
    with SidecarClient(server.url, timeout=120) as c, ThreadPoolExecutor(1) as pool:
        greedy = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        running = pool.submit(c.generate, [LONG_PROMPT], greedy)
        seen = 0.0
        while not wait([running], timeout=0.2).done:  # the step's progress, as /state reports it while it runs
            doing = c.state()["ranks"][0]["doing"]
            if doing is not None and doing["what"] == "step":
                seen = max(seen, doing["for_s"])
        outs = running.result()
        assert len(outs[0].outputs[0].token_ids) == 2
        assert c.health()["status"] == "ok"
        if seen < STEP_TIMEOUT_S:
            pytest.skip(f"the longest step took {seen:.2f} s here: too short to tell a busy rank from a hung one")
        assert "past --step-timeout-s" in server.log and "still answers its heartbeat" in server.log


@pytest.mark.slow
def test_an_init_to_a_dead_port_is_a_502_not_a_dead_pool(server: Sidecar) -> None:
    info = {"backend": "gloo", "master_host": "127.0.0.1", "master_port": free_port(), "world_size": 2,
            "bucket_bytes": 1 << 20, "timeout_s": MAX_WIRE_TIMEOUT_S, "session_id": "nobody-listens"}
    with SidecarClient(server.url, timeout=120) as c:
        t0 = time.monotonic()
        with pytest.raises(SidecarTransferError):
            c.init_weights(info)
        took = time.monotonic() - t0
        assert took > MAX_WIRE_TIMEOUT_S, f"{took:.1f} s: the join did not wait its own timeout"
        assert c.health()["status"] == "ok"
        assert len(c.generate(["still serving"], SamplingParams(temperature=0.0, max_tokens=2))[0].outputs) == 1


def test_a_dead_rank_shows_as_dead_not_as_its_last_report(server: Sidecar) -> None:
    with SidecarClient(server.url, timeout=60) as c:
        state = c.state()
        assert state["ranks"][0]["ready"] is True
        os.kill(int(state["ranks"][0]["pid"]), signal.SIGKILL)
        deadline = time.monotonic() + 30
        while httpx.get(server.url + "/health", timeout=30).status_code != 503:
            assert time.monotonic() < deadline, "the dead rank was never noticed"
        rank = c.state()["ranks"][0]
        assert (rank["alive"], rank["ready"], rank["status"]) == (False, False, "dead")
        assert c.state()["ready"] is False


# ---- in-process: the driver's clocks, on a pool whose messages the test writes ----------------------
class _Pool:
    """One rank whose messages the test writes (`inbox`); the driver's sends land in `sent`."""

    size = 1
    plans = [SimpleNamespace(rank="dp0:pp0:tp0")]  # noqa: RUF012

    def __init__(self) -> None:
        self.sent: list[Any] = []
        self.inbox: queue.Queue[tuple[int, object]] = queue.Queue()

    def send(self, cmd: Any) -> None:
        self.sent.append(cmd)

    def receive(self, timeout: float, wake_fd: int | None = None) -> list[tuple[int, object]]:
        try:
            return [self.inbox.get(timeout=min(timeout, 0.01))]
        except queue.Empty:
            return []

    def timed_out(self, pending: list[int], what: str, timeout: float) -> RankFailure:
        return RankFailure(f"rank(s) {pending} did not answer {what} within {timeout:g} s", pending[0])

    def dead_rank(self) -> None:
        return None

    def alive(self) -> list[bool]:
        return [True]


def test_a_command_behind_a_long_step_is_timed_from_when_the_rank_takes_it() -> None:
    """A control command queued behind a step that outlasts the command's own timeout is not failed while
    the rank beats (it has not taken it); once taken and answered it succeeds; a rank silent past the
    step timeout while work is owed is hung."""
    pool = _Pool()
    driver = Driver(pool, step_timeout_s=0.5, rpc_timeout_s=0.3)  # type: ignore[arg-type]
    driver.start()
    try:
        fut = driver.call(Sleep(1))
        deadline = time.monotonic() + 10
        while not pool.sent:
            assert time.monotonic() < deadline, "the driver never sent the command"
        t0 = time.monotonic()
        while time.monotonic() - t0 < 1.0:  # a step of 1 s: three of the command's timeouts
            pool.inbox.put((0, Heartbeat(0, 1, "step", time.monotonic() - t0)))
            assert not fut.done(), fut.exception()
            threading.Event().wait(0.1)  # the rank's beat interval, not synchronisation
        pool.inbox.put((0, Heartbeat(1, 1, "Sleep", 0.0)))  # it took the command
        pool.inbox.put((0, Reply(True, None)))
        assert fut.result(10) == [None] and driver.failure is None
        hung = driver.submit([([1, 2, 3], SamplingParams(max_tokens=2))])  # owed, and nobody answers
        with pytest.raises(RankError) as e:
            hung.result(10)
        assert e.value.info.kind == "unavailable" and "its heartbeat within 0.5 s" in str(e.value)
    finally:
        driver.stop()
