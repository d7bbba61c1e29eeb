"""`sidecar launch --devices`: which GPUs the ranks run on (parsed and mapped on the CPU; the placement
itself runs in tests/test_multigpu_cuda.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from inference.core import InvalidRequestError
from sidecar.cli.launch import place_ranks, visible_devices
from sidecar.config import build_config
from tests.helpers_sidecar import REPO


def test_devices_come_from_the_flag_or_the_environment() -> None:
    cfg = build_config({"tp": 2, "devices": "1, 2"}, env={})
    assert cfg.device_indices == (1, 2) and cfg.public_dict()["devices"] == "1, 2"
    assert build_config({}, env={"SIDECAR_DEVICES": "3"}).device_indices == (3,)
    assert build_config({}, env={"SIDECAR_DEVICES": "none"}).device_indices is None
    assert build_config({}, env={}).device_indices is None


@pytest.mark.parametrize(("cli", "message"), [
    ({"devices": "1,x"}, "comma-separated"),
    ({"devices": ""}, "comma-separated"),
    ({"devices": "-1"}, "distinct and >= 0"),
    ({"tp": 2, "devices": "1,1"}, "distinct and >= 0"),
    ({"tp": 2, "devices": "1"}, "one per rank"),
    ({"devices": "1", "device": "cpu"}, "not cpu"),
])
def test_bad_devices_name_the_option(cli: dict, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message) as e:
        build_config(cli, env={})
    assert e.value.field == "devices"


def test_indices_count_among_the_gpus_visible_now() -> None:
    assert visible_devices((1, 2), None, 4) == "1,2"
    assert visible_devices((2, 0), None, 4) == "2,0"
    assert visible_devices((1,), "4, 5,6", 0) == "5"
    assert visible_devices((0, 1), "GPU-aa,GPU-bb", 0) == "GPU-aa,GPU-bb"
    with pytest.raises(InvalidRequestError, match="GPU 2 does not exist: this machine has 2"):
        visible_devices((1, 2), None, 2)
    with pytest.raises(InvalidRequestError, match="CUDA_VISIBLE_DEVICES='4,5' shows 2"):
        visible_devices((3,), "4,5", 8)


def test_place_ranks_sets_the_environment_the_ranks_inherit() -> None:
    env = {"CUDA_VISIBLE_DEVICES": "6,7,4,5"}
    assert place_ranks(build_config({"tp": 2, "devices": "2,3"}, env={}), env) == "4,5"
    assert env == {"CUDA_VISIBLE_DEVICES": "4,5"}
    untouched = {"CUDA_VISIBLE_DEVICES": "6"}
    assert place_ranks(build_config({}, env={}), untouched) is None and untouched == {"CUDA_VISIBLE_DEVICES": "6"}


@pytest.mark.parametrize(("args", "message"), [
    (["--devices", "1,2"], "one per rank"),
    (["--devices", "5", "--device", "auto"], "GPU 5 does not exist"),
])
@pytest.mark.slow
def test_launch_with_bad_devices_exits_2(args: list[str], message: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": "0,1"}
    proc = subprocess.run([sys.executable, "-m", "sidecar.cli.main", "launch", "--port", "0", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
