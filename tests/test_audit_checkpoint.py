"""`sidecar audit --url URL --checkpoint DIR` against a real `sidecar launch --model DIR` (CPU): the
documented way to check that a sidecar holds a checkpoint, with no false mismatches from the fused
qkv_proj / gate_up_proj, TP shards, a padded vocabulary or the served dtype; an FP8 sidecar's held values
and row scales checked by the rule; and `--url` with nothing to compare says so (exit 2) instead of "OK"."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from checksum import ALGORITHM, Manifest, audit, manifest_from_tensors
from inference.models import build_model
from inference.models.hf_config import read_model_config
from inference.models.loader import iter_hf_tensors, load_weights
from inference.models.tiny import make_tiny_model
from inference.parallel import TPInfo
from inference.weights.audit import HeldDigests
from sidecar.audit.checkpoint import checkpoint_manifests
from sidecar.cli.main import main
from tests.helpers_sidecar import REPO, Sidecar, launch

DOWN = "model.layers.1.mlp.down_proj.weight"  # row-parallel: the last rank holds the last columns
QKV_SCALE = "model.layers.0.self_attn.qkv_proj.weight_scale"  # column-parallel: the last rank holds v's last rows


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("ckpt") / "tiny")


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[Sidecar]:
    proc = launch("--model", str(model_dir))
    yield proc
    assert proc.stop() == 0, proc.log


def audit_process(*args: str) -> subprocess.CompletedProcess[str]:
    """The command exactly as docs/checksums.md writes it, in a process of its own."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    return subprocess.run([sys.executable, "-m", "sidecar.cli.main", "audit", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_a_sidecar_serving_the_checkpoint_matches_it(server: Sidecar, model_dir: Path) -> None:
    proc = audit_process("--url", server.url, "--checkpoint", str(model_dir))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # 3 layers x 7 parameters + embedding (tied: also the head) + final norm, under the sidecar's names
    assert proc.stdout.startswith("OK: 23 tensors on 1 rank match"), proc.stdout


@pytest.mark.slow
def test_the_checkpoint_as_it_is_points_to_checkpoint_instead_of_false_mismatches(
        server: Sidecar, model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A manifest of the checkpoint's own tensors against the held one (either side) is one model in two
    layouts: not a mismatch of every fused tensor, but bad input that names --checkpoint."""
    naive = manifest_from_tensors(dict(iter_hf_tensors(model_dir)), model="target", weight_version=0,
                                  rank="dp0:pp0:tp0")
    naive.save(tmp_path / "naive.json")
    assert main(["audit", "--url", server.url, str(tmp_path / "naive.json")]) == 2
    out = capsys.readouterr()
    assert out.out == "" and len(out.err.splitlines()) == 1
    assert "--checkpoint DIR" in out.err and "two layouts" in out.err
    (tmp_path / "held.json").write_text(json.dumps(audit_process_json(server.url)))
    assert main(["audit", str(tmp_path / "held.json"), str(tmp_path / "naive.json")]) == 2
    assert "--checkpoint DIR" in capsys.readouterr().err
    assert main(["audit", str(tmp_path / "naive.json"), str(model_dir / "model.safetensors")]) == 2
    assert "a checkpoint, not a checksum manifest" in capsys.readouterr().err


def audit_process_json(url: str) -> dict:
    """GET /checksums as it comes (the file a user saves with curl)."""
    import httpx

    return httpx.get(f"{url}/checksums", timeout=60).json()


@pytest.mark.slow
def test_another_checkpoint_fails_naming_the_fused_tensor(server: Sidecar, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    other = make_tiny_model(tmp_path / "other", seed=1)
    assert main(["audit", "--url", server.url, "--checkpoint", str(other), "--max-rows", "0"]) == 1
    rows = [line.split()[:4] for line in capsys.readouterr().out.splitlines()[1:-1]]
    assert ["dp0:pp0:tp0", "target", "digest", "model.layers.0.self_attn.qkv_proj.weight"] in rows
    assert ["dp0:pp0:tp0", "target", "digest", "model.layers.2.mlp.gate_up_proj.weight"] in rows
    assert {r[2] for r in rows} == {"digest"}  # same names, shapes and dtypes: only the bytes differ


@pytest.mark.slow
def test_the_device_rule_is_computed_on_the_host_for_the_comparison(
        server: Sidecar, model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A GPU sidecar's held digests are of the device rule: --checkpoint digests by each rank's rule."""
    assert main(["audit", "--url", server.url, "--checkpoint", str(model_dir), "--algorithm", "xxh3_64_seg64k"]) == 0
    assert capsys.readouterr().out.startswith("OK: 23 tensors on 1 rank match")


@pytest.mark.slow
def test_url_with_nothing_to_compare_says_so(server: Sidecar) -> None:
    proc = audit_process("--url", server.url)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("sidecar audit: error: ") and "nothing to compare" in proc.stderr
    assert "--checkpoint" in proc.stderr and len(proc.stderr.splitlines()) == 1


@pytest.mark.parametrize(("argv", "message"), [
    (["--checkpoint", "DIR"], "--checkpoint: needs --url"),
    (["--url", "URL", "--checkpoint", "DIR", "--source", "received"], "--checkpoint: describes held weights"),
    (["--url", "URL", "--checkpoint", "DIR", "e.json"], "--checkpoint: give EXPECTED.json or --checkpoint"),
    (["--url", "URL", "--algorithm", "sha256"], "--algorithm: unknown digest rule 'sha256'"),
])
def test_meaningless_combinations_exit_2_before_any_request(argv: list[str], message: str,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["audit", *argv]) == 2  # "URL" is no address: reaching it would fail differently
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_tp2_shards_a_padded_vocabulary_and_the_served_dtype(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Untied llama, vocabulary 513 (padded to 514 over 2 ranks), float32 checkpoint served in bfloat16."""
    model = make_tiny_model(tmp_path / "llama", family="llama", vocab_size=513, tie_word_embeddings=False)
    server = launch("--model", str(model), "--tp", "2", "--dtype", "bfloat16")
    try:
        assert main(["audit", "--url", server.url, "--checkpoint", str(model)]) == 0
        assert capsys.readouterr().out.startswith("OK: 42 tensors on 2 ranks match")  # 21 a rank
        assert main(["audit", "--url", server.url]) == 2  # two shards, no replica of either
        assert "ranks: dp0:pp0:tp0, dp0:pp0:tp1" in capsys.readouterr().err
    finally:
        assert server.stop() == 0, server.log


def fp8_rank_manifests(model_dir: Path, tp: int) -> tuple[list[torch.nn.Module], list[Manifest]]:
    """What `sidecar launch --model DIR --quantization fp8 --tp TP` holds: each rank's model, loaded as the
    rank loads it, and its held manifest (GET /checksums), built in this process."""
    config = read_model_config(model_dir)
    models, held = [], []
    digests = HeldDigests()
    for rank in range(tp):
        model = build_model(config, TPInfo(rank, tp, group=object()) if tp > 1 else TPInfo(), torch.float32, "cpu",
                            quantization="fp8")
        load_weights(model, model_dir)  # never runs: the placeholder group is never used
        models.append(model)
        held.append(digests.manifest(model, "target", 0, f"dp0:pp0:tp{rank}", ALGORITHM))
    digests.close()
    return models, held


@pytest.mark.parametrize("tp", [1, 2])
def test_an_fp8_ranks_values_and_scales_match_the_checkpoint_and_a_flipped_byte_is_named(model_dir: Path,
                                                                                          tp: int) -> None:
    """An FP8 rank holds the rule's values (its TP share, stacked as its fused parameter stacks them) and
    their row scales (held manifests carry them after each weight): --checkpoint quantizes the checkpoint's
    linears by the same rule, so a correct rank passes, and a flipped byte of a value or of a scale fails
    naming the tensor and the rank."""
    models, held = fp8_rank_manifests(model_dir, tp)
    report = audit(checkpoint_manifests(model_dir, held), held)
    assert report.ok and report.tensors_checked == sum(len(m.records) for m in held), report.table()
    names = {r.name: r.dtype for r in held[0].records}
    assert names[DOWN] == "float8_e4m3fn" and names[QKV_SCALE] == "float32"
    last = models[-1]
    for tensor in (last.get_parameter(DOWN), last.get_buffer(QKV_SCALE)):
        tensor.detach().view(-1)[-1:].view(torch.uint8)[:1].bitwise_xor_(1)
    digests = HeldDigests()
    held[-1] = digests.manifest(last, "target", 0, f"dp0:pp0:tp{tp - 1}", ALGORITHM)
    digests.close()
    report = audit(checkpoint_manifests(model_dir, held), held)
    assert {(m.kind, m.rank, m.tensor) for m in report.mismatches} == {
        ("digest", f"dp0:pp0:tp{tp - 1}", DOWN), ("digest", f"dp0:pp0:tp{tp - 1}", QKV_SCALE)}


@pytest.mark.slow
def test_an_fp8_sidecar_at_tp2_matches_its_checkpoint(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    server = launch("--model", str(model_dir), "--quantization", "fp8", "--tp", "2")
    try:
        assert main(["audit", "--url", server.url, "--checkpoint", str(model_dir)]) == 0
        # 23 parameters and 12 FP8 scales (4 FP8 linears in each of 3 layers) a rank
        assert capsys.readouterr().out.startswith("OK: 70 tensors on 2 ranks match")
    finally:
        assert server.stop() == 0, server.log
