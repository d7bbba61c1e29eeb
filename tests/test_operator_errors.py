"""Errors that name their fix, against real `sidecar launch` processes: a bf16 trainer against the default
fp32 CPU sidecar, `sidecar status` with nothing listening, a wrong API key."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

from inference.models.tiny import default_model_dir
from tests.helpers_sidecar import REPO, Sidecar, launch
from tests.helpers_tp import free_port
from trainer_hooks import WeightSyncHook
from trainer_hooks.client import SidecarAuthError, SidecarClient, SidecarRequestError
from trainer_hooks.toy_policy import ToyPolicy

KEY = "k3y-for-tests"


@pytest.fixture(scope="module")
def server() -> Iterator[Sidecar]:
    proc = launch("--api-key", KEY)
    try:
        yield proc
    finally:
        proc.stop()


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return subprocess.run([sys.executable, "-m", "sidecar.cli.main", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": path, **(env or {})})


@pytest.mark.slow
def test_a_bf16_trainer_against_an_fp32_sidecar_is_told_both_fixes(server: Sidecar) -> None:
    trainer = ToyPolicy.from_dir(default_model_dir()).to(torch.bfloat16)
    client = SidecarClient(server.url, api_key=KEY, timeout=60)
    with WeightSyncHook(client, trainer) as hook, pytest.raises(SidecarRequestError) as e:
        hook.sync()
    assert e.value.status == 400
    assert "allow_cast=True" in str(e.value) and "WeightSyncHook(" in str(e.value)
    assert "sidecar launch --dtype bfloat16" in str(e.value)


@pytest.mark.slow
def test_a_wrong_api_key_names_where_the_key_goes(server: Sidecar) -> None:
    with SidecarClient(server.url, api_key="wrong", timeout=30) as client, pytest.raises(SidecarAuthError) as e:
        client.state()
    assert e.value.status == 401 and "--api-key" in str(e.value) and "SIDECAR_API_KEY" in str(e.value)
    done = _cli("status", server.url, env={"SIDECAR_API_KEY": "wrong"})
    assert done.returncode == 2 and "--api-key" in done.stderr and "Traceback" not in done.stderr


def test_status_against_a_dead_port_is_one_clear_line() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # a port nothing listens on
    done = _cli("status", url)
    assert done.returncode != 0 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"no sidecar answers at {url}" in lines[0] and "sidecar launch" in lines[0]
