"""`--model ORG/NAME` and `LLM("ORG/NAME")` from the local Hugging Face cache (a fake cache in tmp_path: the
hub's layout, no download), and the error that says what is accepted when the name is neither a directory
nor cached."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from inference.core import InvalidRequestError, SamplingParams
from inference.engine.llm import LLM
from inference.models.hub_cache import cached_snapshot, hub_cache_dir, resolve_model_dir
from inference.models.tiny import make_tiny_model
from tests.helpers_sidecar import REPO, launch

MODEL_ID = "tiny-org/Tiny-Chat-0.1M"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fake_cache(root: Path, model_id: str = MODEL_ID, with_ref: bool = True) -> Path:
    """<root>/models--ORG--NAME/{refs/main, snapshots/<hash>/...} with a tiny model: the snapshot dir."""
    repo = root / ("models--" + model_id.replace("/", "--"))
    snapshot = make_tiny_model(repo / "snapshots" / COMMIT)
    if with_ref:
        (repo / "refs").mkdir(parents=True)
        (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


def test_the_cache_dir_follows_huggingface_hubs_rule(tmp_path: Path) -> None:
    assert hub_cache_dir({"HF_HUB_CACHE": str(tmp_path / "a"), "HF_HOME": "/x"}) == tmp_path / "a"
    assert hub_cache_dir({"HF_HOME": str(tmp_path)}) == tmp_path / "hub"
    assert hub_cache_dir({}) == Path.home() / ".cache" / "huggingface" / "hub"


def test_an_id_resolves_to_its_snapshot_and_a_directory_to_itself(tmp_path: Path) -> None:
    snapshot = fake_cache(tmp_path / "hub")
    env = {"HF_HOME": str(tmp_path)}
    assert resolve_model_dir(MODEL_ID, env) == str(snapshot)
    assert resolve_model_dir(str(snapshot), {}) == str(snapshot)
    other = fake_cache(tmp_path / "other", "org/no-ref", with_ref=False)  # no refs/main: the only snapshot
    assert cached_snapshot("org/no-ref", {"HF_HUB_CACHE": str(tmp_path / "other")}) == other


@pytest.mark.parametrize("name", ["Qwen/Qwen2.5-0.5B-Instruct", "./no-such-dir"])
def test_an_unknown_name_says_what_is_supported_and_how_to_get_a_directory(tmp_path: Path, name: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        resolve_model_dir(name, {"HF_HUB_CACHE": str(tmp_path)})
    message = e.value.message
    assert e.value.field == "model"
    assert "config.json" in message and "local Hugging Face cache" in message and "--local-dir" in message
    if "/" in name and not name.startswith("."):
        assert f"huggingface-cli download {name} --local-dir DIR" in message and str(tmp_path) in message


def test_llm_loads_a_cached_id_as_launch_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The in-process engine resolves an id by the launch's rule (HF_HUB_CACHE from the environment):
    the same model, so the same greedy tokens as from its directory."""
    snapshot = fake_cache(tmp_path / "hub")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    by_id = LLM(MODEL_ID, device="cpu", kv_cache_bytes=1 << 20)
    assert by_id.config.model == str(snapshot)
    by_dir = LLM(snapshot, device="cpu", kv_cache_bytes=1 << 20)
    prompts = ["Once upon a", [5, 6, 7]]
    assert ([o.outputs[0].token_ids for o in by_id.generate(prompts, params)]
            == [o.outputs[0].token_ids for o in by_dir.generate(prompts, params)])


@pytest.mark.parametrize("field", ["model", "draft_model"])
def test_llm_with_an_uncached_id_names_the_id_and_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            field: str) -> None:
    snapshot = fake_cache(tmp_path / "hub")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    missing = "tiny-org/Not-Downloaded"
    with pytest.raises(InvalidRequestError) as e:
        if field == "model":
            LLM(missing, device="cpu")
        else:
            LLM(snapshot, device="cpu", draft_model=missing)
    assert e.value.field == field
    assert repr(missing) in e.value.message and str(tmp_path / "hub") in e.value.message
    assert f"huggingface-cli download {missing} --local-dir DIR" in e.value.message


@pytest.mark.slow
def test_launch_serves_a_cached_id_under_that_name(tmp_path: Path) -> None:
    fake_cache(tmp_path / "hub")
    server = launch("--model", MODEL_ID, env={"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"})
    try:
        models = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"]
        assert [m["id"] for m in models] == [MODEL_ID]
        body = {"model": MODEL_ID, "prompt": "Once upon a", "max_tokens": 3, "temperature": 0}
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
    finally:
        assert server.stop() == 0, server.log


@pytest.mark.slow
def test_launch_with_an_uncached_id_exits_2_with_the_hint(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "sidecar.cli.main", "launch", "--device", "cpu", "--model", "Qwen/Qwen2.5-0.5B"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_CACHE": str(tmp_path)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "huggingface-cli download Qwen/Qwen2.5-0.5B --local-dir DIR" in proc.stderr
