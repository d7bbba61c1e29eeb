"""A fleet of three real sidecar processes (TP 2, 1, 1) started by `sidecar fleet`, driven by one
WeightSyncHook over gloo: one sync reaches every rank (the audit lists them all) and every replica's greedy
output equals transformers' on the new weights; a replica killed between syncs is taken out, its
in-flight requests finish on the others, and it is re-admitted after it is restarted and synced; a
flipped byte on one replica fails only that replica; `sidecar status` shows the fleet; stopping `sidecar
fleet` stops every replica it started. The rules alone, against fake replicas: tests/test_fleet.py."""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from inference.core import SamplingParams
from inference.models.tiny import TinyModelSpec, default_model_dir, random_weights
from sidecar.cli.main import main
from tests.helpers_fault import flip_env
from tests.helpers_sidecar import KV_BYTES, REPO, Sidecar, launch, pid_exists
from trainer_hooks import Fleet, WeightSyncHook

pytestmark = pytest.mark.slow  # every test here starts real processes or runs for seconds

transformers = pytest.importorskip("transformers")

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [[11, 12, 13, 14, 15], [21, 22, 23], [5, 6, 7, 8, 9, 10], [31, 32, 33, 34], [40, 41], [50, 51, 52]]
ALL_RANKS = ["dp0:pp0:tp0", "dp0:pp0:tp1", "dp1:pp0:tp0", "dp2:pp0:tp0"]
# every replica holds requests that arrive while it sleeps (the killed replica's stay in flight)
REPLICA_FLAGS = ("--kv-cache-bytes", str(KV_BYTES), "--log-level", "warning", "--hold-while-asleep")
FLIPPED = "model.layers.1.mlp.down_proj.weight"


@dataclass
class FleetProcess:
    """`sidecar fleet` and what it printed; `restarted` replicas the tests started again by hand."""

    proc: subprocess.Popen
    urls: list[str]
    pids: list[int]
    log_path: Path
    restarted: dict[int, Sidecar] = field(default_factory=dict)

    def kill_replica(self, i: int) -> None:
        """SIGKILL replica i, wherever it runs now (the fleet's child, or a restart of ours)."""
        if i in self.restarted:
            server = self.restarted.pop(i)
            server.proc.kill()
            server.proc.wait(30)
        else:
            os.kill(self.pids[i], signal.SIGKILL)
            _wait_for(lambda: not pid_exists(self.pids[i]), f"replica dp{i} to exit")
        _wait_for(lambda: _refused(self.urls[i]), f"{self.urls[i]} to refuse connections")

    def restart_replica(self, i: int, env: dict[str, str] | None = None) -> None:
        port = self.urls[i].rsplit(":", 1)[1]
        server = launch("--dp-rank", str(i), "--port", port, *REPLICA_FLAGS, env=env)
        assert server.url == self.urls[i]
        self.restarted[i] = server


@pytest.fixture(scope="module")
def fleet_process() -> Iterator[FleetProcess]:
    fd, name = tempfile.mkstemp(prefix="sidecar-fleet-", suffix=".log")
    cmd = [sys.executable, "-m", "sidecar.cli.main", "fleet", "--replicas", "3", "--tp", "2,1,1", "--port", "0",
           "--device", "cpu", "--", *REPLICA_FLAGS]
    with os.fdopen(fd, "w") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True)
    log = Path(name)
    try:
        urls, pids = _read_serving(proc, log)
        running = FleetProcess(proc, urls, pids, log)
        yield running
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        code = proc.wait(90)
        for server in running.restarted.values() if "running" in locals() else ():
            server.stop()
        text = log.read_text(errors="replace")
        log.unlink()
    assert code == 0, text
    assert not any(pid_exists(p) for p in pids), "sidecar fleet left a replica running"
    assert all(_refused(u) for u in urls)


def _read_serving(proc: subprocess.Popen, log: Path) -> tuple[list[str], list[int]]:
    assert proc.stdout is not None
    replicas = []
    for line in proc.stdout:
        match = re.match(r"replica dp(\d+): (http://\S+) \(pid (\d+), tp (\d+)\)", line)
        if match:
            replicas.append((match.group(2), int(match.group(3))))
        served = re.match(r"Sidecar fleet serving on (.+)", line)
        if served:
            assert served.group(1).split() == [u for u, _ in replicas]
            return [u for u, _ in replicas], [p for _, p in replicas]
    raise AssertionError(f"sidecar fleet exited with {proc.wait(30)} before serving:\n{log.read_text()}")


@pytest.fixture(scope="module")
def fleet(fleet_process: FleetProcess) -> Iterator[Fleet]:
    with Fleet(fleet_process.urls, timeout=60) as f:
        yield f


@pytest.fixture(scope="module")
def trainer() -> nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(default_model_dir()).eval()


def _new_weights(trainer: nn.Module, seed: int) -> list[list[int]]:
    """Load the seed's random weights into the trainer; transformers' greedy tokens for PROMPTS on them."""
    new = random_weights(TinyModelSpec(seed=seed))
    with torch.no_grad():
        for name, p in trainer.named_parameters():
            p.copy_(new[name])
    return [_greedy(trainer, p, GREEDY.max_tokens or 0) for p in PROMPTS]


def _greedy(model: nn.Module, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt):].tolist()


def _sync(hook: WeightSyncHook) -> dict[str, Any]:
    hook.sleep()
    report = hook.sync()
    assert report is not None
    return report


def _served(outs: list[Any]) -> tuple[list[list[int]], set[int], set[int]]:
    """(tokens per prompt, replicas that served, weight versions)."""
    return ([o.outputs[0].token_ids for o in outs], {int(o.metrics["replica"]) for o in outs},
            {o.weight_version for o in outs})


def _refused(url: str) -> bool:
    """Nothing listens there any more (a bind test would meet the killed server's TIME_WAIT sockets)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


def _wait_for(check: Any, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.slow
def test_one_sync_reaches_every_rank_and_every_replica_matches_transformers(
        fleet: Fleet, fleet_process: FleetProcess, trainer: nn.Module, capsys: pytest.CaptureFixture[str]) -> None:
    want = _new_weights(trainer, seed=11)
    with WeightSyncHook(fleet, trainer) as hook:
        report = _sync(hook)
        assert report["ok"] and report["ranks"] == ALL_RANKS and report["out_of_rotation"] == {}, report
        assert [r["ok"] for r in report["replicas"]] == [True] * 3
        tokens, replicas, versions = _served(hook.rollouts(PROMPTS, GREEDY))
    assert tokens == want and replicas == {0, 1, 2} and versions == {hook.version} == {fleet.version}
    assert main(["status", *fleet_process.urls]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert rows[0] == f"fleet of 3 replicas: 3 in rotation at version {hook.version}"
    assert [r.split()[:2] for r in rows[2:5]] == [["dp0", fleet_process.urls[0]], ["dp1", fleet_process.urls[1]],
                                                  ["dp2", fleet_process.urls[2]]]


@pytest.mark.slow
def test_a_killed_replica_is_taken_out_its_requests_finish_elsewhere_and_it_rejoins_after_a_restart(
        fleet: Fleet, fleet_process: FleetProcess, trainer: nn.Module, caplog: pytest.LogCaptureFixture) -> None:
    want = _new_weights(trainer, seed=12)
    with WeightSyncHook(fleet, trainer) as hook:
        _sync(hook)
        hook.wake()
        victim = fleet.replicas[2].client
        victim.sleep(1)  # its share of the next call is held there, in flight, until it dies
        with ThreadPoolExecutor(1) as pool:
            rollout = pool.submit(fleet.generate, PROMPTS, GREEDY)
            _wait_for(lambda: victim.state()["queued_sequences"] > 0, "requests held on dp2")
            fleet_process.kill_replica(2)
            outs = rollout.result(timeout=120)
        tokens, replicas, versions = _served(outs)
        assert tokens == want and replicas == {0, 1} and versions == {hook.version}
        retried = [o.metrics["retries"] for o in outs]
        assert retried.count(1) == 2 and set(retried) == {0, 1}  # dp2 held 2 of the 6 prompts
        assert fleet.in_rotation == [0, 1] and "died mid-request" in str(fleet.replicas[2].reason)

        want = _new_weights(trainer, seed=13)  # a sync dp2 misses
        with caplog.at_level(logging.WARNING, logger="trainer_hooks"):
            report = _sync(hook)
        assert report["ok"] and report["ranks"] == ALL_RANKS[:3] and list(report["out_of_rotation"]) == ["dp2"]
        assert "dp2" in caplog.text and "missed the sync" in caplog.text
        tokens, replicas, versions = _served(hook.rollouts(PROMPTS, GREEDY))
        assert tokens == want and replicas == {0, 1} and versions == {hook.version}

        fleet_process.restart_replica(2)  # its checkpoint's weights: not in rotation until a sync
        assert _served(fleet.generate(PROMPTS, GREEDY))[1] == {0, 1}
        want = _new_weights(trainer, seed=14)
        report = _sync(hook)
        assert report["ok"] and report["ranks"] == ALL_RANKS and report["out_of_rotation"] == {}, report
        tokens, replicas, versions = _served(hook.rollouts(PROMPTS, GREEDY))
        assert tokens == want and replicas == {0, 1, 2} and versions == {hook.version}


@pytest.mark.slow
def test_a_flipped_byte_on_one_replica_fails_only_that_replica(
        fleet: Fleet, fleet_process: FleetProcess, trainer: nn.Module, caplog: pytest.LogCaptureFixture) -> None:
    fleet_process.kill_replica(2)
    fleet_process.restart_replica(2, env=flip_env(FLIPPED))
    want = _new_weights(trainer, seed=15)
    with WeightSyncHook(fleet, trainer) as hook:
        with caplog.at_level(logging.WARNING, logger="trainer_hooks"):
            report = _sync(hook)
        assert report["ok"] and report["ranks"] == ALL_RANKS[:3], report
        assert [r["ok"] for r in report["replicas"]] == [True, True, False]
        why = report["out_of_rotation"]["dp2"]
        assert list(report["out_of_rotation"]) == ["dp2"] and "failed its audit" in why and FLIPPED in why
        assert "dp2:pp0:tp0" in why and "dp2" in caplog.text and FLIPPED in caplog.text
        assert fleet.in_rotation == [0, 1] and fleet.replicas[2].client.state()["torn"] == {"target": True}
        tokens, replicas, versions = _served(hook.rollouts(PROMPTS, GREEDY))
        assert tokens == want and replicas == {0, 1} and versions == {hook.version}
