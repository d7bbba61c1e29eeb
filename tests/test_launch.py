"""`sidecar launch` as a process: configuration precedence, TP=2 over gloo, clean stop, dead ranks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from inference.core import InvalidRequestError, SamplingParams
from inference.engine.llm import LLM
from sidecar.client import SidecarClient, SidecarHTTPError, SidecarUnavailableError
from sidecar.config import LaunchConfig, build_config
from tests.helpers_sidecar import KV_BYTES, REPO, child_pids, cmdline, launch, pid_exists, port_is_free

# ---- configuration ------------------------------------------------------------------------------


def test_precedence_is_cli_then_env_then_file_then_defaults(tmp_path: Path) -> None:
    toml = tmp_path / "sidecar.toml"
    toml.write_text('tp = 2\nport = 9000\nmax-num-seqs = 8\nlog_level = "debug"\n')
    env = {"SIDECAR_PORT": "9100", "SIDECAR_ENFORCE_EAGER": "yes", "SIDECAR_HOME": "/ignored", "SIDECAR_TP": "3"}
    cfg = build_config({"tp": 4, "host": None}, env=env, config_file=toml)
    assert (cfg.tp, cfg.port, cfg.max_num_seqs, cfg.log_level) == (4, 9100, 8, "debug")
    assert cfg.enforce_eager is True and cfg.host == LaunchConfig.host
    js = tmp_path / "sidecar.json"
    js.write_text(json.dumps({"kv_cache_bytes": 1234, "api_key": "k"}))
    cfg = build_config({}, env={}, config_file=js)
    assert cfg.kv_cache_bytes == 1234 and cfg.public_dict()["api_key"] == "***"


@pytest.mark.parametrize(("cli", "env", "text", "field"), [
    ({"tp": 0}, {}, None, "tp"),
    ({}, {"SIDECAR_PORT": "eighty"}, None, "env SIDECAR_PORT"),
    ({}, {}, '{"tpp": 2}', "tpp"),
    ({}, {}, '{"tp": "2"}', "tp"),
    ({"device": "tpu"}, {}, None, "device"),
])
def test_bad_configuration_names_the_option(tmp_path: Path, cli: dict, env: dict, text: str | None,
                                            field: str) -> None:
    path = None
    if text is not None:
        path = tmp_path / "c.json"
        path.write_text(text)
    with pytest.raises(InvalidRequestError) as e:
        build_config(cli, env=env, config_file=path)
    assert field in e.value.field


def test_bad_flag_exits_2_without_starting() -> None:
    proc = subprocess.run([sys.executable, "-m", "sidecar.cli.main", "launch", "--tp", "0"], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "tp" in proc.stderr


# ---- processes -----------------------------------------------------------------------------------


def _rank_pids(url: str) -> list[int]:
    with SidecarClient(url) as c:
        return [r["pid"] for r in c.state()["ranks"]]


@pytest.mark.slow
def test_tp2_over_gloo_equals_tp1_and_sigterm_leaves_nothing() -> None:
    params = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=7, max_tokens=10, ignore_eos=True)]
    prompts = ["The train left the station", [9, 8, 7, 6, 5, 4]]
    want = LLM(device="cpu", kv_cache_bytes=KV_BYTES).generate(prompts, params)
    server = launch("--tp", "2")
    try:
        pids = _rank_pids(server.url)
        assert len(set(pids)) == 2
        children = child_pids(server.proc.pid)
        assert set(pids) <= set(children)
        with SidecarClient(server.url) as c:
            got = c.generate(prompts, params)
            assert [r["rank"] for r in c.state()["ranks"]] == ["dp0:pp0:tp0", "dp0:pp0:tp1"]
        for g, w in zip(got, want):
            assert g.outputs[0].token_ids == w.outputs[0].token_ids
            assert g.outputs[0].logprobs == pytest.approx(w.outputs[0].logprobs, abs=1e-4)
    finally:
        code = server.stop(signal.SIGTERM)
    assert code == 0, server.log
    # multiprocessing's resource tracker exits on its own once its parent is gone: give it a moment.
    deadline = time.monotonic() + 10
    while [p for p in children if pid_exists(p)] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [cmdline(p) for p in children if pid_exists(p)]
    assert port_is_free(server.url)


@pytest.mark.slow
def test_engine_settings_reach_the_ranks_and_the_key_file_guards_the_api(tmp_path: Path) -> None:
    key = tmp_path / "api-key"
    key.write_text("from-a-file\n")
    server = launch("--max-model-len", "96", "--block-size", "8", "--no-enable-prefix-caching",
                    "--api-key-file", str(key))
    try:
        assert "from-a-file" not in cmdline(server.proc.pid)
        assert httpx.get(server.url + "/state", timeout=30).status_code == 401
        with SidecarClient(server.url, api_key="from-a-file") as c:
            state = c.state()
            model = state["model"]
            assert (model["max_model_len"], model["block_size"]) == (96, 8)
            # both processes froze their warm heap (inference/memory/host_heap.py): torch, the model, FastAPI
            assert state["gc_frozen"] > 10_000 and state["ranks"][0]["gc_frozen"] > 10_000, state
            # the start-up warm-up's seconds (the serving line says them too); on CPU nothing compiles
            assert state["ranks"][0]["warm_up_s"] == 0.0
            # the max_model_len policy of inference/core.py, applied by the rank after tokenizing
            with pytest.raises(SidecarHTTPError) as e:
                c.generate([list(range(1, 11))], SamplingParams(max_tokens=87))
            assert (e.value.status, e.value.field) == (400, "sampling_params.max_tokens")
            assert "at most 86 fit" in e.value.message
            (out,) = c.generate([list(range(1, 11))], SamplingParams(max_tokens=86, ignore_eos=True))
            assert len(out.outputs[0].token_ids) == 86
    finally:
        code = server.stop(signal.SIGTERM)
    assert code == 0, server.log


@pytest.mark.slow
def test_killed_rank_makes_health_503_and_calls_fail_fast() -> None:
    server = launch()
    try:
        (pid,) = _rank_pids(server.url)
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while httpx.get(server.url + "/health", timeout=10).status_code != 503:
            assert time.monotonic() < deadline, "health never turned unhealthy"
            time.sleep(0.1)
        body = httpx.get(server.url + "/health", timeout=10).json()
        assert "rank 0" in body["error"]["message"]
        with SidecarClient(server.url, timeout=10) as c:
            t0 = time.monotonic()
            with pytest.raises(SidecarUnavailableError) as e:
                c.generate(["anyone there?"])
            assert "rank 0" in e.value.message and time.monotonic() - t0 < 5
            with pytest.raises(SidecarUnavailableError):
                c.sleep()
            state = c.state()
            assert state["healthy"] is False and state["ranks"][0]["alive"] is False
    finally:
        code = server.stop(signal.SIGINT)
    assert code == 0, server.log
    assert port_is_free(server.url)


def test_the_server_runs_on_uvloop_and_httptools_when_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The server extra installs both (pyproject.toml), so a plain install serves on them; a machine without
    them falls back to asyncio's loop and h11, never an error."""
    import uvloop

    from sidecar.cli.launch import event_loop

    loop, http = event_loop()
    try:
        assert isinstance(loop, uvloop.Loop) and http == "httptools"
    finally:
        loop.close()
    monkeypatch.setitem(sys.modules, "uvloop", None)  # not installed: the fallback
    loop, http = event_loop()
    try:
        assert not isinstance(loop, uvloop.Loop) and http == "h11"
    finally:
        loop.close()
