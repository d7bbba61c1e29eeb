"""`sidecar audit`: exit 0 when every rank matches, 1 on a mismatch (naming tensor and rank),
2 on bad input with a one-line error and no traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from checksum import Manifest, manifest_from_tensors, rank_key, save_manifests
from sidecar.cli.main import main

REPO = Path(__file__).resolve().parents[1]


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(64, 16, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.down_proj.weight": torch.randn(16, 32, generator=g).to(torch.bfloat16),
        "model.norm.weight": torch.ones(16, dtype=torch.bfloat16),
    }


def manifest(sd: dict[str, torch.Tensor], rank: str = "dp0:pp0:tp0") -> Manifest:
    return manifest_from_tensors(sd, model="target", weight_version=5, rank=rank)


def corrupted(name: str) -> dict[str, torch.Tensor]:
    sd = weights()
    sd[name].view(torch.uint8).view(-1)[7] ^= 0x04
    return sd


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    paths = {k: tmp_path / f"{k}.json" for k in ("expected", "good", "bad", "ranks")}
    manifest(weights()).save(paths["expected"])
    manifest(weights(), rank="dp0:pp1:tp0").save(paths["good"])
    manifest(corrupted("model.layers.0.mlp.down_proj.weight"), rank="dp1:pp0:tp0").save(paths["bad"])
    save_manifests(paths["ranks"], [manifest(weights(), rank=rank_key(0, 0, tp)) for tp in range(2)])
    return paths


def test_all_ranks_match_exits_0(files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["audit", str(files["expected"]), str(files["good"]), str(files["ranks"])]) == 0
    out = capsys.readouterr().out
    assert out.startswith("OK") and "3 ranks" in out


def test_mismatch_exits_1_and_names_tensor_and_rank(files: dict[str, Path],
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["audit", str(files["expected"]), str(files["good"]), str(files["bad"])]) == 1
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("dp1:pp0:tp0"))
    assert row.split()[:4] == ["dp1:pp0:tp0", "target", "digest", "model.layers.0.mlp.down_proj.weight"]
    assert "dp0:pp1:tp0" not in out  # the good rank is not listed
    assert out.splitlines()[-1].startswith("checksum mismatch: digest of tensor "
                                           "'model.layers.0.mlp.down_proj.weight' on rank dp1:pp0:tp0")


def test_per_rank_expectations_are_matched_by_rank(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    expected, actual = tmp_path / "expected.json", tmp_path / "actual.json"
    save_manifests(expected, [manifest(weights(), rank=rank_key(0, 0, tp)) for tp in range(3)])
    save_manifests(actual, [manifest(corrupted("model.norm.weight"), rank="dp0:pp0:tp2"),
                            manifest(weights(), rank="dp0:pp0:tp0")])
    assert main(["audit", str(expected), str(actual)]) == 1
    rows = [line.split()[:4] for line in capsys.readouterr().out.splitlines()[1:-1]]
    assert rows == [["dp0:pp0:tp1", "target", "missing_rank", "-"],
                    ["dp0:pp0:tp2", "target", "digest", "model.norm.weight"]]


def bad_inputs(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    not_json = tmp_path / "not_json.json"
    not_json.write_text('{"format": "sidecar-checksum-manifest",')
    no_version = tmp_path / "no_version.json"
    data = manifest(weights()).to_dict()
    del data["weight_version"]
    no_version.write_text(json.dumps(data))
    old_algorithm = tmp_path / "old_algorithm.json"  # written before per-segment digests
    old_algorithm.write_text(json.dumps({**manifest(weights()).to_dict(), "algorithm": "xxh3_128"}))
    list_dtype = tmp_path / "list_dtype.json"  # raised TypeError inside checksum: a traceback, exit 1
    data = manifest(weights()).to_dict()
    data["tensors"][1]["dtype"] = ["bfloat16"]
    list_dtype.write_text(json.dumps(data))
    return {
        "missing file": (tmp_path / "absent.json", "cannot read"),
        "malformed JSON": (not_json, "invalid JSON"),
        "missing field": (no_version, "weight_version: missing field"),
        "retired algorithm": (old_algorithm, "algorithm: 'xxh3_128' is no longer supported"),
        "list as dtype": (list_dtype, ""),  # any one-line message naming the file
    }


@pytest.mark.parametrize("case", ["missing file", "malformed JSON", "missing field", "retired algorithm",
                                  "list as dtype"])
@pytest.mark.parametrize("side", ["expected", "actual"])
def test_bad_input_exits_2_with_one_line(case: str, side: str, files: dict[str, Path], tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    bad, message = bad_inputs(tmp_path)[case]
    argv = [str(bad), str(files["good"])] if side == "expected" else [str(files["expected"]), str(bad)]
    assert main(["audit", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and str(bad) in lines[0] and message in lines[0]


def test_no_actual_manifest_exits_2(files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["audit", str(files["expected"])]) == 2
    assert "actual manifest" in capsys.readouterr().err


@pytest.mark.slow
def test_command_line_process(files: dict[str, Path], tmp_path: Path) -> None:
    """The real entry point: exit codes, the table on stdout, no traceback on bad input."""
    def audit(*paths: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "sidecar.cli.main", "audit", *map(str, paths)],
                              capture_output=True, text=True, cwd=REPO, timeout=120)

    bad = audit(files["expected"], files["bad"])  # exit 0 is covered in-process above
    assert bad.returncode == 1
    assert "model.layers.0.mlp.down_proj.weight" in bad.stdout and "dp1:pp0:tp0" in bad.stdout
    broken = audit(files["expected"], bad_inputs(tmp_path)["malformed JSON"][0])
    assert broken.returncode == 2
    assert "Traceback" not in broken.stderr and broken.stderr.startswith("sidecar audit: error:")
