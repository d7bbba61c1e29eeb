"""The declared rank commands (sidecar/ranks/commands.py) through the rank server's table, in this process
(the tiny model on CPU, a Pipe instead of a spawned rank): every declared command has its handler,
an undeclared one is refused with UnknownCommandError naming it (on the rank and before sending),
and the commands do what the HTTP endpoints rely on."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing import Pipe
from types import SimpleNamespace

import pytest

from checksum import Manifest
from inference.core import SamplingParams
from inference.engine.llm import LLM
from inference.memory.sleep import TransitionStats
from sidecar.ranks.commands import (
    COMMANDS,
    Command,
    ReadManifest,
    Rejections,
    Reply,
    RequestGroup,
    Sleep,
    StartWeightUpdate,
    Step,
    Stop,
    UnknownCommandError,
    UpdateWeights,
    WakeUp,
    check_declared,
)
from sidecar.ranks.driver import Driver
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


def test_the_table_handles_every_declared_command_and_nothing_else(server: RankServer) -> None:
    assert set(server.handlers) == set(COMMANDS) - {Stop}  # Stop ends the loop itself
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
        assert mine.poll(60)
        reply = mine.recv()
        assert not reply.ok and "'Reboot'" in reply.error.message
        mine.send(ReadManifest("target", "held"))
        assert mine.poll(60) and mine.recv().value.rank == RANK  # still serving
        mine.send(Stop())
        loop.join(30)
        assert not loop.is_alive() and not mine.poll(0.2)  # Stop sends no reply
    finally:
        server.shutdown()
        mine.close()
        theirs.close()


def test_the_driver_refuses_undeclared_commands_before_sending() -> None:
    driver = Driver(SimpleNamespace(size=1), step_timeout_s=1.0, rpc_timeout_s=1.0)  # type: ignore[arg-type]
    for cmd in (Reboot(), DeepSleep(), Step(), Stop()):
        with pytest.raises(UnknownCommandError) as e:
            driver.call(cmd)
        assert e.value.command == type(cmd).__name__ and type(cmd).__name__ in str(e.value)
    assert not driver._controls  # nothing was queued
    check_declared(Sleep())
    with pytest.raises(UnknownCommandError, match="'tuple'"):
        check_declared(("step", {}))


def test_step_generates_what_the_engine_generates(server: RankServer) -> None:
    prompts = [[5, 17, 42, 99], "The river ran slowly"]
    want = [o.outputs[0].token_ids for o in LLM(device="cpu", kv_cache_bytes=KV_BYTES).generate(prompts, GREEDY)]
    group = RequestGroup("g0", tuple((f"g0-{i}", p, GREEDY) for i, p in enumerate(prompts)), True)
    reply = server.handle(Step(groups=(group,), run=True))
    assert _ok(reply) == Rejections({})
    finished = {o.request_id: o for o in reply.finished}
    for _ in range(50):
        if len(finished) == len(prompts):
            break
        reply = server.handle(Step(run=True))
        finished.update((o.request_id, o) for o in reply.finished)
    assert [finished[f"g0-{i}"].outputs[0].token_ids for i in range(len(prompts))] == want
    assert reply.status is not None and reply.status.unfinished == 0


def test_a_bad_prompt_rejects_its_whole_group(server: RankServer) -> None:
    group = RequestGroup("g1", (("g1-0", [1, 2], GREEDY), ("g1-1", [10**9], GREEDY)), True)
    reply = server.handle(Step(groups=(group,), run=False))
    result = _ok(reply)
    assert isinstance(result, Rejections) and set(result.rejected) == {"g1"}
    assert (result.rejected["g1"].index, result.rejected["g1"].kind) == (1, "invalid")
    assert reply.status is not None and reply.status.unfinished == 0  # the good prompt was taken back too


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
    bad = server.handle(StartWeightUpdate("main", 1, []))  # type: ignore[arg-type]
    assert not bad.ok and bad.error is not None and (bad.error.kind, bad.error.field) == ("invalid", "model")


def test_an_update_carrying_a_start_answers_the_starts_error_and_opens_nothing(server: RankServer) -> None:
    """UpdateWeights(start=...) runs the start first; when it fails, that is the reply (no transfer group
    here, so there is no sender's agreement to refuse), and no session is left open."""
    weights = server.llm.worker.weights
    bad = server.handle(UpdateWeights(start=StartWeightUpdate("main", 1, [])))  # type: ignore[arg-type]
    assert not bad.ok and bad.error is not None and (bad.error.kind, bad.error.field) == ("invalid", "model")
    no_group = server.handle(UpdateWeights(start=StartWeightUpdate("target", 1, {"version": 1, "tensors": []})))
    assert not no_group.ok and no_group.error is not None and no_group.error.kind == "state"
    assert "init_weight_transfer_engine" in no_group.error.message
    assert weights.refuse_update() is False  # nothing to refuse on without a group
    assert not weights.state("target")["session_open"]
