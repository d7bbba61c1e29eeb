"""The overlapped audit: update_weights starts digesting what it received on a side thread, so that
digest runs while the trainer digests its own copy. Whatever could release or rewrite the weights
(sleep, abort, a failed finish) waits for it first, and finish audits the bytes held at finish time.
CPU, gloo; the digest is held at a gate so every interleaving is deterministic.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import inference.transfer.digests as sync_digests
from checksum import ChecksumMismatch
from inference.core import StateError
from inference.memory.arenas import ArenaState
from inference.models.tiny import make_tiny_model
from tests.helpers_weight_update import DIMS, Link, make_worker, perturbed

BLOCKED_S = 0.3  # how long a waiter is watched while the gate is closed


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {"target": make_tiny_model(tmp_path_factory.mktemp("wuo") / "target", "qwen2", **DIMS)}


class Gate:
    """Holds every digest taken on the side thread until opened; records that one started there."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.opened = threading.Event()
        self.threads: list[str] = []

    def wrap(self, digest: Any) -> Any:
        def gated(items: Any, **kwargs: Any) -> Any:
            name = threading.current_thread().name
            if name.startswith("received-digest"):
                self.threads.append(name)
                self.entered.set()
                assert self.opened.wait(30), "the gate was never opened"
            return digest(items, **kwargs)
        return gated


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    g = Gate()
    monkeypatch.setattr(sync_digests, "digest_tensors", g.wrap(sync_digests.digest_tensors))
    yield g
    g.opened.set()  # never leave a side thread parked behind a failed test


def in_thread(fn: Any) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = fn()
        except BaseException as e:  # handed to the test, which re-raises or checks it
            out["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def received(worker: Any, link: Link, state: dict, version: int) -> Any:
    """start + update_weights (+ send); returns the sender's digests with the side digest running."""
    worker.weights.start("target", version, link.sender.manifest(state, version))
    return link.transfer(state)


def test_finish_waits_for_the_side_digest_and_passes(dirs: dict[str, Path], gate: Gate) -> None:
    worker = make_worker(dirs, draft=False)
    link = Link(worker)
    digests = received(worker, link, perturbed(dirs["target"], 1), 1)
    assert gate.entered.wait(10), "update_weights did not start the received digest"
    finishing, out = in_thread(lambda: worker.weights.finish(digests))
    finishing.join(BLOCKED_S)
    assert finishing.is_alive(), "finish must wait for the digest it audits"
    gate.opened.set()
    finishing.join(30)
    assert out["result"].report.ok and worker.weights.is_servable("target")
    assert gate.threads == ["received-digest_0"]


def test_sleep_while_the_digest_runs_waits_and_finish_audits_what_is_held(dirs: dict[str, Path],
                                                                          gate: Gate) -> None:
    worker = make_worker(dirs, draft=False)
    link = Link(worker)
    state = perturbed(dirs["target"], 2)
    digests = received(worker, link, state, 1)
    assert gate.entered.wait(10)
    sleeping, out = in_thread(lambda: worker.sleep(1))
    sleeping.join(BLOCKED_S)
    assert sleeping.is_alive(), "sleep released the weights while the digest read them"
    assert worker.memory.state("weights") is ArenaState.AWAKE
    gate.opened.set()
    sleeping.join(30)
    assert "error" not in out
    # The bytes of an unaudited update are not mirrored, so the sleep dropped them: the digest
    # taken before it must not vouch for them.
    with pytest.raises(StateError, match="put to sleep"):
        worker.weights.finish(digests)
    assert worker.weights.torn["target"]
    worker.wake_up()
    assert link.sync(state, 2).report.ok and worker.weights.is_servable("target")


def test_a_digest_dropped_by_sleep_is_taken_again_from_the_held_bytes(dirs: dict[str, Path],
                                                                      gate: Gate) -> None:
    worker = make_worker(dirs, draft=False)
    link = Link(worker)
    digests = received(worker, link, perturbed(dirs["target"], 3), 1)
    gate.opened.set()
    worker.sleep(1)
    worker.wake_up()  # the weights come back poisoned: nothing mirrored them
    with pytest.raises(ChecksumMismatch):
        worker.weights.finish(digests)
    assert worker.weights.torn["target"] and not worker.weights.is_servable("target")


def test_abort_waits_for_the_side_digest(dirs: dict[str, Path], gate: Gate) -> None:
    worker = make_worker(dirs, draft=False)
    link = Link(worker)
    state = perturbed(dirs["target"], 4)
    received(worker, link, state, 1)
    assert gate.entered.wait(10)
    aborting, out = in_thread(lambda: worker.weights.abort("the trainer gave up"))
    aborting.join(BLOCKED_S)
    assert aborting.is_alive(), "the session ended while its digest still read the model"
    gate.opened.set()
    aborting.join(30)
    assert "error" not in out and worker.weights.torn["target"]
    worker.weights.reset("target")  # nothing reads the model any more
    assert link.sync(state, 2).report.ok


def test_a_failed_finish_waits_for_the_side_digest(dirs: dict[str, Path], gate: Gate) -> None:
    worker = make_worker(dirs, draft=False)
    link = Link(worker)
    received(worker, link, perturbed(dirs["target"], 5), 1)
    assert gate.entered.wait(10)
    finishing, out = in_thread(lambda: worker.weights.finish({"tensors": "not a list"}))
    finishing.join(BLOCKED_S)
    assert finishing.is_alive()
    gate.opened.set()
    finishing.join(30)
    assert type(out["error"]).__name__ == "InvalidRequestError" and worker.weights.torn["target"]


def test_the_received_digest_starts_before_the_status_step(dirs: dict[str, Path], gate: Gate,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The backend tells the sink its bytes landed before the ranks report, so the received digest runs
    while they do (and while the trainer collects its own), not after update_weights returns."""
    from inference.transfer.groups import TransferGroup

    worker = make_worker(dirs, draft=False)
    link = Link(worker)
    seen: list[bool] = []
    all_max = TransferGroup.all_max

    def watched(self: TransferGroup, values: Any, what: str) -> Any:
        if self.rank != 0 and what == "end-of-sync status":
            session = worker.weights._session
            seen.append(session is not None and session.held_digests is not None)
        return all_max(self, values, what)

    monkeypatch.setattr(TransferGroup, "all_max", watched)
    digests = received(worker, link, perturbed(dirs["target"], 1), 1)
    assert seen == [True]
    gate.opened.set()
    assert worker.weights.finish(digests).report.ok
