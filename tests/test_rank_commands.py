"""The declared rank commands (sidecar/ranks/commands.py) through the rank server's table, in this process
(the tiny model on CPU, a Pipe instead of a spawned rank): every declared command has its handler,
an undeclared one is refused with UnknownCommandError naming it (on the rank and before sending),
and the commands do what the HTTP endpoints rely on."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from types import SimpleNamespace
from typing import Any

import pytest

from checksum import Manifest
from inference.core import SamplingParams
from inference.engine.llm import LLM
from inference.memory.sleep import TransitionStats
from sidecar.ranks.commands import (
    COMMANDS,
    CONTROL_COMMANDS,
    AddRequests,
    Command,
    ErrorInfo,
    Events,
    Heartbeat,
    RankStatus,
    ReadManifest,
    Reply,
    RequestGroup,
    SetPaused,
    Sleep,
    Stop,
    UnknownCommandError,
    UpdateWeights,
    WakeUp,
    WeightStart,
    check_declared,
)
from sidecar.ranks.driver import Driver, RankError
from sidecar.ranks.server import RankServer
from tests.helpers_sidecar import KV_BYTES

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
RANK = "dp0:pp0:tp0"


@dataclass(frozen=True)
class Reboot(Command):
    """Not declared: no rank may run it."""

    force: bool = True


@dataclass(frozen=True)
class DeepSleep(Sleep):
    """A subclass of a declared command is not declared either (dispatch is by exact type)."""


@pytest.fixture(scope="module")
def server() -> Iterator[RankServer]:
    mine, theirs = Pipe()
    server = RankServer(LLM(device="cpu", kv_cache_bytes=KV_BYTES), theirs, 0)
    yield server
    server.shutdown()
    mine.close()
    theirs.close()


def _ok(reply: Reply) -> object:
    assert reply.ok, reply.error
    return reply.value


def test_the_table_handles_every_control_command_and_nothing_else(server: RankServer) -> None:
    assert set(server.handlers) == set(CONTROL_COMMANDS)  # the queue commands are the loop's own
    assert all(issubclass(c, Command) for c in COMMANDS)


@pytest.mark.parametrize("cmd", [Reboot(), DeepSleep(2), ("call", ("sleep", (1,), {})), "sleep"],
                         ids=["undeclared", "subclass", "legacy-tuple", "method-name"])
def test_an_undeclared_command_is_refused_naming_it(server: RankServer, cmd: object) -> None:
    reply = server.handle(cmd)
    assert not reply.ok and reply.error is not None
    assert (reply.error.type, reply.error.kind, reply.error.rank) == ("UnknownCommandError", "internal", RANK)
    assert f"{type(cmd).__name__!r} is not a declared rank command" in reply.error.message
    assert "Sleep" in reply.error.message  # it lists what is declared
    assert reply.status is not None and reply.status.sleeping is False  # nothing ran


def test_the_serve_loop_refuses_over_the_pipe_and_stops_on_stop() -> None:
    mine, theirs = Pipe()
    server = RankServer(LLM(device="cpu", kv_cache_bytes=KV_BYTES), theirs, 0)
    loop = threading.Thread(target=server.serve, daemon=True)
    loop.start()
    try:
        mine.send(Reboot())
        reply = _next(mine, Reply)
        assert not reply.ok and reply.error is not None and "'Reboot'" in reply.error.message
        mine.send(ReadManifest("target", "held"))
        assert _next(mine, Reply).value.rank == RANK  # still serving
        _next(mine, Events)  # the boundary's report: nothing runs
        mine.send(Stop())
        loop.join(30)
        assert not loop.is_alive() and not mine.poll(0.2)  # Stop sends no reply
    finally:
        server.shutdown()
        mine.close()
        theirs.close()


def test_the_driver_refuses_undeclared_commands_before_sending() -> None:
    driver = Driver(SimpleNamespace(size=1), step_timeout_s=1.0, rpc_timeout_s=1.0)  # type: ignore[arg-type]
    for cmd in (Reboot(), DeepSleep(), AddRequests(RequestGroup("g0", (), "sync")), SetPaused(True), Stop()):
        with pytest.raises(UnknownCommandError) as e:
            driver.call(cmd)
        assert e.value.command == type(cmd).__name__ and type(cmd).__name__ in str(e.value)
    assert not driver._controls  # nothing was queued
    check_declared(Sleep())
    with pytest.raises(UnknownCommandError, match="'tuple'"):
        check_declared(("step", {}))


def _next(conn: Connection, kind: type) -> Any:
    """The next message of `kind` from the rank (Events in between are skipped when a Reply is awaited)."""
    while True:
        assert conn.poll(60), f"no {kind.__name__} within 60 s"
        message = conn.recv()
        if isinstance(message, kind):
            return message
        assert isinstance(message, (Events, Heartbeat)), message


@pytest.fixture
def loop() -> Iterator[tuple[Connection, RankServer]]:
    """A rank server running its engine loop on a thread; the test holds the sidecar's end of the pipe."""
    mine, theirs = Pipe()
    server = RankServer(LLM(device="cpu", kv_cache_bytes=KV_BYTES), theirs, 0)
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    try:
        yield mine, server
    finally:
        mine.send(Stop())
        thread.join(30)
        server.shutdown()
        mine.close()
        theirs.close()


def _outputs(conn: Connection, request_ids: set[str], replies: list[Reply] | None = None) -> dict[str, Any]:
    """Read the rank's reports until every request of `request_ids` finished (Replies kept in `replies`)."""
    finished: dict[str, Any] = {}
    while not request_ids <= set(finished):
        assert conn.poll(60), f"still waiting for {sorted(request_ids - set(finished))}"
        message = conn.recv()
        if isinstance(message, Heartbeat):  # a sign of life while it steps
            continue
        if isinstance(message, Reply):
            assert replies is not None, message
            replies.append(message)
            finished.update((o.request_id, o) for o in message.finished)
            continue
        assert isinstance(message, Events) and message.failed is None and not message.rejected, message
        finished.update((o.request_id, o) for o in message.finished)
    return finished


@pytest.mark.slow
def test_the_rank_steps_on_its_own_and_generates_what_the_engine_generates(loop: tuple) -> None:
    """One AddRequests and nothing else: the rank steps until done and reports the outputs, equal to
    the in-process engine's, then says it stopped stepping."""
    conn, _ = loop
    prompts = [[5, 17, 42, 99], "The river ran slowly"]
    want = [o.outputs[0].token_ids for o in LLM(device="cpu", kv_cache_bytes=KV_BYTES).generate(prompts, GREEDY)]
    conn.send(AddRequests(RequestGroup("g0", tuple((f"g0-{i}", p, GREEDY) for i, p in enumerate(prompts)), "sync")))
    finished = _outputs(conn, {"g0-0", "g0-1"})
    assert [finished[f"g0-{i}"].outputs[0].token_ids for i in range(len(prompts))] == want
    events = _next(conn, Events) if conn.poll(5) else None
    while events is not None and events.stepping:  # the report that ends the steps
        events = _next(conn, Events)
    if events is not None:
        assert events.applied == 1 and events.status.unfinished == 0
    assert not conn.poll(0.3)  # idle: nothing more to say


@pytest.mark.slow
def test_control_commands_run_between_steps_and_change_no_output(loop: tuple) -> None:
    """A ReadManifest sent while the rank steps is answered between two steps; the generation goes on
    to the same tokens as without it."""
    conn, _ = loop
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want = LLM(device="cpu", kv_cache_bytes=KV_BYTES).generate([[3, 1, 4, 1, 5]], long)[0].outputs[0].token_ids
    conn.send(AddRequests(RequestGroup("g0", (("g0-0", [3, 1, 4, 1, 5], long),), "sync")))
    conn.send(ReadManifest("target", "held"))
    replies: list[Reply] = []
    finished = _outputs(conn, {"g0-0"}, replies)
    assert finished["g0-0"].outputs[0].token_ids == want
    assert len(replies) == 1 and replies[0].ok and isinstance(replies[0].value, Manifest)


def test_a_paused_rank_holds_its_requests_until_resumed(loop: tuple) -> None:
    conn, _ = loop
    conn.send(SetPaused(True))
    conn.send(AddRequests(RequestGroup("g0", (("g0-0", [7, 8, 9], GREEDY),), "sync")))
    events = _next(conn, Events)
    while events.applied < 2:
        events = _next(conn, Events)
    assert not events.stepping and events.status.unfinished == 1 and not events.finished
    assert not conn.poll(0.3)  # paused: no step, nothing to report
    conn.send(SetPaused(False))
    assert len(_outputs(conn, {"g0-0"})["g0-0"].outputs[0].token_ids) == GREEDY.max_tokens


def test_a_bad_prompt_rejects_its_whole_group(loop: tuple) -> None:
    conn, _ = loop
    conn.send(AddRequests(RequestGroup("g1", (("g1-0", [1, 2], GREEDY), ("g1-1", [10**9], GREEDY)), "sync")))
    events = _next(conn, Events)
    assert set(events.rejected) == {"g1"}
    assert (events.rejected["g1"].index, events.rejected["g1"].kind) == (1, "invalid")
    assert events.status.unfinished == 0 and not events.stepping  # the good prompt was taken back too


def test_sleep_wake_and_manifests_through_the_table(server: RankServer) -> None:
    held = _ok(server.handle(ReadManifest("target", "held")))
    assert isinstance(held, Manifest) and held.rank == RANK and held.records and not held.torn
    stats = server.handle(Sleep(1, "finish"))
    assert isinstance(_ok(stats), TransitionStats) and stats.status is not None
    assert stats.value.op == "sleep" and stats.status.sleeping is True
    assert stats.status.arenas == {"weights": "asleep_mirrored", "kv_cache": "asleep_empty"}
    woken = server.handle(WakeUp(("weights", "kv_cache")))
    assert isinstance(_ok(woken), TransitionStats) and woken.value.op == "wake"
    assert woken.status is not None and woken.status.sleeping is False
    assert _ok(server.handle(ReadManifest("target", "held"))) == held  # level 1 kept every byte

    none_yet = server.handle(ReadManifest("target", "received"))
    assert not none_yet.ok and none_yet.error is not None and none_yet.error.kind == "state"
    alone = server.handle(WeightStart("target", 1, []))  # type: ignore[arg-type]
    assert not alone.ok and alone.error is not None and "WeightStart" in alone.error.message  # never alone


def test_an_update_carrying_a_start_answers_the_starts_error_and_opens_nothing(server: RankServer) -> None:
    """UpdateWeights(start=...) runs the start first; when it fails, that is the reply (no transfer group
    here, so there is no sender's agreement to refuse), and no session is left open."""
    weights = server.llm.worker.weights
    bad = server.handle(UpdateWeights(start=WeightStart("main", 1, [])))  # type: ignore[arg-type]
    assert not bad.ok and bad.error is not None and (bad.error.kind, bad.error.field) == ("invalid", "model")
    no_group = server.handle(UpdateWeights(start=WeightStart("target", 1, {"version": 1, "tensors": []})))
    assert not no_group.ok and no_group.error is not None and no_group.error.kind == "state"
    assert "init_weight_transfer_engine" in no_group.error.message
    assert weights.refuse_update() is False  # nothing to refuse on without a group
    assert not weights.state("target")["session_open"]


# ---- the driver's side of a failed step (a scripted pool of two ranks) ------------------------------
STATUS = RankStatus(RANK, 1, True, False, {}, {"target": 0}, {"target": False}, {"target": True}, 0, 0)


class ScriptedPool:
    """Two ranks whose messages the test writes (`inbox`); what the driver sends lands in `sent`."""

    size = 2
    plans = [SimpleNamespace(rank="dp0:pp0:tp0"), SimpleNamespace(rank="dp0:pp0:tp1")]  # noqa: RUF012

    def __init__(self) -> None:
        self.sent: list[Command] = []
        self.inbox: queue.Queue[tuple[int, object]] = queue.Queue()

    def send(self, cmd: Command) -> None:
        self.sent.append(cmd)

    def receive(self, timeout: float, wake_fd: int | None = None) -> list[tuple[int, object]]:
        try:
            messages = [self.inbox.get(timeout=min(timeout, 0.01))]
        except queue.Empty:
            return []
        while not self.inbox.empty():
            messages.append(self.inbox.get_nowait())
        return messages

    def dead_rank(self) -> None:
        return None

    def alive(self) -> list[bool]:
        return [True, True]


def _failed_step(steps: int, dropped: tuple[str, ...]) -> Events:
    why = ErrorInfo("StateError", "scheduler made no progress", "state", None, RANK)
    return Events(1, False, steps, STATUS, failed=why, dropped=dropped)


@pytest.fixture
def scripted() -> Iterator[tuple[Driver, ScriptedPool]]:
    pool = ScriptedPool()
    driver = Driver(pool, step_timeout_s=30.0, rpc_timeout_s=30.0)  # type: ignore[arg-type]
    driver.start()
    yield driver, pool
    driver.stop()


def _submitted(driver: Driver, pool: ScriptedPool) -> Future:
    fut = driver.submit([([1, 2, 3], GREEDY)])
    deadline = time.monotonic() + 10
    while not pool.sent:
        assert time.monotonic() < deadline, "the driver never sent the request"
        time.sleep(0.01)
    assert isinstance(pool.sent[0], AddRequests) and pool.sent[0].group.group_id == "g0"
    return fut


@pytest.mark.parametrize("rank_0_first", [True, False])
def test_a_step_that_failed_on_every_rank_fails_its_requests_and_the_ranks_serve_on(
        scripted: tuple[Driver, ScriptedPool], rank_0_first: bool) -> None:
    driver, pool = scripted
    fut = _submitted(driver, pool)
    reports = [(0, _failed_step(3, ("g0-0",))), (1, _failed_step(3, ("g0-0",)))]
    for report in reports if rank_0_first else reports[::-1]:
        pool.inbox.put(report)
    with pytest.raises(RankError) as e:
        fut.result(10)
    assert e.value.info.kind == "state" and "no progress" in str(e.value)
    time.sleep(0.1)
    assert driver.failure is None and driver.queued_sequences() == 0


def test_a_step_that_failed_on_another_rank_only_breaks_the_pool_naming_it(
        scripted: tuple[Driver, ScriptedPool]) -> None:
    driver, pool = scripted
    fut = _submitted(driver, pool)
    pool.inbox.put((1, _failed_step(5, ("g0-0",))))
    time.sleep(0.1)
    assert driver.failure is None  # rank 0 has not reported step 5 yet
    pool.inbox.put((0, Events(1, True, 5, STATUS)))  # rank 0 ran step 5 and steps on
    with pytest.raises(RankError) as e:
        fut.result(10)
    assert e.value.info.kind == "unavailable" and e.value.info.rank == "dp0:pp0:tp1"
    assert "rank 1 failed step 5" in str(e.value) and "rank 0 did not" in str(e.value)
    assert driver.failure_rank == "dp0:pp0:tp1"
