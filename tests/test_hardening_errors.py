"""Bad input is a 400 naming the field, or exit 2 with one line, never a 500 or a traceback: init_info
strings that are not Unicode and a world_size torch cannot hold, against a real `sidecar launch`; and
the launcher's and the audit's file inputs (deeply nested, endless, non-ASCII keys, a tokenizer
directory without a tokenizer), as processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers_sidecar import REPO, Sidecar, launch
from trainer_hooks.sync import SYNC_PROTOCOL

GOOD_INIT = {"backend": "gloo", "master_host": "127.0.0.1", "master_port": 29999, "world_size": 2,
             "bucket_bytes": 1 << 20, "timeout_s": 5.0, "session_id": "s1"}


@pytest.fixture(scope="module")
def server() -> Iterator[Sidecar]:
    proc = launch()
    yield proc
    assert proc.stop() == 0, proc.log


@pytest.mark.parametrize(("field", "value"), [("session_id", "a\ud800"), ("master_host", "\udc00host"),
                                              ("world_size", 2**40)])
def test_init_info_that_no_socket_can_carry_is_a_400_naming_it(server: Sidecar, field: str, value: Any) -> None:
    body = json.dumps({"init_info": {**GOOD_INIT, field: value}, "protocol": SYNC_PROTOCOL})
    resp = httpx.post(f"{server.url}/weights/init", content=body, headers={"content-type": "application/json"},
                      timeout=60)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["field"] == f"init_info.{field}"
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    return subprocess.run([sys.executable, "-m", "sidecar.cli.main", *args], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=timeout)


def assert_bad_input(result: subprocess.CompletedProcess[str], *words: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    assert all(w in result.stderr for w in words), result.stderr[-2000:]


@pytest.fixture
def deep(tmp_path: Path) -> Path:
    path = tmp_path / "deep.json"
    path.write_text("[" * 200_000 + "]" * 200_000)
    return path


def test_launch_refuses_bad_files_and_keys_with_exit_2(deep: Path, tmp_path: Path) -> None:
    assert_bad_input(run_cli("launch", "--device", "cpu", "--config", str(deep)), "nests too deeply")
    assert_bad_input(run_cli("launch", "--device", "cpu", "--config", "/dev/zero"), "larger than")
    assert_bad_input(run_cli("launch", "--device", "cpu", "--api-key-file", "/dev/zero"), "larger than")
    assert_bad_input(run_cli("launch", "--device", "cpu", "--api-key", "clé"), "api_key", "ASCII")
    key_file = tmp_path / "key"
    key_file.write_text("s\u00e9cret\n")
    assert_bad_input(run_cli("launch", "--device", "cpu", "--api-key-file", str(key_file)), "ASCII")
    empty = tmp_path / "no-tokenizer"
    empty.mkdir()
    assert_bad_input(run_cli("launch", "--device", "cpu", "--tokenizer", str(empty)), "tokenizer.json")


def test_launch_help_names_one_default_for_spec_max_batch() -> None:
    result = run_cli("launch", "--help")
    text = " ".join(result.stdout.split())
    start = text.index("--spec-max-batch N with")
    entry = text[start:text.index("SIDECAR_SPEC_MAX_BATCH", start)]
    assert entry.count("default") == 1 and "64" not in entry, entry


def test_audit_refuses_nested_and_non_unicode_files_with_exit_2(deep: Path, tmp_path: Path) -> None:
    import torch

    from checksum import manifest_from_tensors, save_manifests

    good = tmp_path / "good.json"
    save_manifests(good, [manifest_from_tensors({"w": torch.ones(3)}, model="target", weight_version=1,
                                                rank="dp0:pp0:tp0")])
    assert_bad_input(run_cli("audit", str(deep), str(good)), "nests too deeply")
    data = json.loads(good.read_text())
    data[0]["tensors"][0]["name"] = "w\ud800"
    surrogate = tmp_path / "surrogate.json"
    surrogate.write_text(json.dumps(data))
    assert_bad_input(run_cli("audit", str(good), str(surrogate)), "tensors[0].name", "Unicode")
    assert_bad_input(run_cli("audit", "/dev/zero", str(good)))
