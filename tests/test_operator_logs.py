"""Logs for operators, from real `sidecar launch` processes: one human line per start, one INFO line per
sync, sleep, wake and refused sync; `--log-format json` gives one JSON object a line with those as keys;
a stop after a gloo sync prints no third-party noise (Triton's nanobind leak report); `sidecar demo` says
what it starts before its first silent seconds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from inference.models.tiny import default_model_dir
from tests.helpers_sidecar import REPO, Sidecar, launch
from trainer_hooks import WeightSyncHook
from trainer_hooks.client import SidecarClient, SidecarRequestError
from trainer_hooks.toy_policy import ToyPolicy


def _session(server: Sidecar) -> str:
    """A sync, a sleep and a wake through the hook, then a sync the sidecar refuses; the stopped log."""
    try:
        client = SidecarClient(server.url, timeout=60)
        with WeightSyncHook(client, ToyPolicy.from_dir(default_model_dir())) as hook:
            hook.sync()
            hook.sleep()
            hook.wake()
        with WeightSyncHook(client, ToyPolicy.from_dir(default_model_dir()).to(torch.bfloat16)) as hook, \
                pytest.raises(SidecarRequestError):
            hook.sync()  # a float32 sidecar refuses bfloat16 without allow_cast
    finally:
        assert server.stop() == 0, server.log
    return server.log


@pytest.mark.slow
def test_text_logs_one_line_per_start_and_per_event_and_no_shutdown_noise() -> None:
    log = _session(launch("--log-level", "info"))
    lines = log.splitlines()
    info = [x for x in lines if " INFO " in x]
    starts = [x for x in info if "serving " in x and "ready in" in x]
    assert len(starts) == 1 and "float32, tp 1" in starts[0] and "KV cache" in starts[0], info
    assert info[0] is starts[0], f"INFO lines before the start line: {info[: info.index(starts[0])]}"
    assert "configuration:" not in log and len(starts[0]) < 400
    synced = [x for x in info if "synced target v1:" in x]
    assert len(synced) == 1 and "MiB in" in synced[0] and "audit ok" in synced[0], info
    assert any("slept at level 1" in x for x in info) and any("woke " in x for x in info)
    refused = [x for x in lines if "sync of target v2 refused (400" in x]
    assert len(refused) == 1 and "allow_cast=True" in refused[0]
    assert "nanobind" not in log and "leaked" not in log, log[-3000:]
    assert "did not stop" not in log


@pytest.mark.slow
def test_json_logs_are_one_object_a_line_with_the_events_as_keys() -> None:
    log = _session(launch("--log-level", "info", "--log-format", "json"))
    records = [json.loads(x) for x in log.splitlines() if x.strip()]  # every line is JSON
    events = {r.get("event"): r for r in records if r.get("event")}
    assert {"start", "sync", "sleep", "wake", "sync_refused"} <= set(events), records
    sync = events["sync"]
    assert sync["version"] == 1 and sync["bytes"] > 0 and sync["ms"] > 0 and sync["audit"] == "ok"
    assert events["sync_refused"]["status"] == 400 and events["start"]["process"] == "http"
    assert {r["process"] for r in records} >= {"http"}
    assert all({"time", "level", "logger", "message"} <= set(r) for r in records)


def test_demo_says_what_it_starts_before_its_silence() -> None:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    proc = subprocess.Popen([sys.executable, "-m", "sidecar.cli.main", "demo", "--steps", "1"], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": path})
    try:
        t0 = time.monotonic()
        assert proc.stderr is not None
        first = proc.stderr.readline()
        took = time.monotonic() - t0
    finally:
        proc.kill()
        proc.wait(30)
    assert first.startswith("sidecar demo: 1 RL step(s) on the tiny model: starting a sidecar") and took < 5, (
        first, took)


@pytest.mark.cuda
def test_a_gpu_sidecar_stops_without_third_party_noise() -> None:
    """On a GPU the ranks compile Triton kernels (digests, sampling): a stop after a sync prints nothing of
    Triton's (its nanobind leak report came from the frozen heap at interpreter teardown)."""
    server = launch("--log-level", "info", "--device", "cuda")
    try:
        policy = ToyPolicy.from_dir(default_model_dir()).to(torch.bfloat16)
        with WeightSyncHook(SidecarClient(server.url, timeout=120), policy, sender="gloo") as hook:
            hook.sync()
            hook.sleep()
            hook.wake()
    finally:
        assert server.stop() == 0, server.log
    assert "nanobind" not in server.log and "did not stop" not in server.log, server.log[-3000:]
