"""Every audit tells "a different weight version" from "corrupted bytes", against a real `sidecar launch`:
`sidecar audit FILE FILE` on the sidecar's own GET /checksums answer, `audit --url --checkpoint` after a
sync, POST /audit with an older manifest, and the hook's audit of a sync whose bytes are not the sent ones."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from inference.models.tiny import default_model_dir
from sidecar.cli.main import main
from tests.helpers_sidecar import Sidecar, first_digest_wrong, launch
from trainer_hooks import AuditError, WeightSyncHook
from trainer_hooks.client import SidecarClient
from trainer_hooks.toy_policy import ToyPolicy


@pytest.fixture(scope="module")
def server() -> Iterator[Sidecar]:
    proc = launch()
    try:
        yield proc
    finally:
        proc.stop()


def _trained() -> torch.nn.Module:
    policy = ToyPolicy.from_dir(default_model_dir())
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.01)
    return policy


def _checksums(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/checksums", timeout=60).json()


@pytest.mark.slow
def test_versions_are_told_from_corrupted_bytes(server: Sidecar, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # The sidecar's own GET /checksums answer, saved as it comes, is a manifest file the CLI reads.
    launched = tmp_path / "launched.json"
    launched.write_text(json.dumps(_checksums(server.url)))
    assert main(["audit", str(launched), str(launched)]) == 0
    assert capsys.readouterr().out.startswith("OK: 23 tensors on 1 rank match")

    client = SidecarClient(server.url, timeout=60)
    with WeightSyncHook(client, _trained()) as hook:
        hook.sync()
    assert hook.version == 1

    # The checkpoint it was launched with: the sidecar now holds v1, a trainer's weights.
    assert main(["audit", "--url", server.url, "--checkpoint", str(default_model_dir())]) == 1
    out = capsys.readouterr().out
    assert out.startswith("the sidecar holds target v1: it was synced since launch"), out
    assert "not the checkpoint (v0)" in out and "not corruption" in out
    assert out.splitlines()[-1].startswith("different weight version, not corrupted bytes: ")

    # The launch's manifest against what is held now: files, and POST /audit.
    synced = tmp_path / "synced.json"
    synced.write_text(json.dumps(_checksums(server.url)))
    assert main(["audit", str(launched), str(synced)]) == 1
    assert "different weight version, not corrupted bytes" in capsys.readouterr().out
    answer = client.audit(expected=json.loads(launched.read_text())["manifests"][0])
    assert not answer["ok"] and answer["cause"] == "version"
    assert answer["summary"].startswith("different weight version, not corrupted bytes: weight_version")

    # Same version, other bytes: the hook's audit says so (the sender's first digest is made wrong).
    first_digest_wrong(monkeypatch)
    with WeightSyncHook(client, _trained()) as hook, pytest.raises(AuditError) as e:
        hook.sync()
    assert "same weight version: these bytes are not the ones expected" in str(e.value)
    assert "different weight version" not in str(e.value)
