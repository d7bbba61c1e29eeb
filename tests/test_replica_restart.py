"""Replicas as operators run them, real processes: a `sidecar launch --dp-rank 1` (any fleet replica but
dp0, any torchrun or Slurm launch) synced by a plain WeightSyncHook(SidecarClient(url)), and `sidecar
fleet --port 0` printing a restart command that brings a dead replica back on the port it served."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from inference.core import SamplingParams
from inference.models.tiny import default_model_dir
from tests.helpers_sidecar import KV_BYTES, REPO, launch, pid_exists
from trainer_hooks import WeightSyncHook
from trainer_hooks.client import SidecarClient
from trainer_hooks.toy_policy import ToyPolicy


@pytest.mark.slow
def test_a_replica_with_a_dp_rank_is_synced_by_a_plain_client() -> None:
    server = launch("--dp-rank", "1")
    try:
        policy = ToyPolicy.from_dir(default_model_dir())
        with torch.no_grad():
            for p in policy.parameters():
                p.mul_(1.01)
        with WeightSyncHook(SidecarClient(server.url, timeout=60), policy) as hook:
            report = hook.sync()
            assert report["ok"] and report["ranks"] == ["dp1:pp0:tp0"], report
            outs = hook.rollouts([[11, 12, 13]], SamplingParams(max_tokens=3, temperature=0.0))
            assert outs[0].weight_version == hook.version == 1
    finally:
        assert server.stop() == 0, server.log


@pytest.mark.slow
def test_fleet_port_0_prints_a_restart_on_the_served_port() -> None:
    fd, name = tempfile.mkstemp(prefix="sidecar-fleet-", suffix=".log")
    log = Path(name)
    cmd = [sys.executable, "-m", "sidecar.cli.main", "fleet", "--replicas", "2", "--port", "0", "--device", "cpu",
           "--", "--kv-cache-bytes", str(KV_BYTES), "--log-level", "warning"]
    with os.fdopen(fd, "w") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        assert proc.stdout is not None
        replicas = {}
        for line in proc.stdout:
            match = re.match(r"replica dp(\d+): (http://\S+) \(pid (\d+)", line)
            if match:
                replicas[int(match.group(1))] = (match.group(2), int(match.group(3)))
            if line.startswith("Sidecar fleet serving on"):
                break
        url, pid = replicas[1]
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while "Restart it with:" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        restart = next(x for x in log.read_text().splitlines() if "Restart it with:" in x)
        port = url.rsplit(":", 1)[1]
        assert re.search(rf"--port {port}\b", restart) and "--dp-rank 1" in restart, restart
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(90)
        text = log.read_text(errors="replace")
        log.unlink()
    assert code == 0, text
    assert not pid_exists(replicas[0][1])
