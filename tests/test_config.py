"""LaunchConfig is the one declaration of `sidecar launch`'s options: flags, environment variables,
config-file keys and the rank's EngineConfig all come from its fields (sidecar/config.py)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

from inference.config import ENGINE_SECTIONS, EngineConfig, engine_option_names
from inference.core import InvalidRequestError
from sidecar.cli.launch import add_arguments
from sidecar.config import FIELD_TYPES, LaunchConfig, build_config, engine_config, engine_default
from tests.helpers_sidecar import REPO

LAUNCHER_RESOLVES = {"model", "device"}  # engine options the launcher resolves itself (model dir, device)
ENGINE_FIELDS = [f for f in fields(LaunchConfig) if "engine" in f.metadata]


def _engine_value(ec: EngineConfig, name: str) -> Any:
    section = engine_option_names()[name]
    return getattr(getattr(ec, section) if section else ec, name)


def _other_value(f: Any, tmp_path: Path) -> Any:
    """A valid value of field f that differs from its default and, for engine fields, from the engine's."""
    special = {"device": "cpu", "devices": "0", "host": "0.0.0.0", "port": 9000, "log_level": "debug",
               "log_format": "json",
               "transfer": "ipc", "gpu_memory_utilization": 0.5, "load_format": "dummy",
               "on_sync": "keep", "quantization": "fp8", "draft_quantization": "fp8",
               "self_draft": False}  # True needs batch_invariant
    if f.name == "api_key_file":
        path = tmp_path / "key"
        path.write_text("secret-from-file\n")
        return str(path)
    if f.name in special:
        return special[f.name]
    kind = FIELD_TYPES[f.name]
    current = engine_default(f.metadata["engine"]) if "engine" in f.metadata else f.default
    if kind is bool:
        return not current
    if kind is int:
        return (current or 0) + 3
    if kind is float:
        return (current or 1.0) * 2
    return f"x-{f.name}"


def _text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _parse(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(argv)
    return {name: getattr(args, name) for name in FIELD_TYPES}


def _flag(name: str, value: Any) -> list[str]:
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return [flag if value else "--no-" + flag[2:]]
    return [flag, _text(value)]


def test_every_field_is_a_flag_an_env_variable_and_a_file_key(tmp_path: Path) -> None:
    for f in fields(LaunchConfig):
        value = _other_value(f, tmp_path)
        assert value != f.default
        from_cli = build_config(_parse(_flag(f.name, value)), env={})
        from_env = build_config({}, env={f"SIDECAR_{f.name.upper()}": _text(value)})
        path = tmp_path / f"{f.name}.json"
        path.write_text(json.dumps({f.name.replace("_", "-"): value}))
        from_file = build_config({}, env={}, config_file=path)
        for cfg in (from_cli, from_env, from_file):
            assert getattr(cfg, f.name) == value, f.name


def test_help_shows_every_flag_with_its_default_and_variable() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    text = " ".join(parser.format_help().split())
    for f in fields(LaunchConfig):
        assert "--" + f.name.replace("_", "-") in text and f"SIDECAR_{f.name.upper()}" in text, f.name
    assert "--max-num-batched-tokens N tokens per step (prefill chunks plus decodes) (default: 8192;" in text
    assert "(default: true; env SIDECAR_ENABLE_PREFIX_CACHING)" in text  # the engine's default, shown
    assert "shows in `ps`: prefer --api-key-file or the SIDECAR_API_KEY variable" in text


def test_help_imports_no_torch() -> None:
    code = ("import argparse, sys; from sidecar.cli.launch import add_arguments; p = argparse.ArgumentParser(); "
            "add_arguments(p); p.format_help(); print(sorted({'torch', 'fastapi', 'httpx'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_every_engine_option_is_reachable_from_launch() -> None:
    mapped = [f.metadata["engine"] for f in ENGINE_FIELDS]
    assert len(mapped) == len(set(mapped))
    assert set(engine_option_names()) - LAUNCHER_RESOLVES == set(mapped)
    assert set(ENGINE_SECTIONS) == {"cache", "scheduler"}  # a new section needs a mapping here too


@pytest.mark.parametrize("f", ENGINE_FIELDS, ids=[f.name for f in ENGINE_FIELDS])
def test_a_launch_setting_reaches_the_rank_engine_config(f: Any, tmp_path: Path) -> None:
    name = f.metadata["engine"]
    value = _other_value(f, tmp_path)
    assert value != engine_default(name)
    cli = {f.name: value, "tp": 1} if f.name != "tp" else {"tp": value}
    ec = engine_config(build_config(cli, env={}), "/models/m", "cpu")
    assert _engine_value(ec, name) == value
    assert (ec.model, ec.device) == ("/models/m", "cpu")
    untouched = engine_config(build_config({}, env={}), "/models/m", "cpu")
    assert _engine_value(untouched, name) == engine_default(name)  # unset: the engine's own default


def test_unset_engine_fields_take_the_engine_defaults() -> None:
    assert engine_config(LaunchConfig(), "m", "cuda") == EngineConfig(model="m", device="cuda")


@pytest.mark.parametrize(("cli", "env", "field"), [
    ({"block_size": 0}, {}, "block_size"),
    ({"gpu_memory_utilization": 1.5}, {}, "gpu_memory_utilization"),
    ({"gpu_memory_utilization": 0.0}, {}, "gpu_memory_utilization"),
    ({"load_format": "pickle"}, {}, "load_format"),
    ({"max_num_batched_tokens": True}, {}, "max_num_batched_tokens"),
    ({}, {"SIDECAR_ENABLE_PREFIX_CACHING": "maybe"}, "env SIDECAR_ENABLE_PREFIX_CACHING"),
    ({}, {"SIDECAR_NUM_SPECULATIVE_TOKENS": "-1"}, "num_speculative_tokens"),
])
def test_bad_engine_settings_name_the_option(cli: dict, env: dict, field: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        build_config(cli, env=env)
    assert e.value.field == field


def test_api_key_from_a_file_or_the_environment_never_shows(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("s3cret\n")
    cfg = build_config({"api_key_file": str(key_file)}, env={})
    assert cfg.api_key == "s3cret" and cfg.public_dict()["api_key"] == "***"
    assert build_config({}, env={"SIDECAR_API_KEY": "k2"}).api_key == "k2"
    assert build_config({"api_key": "s3cret", "api_key_file": str(key_file)}, env={}).api_key == "s3cret"
    with pytest.raises(InvalidRequestError, match="not both") as e:
        build_config({"api_key_file": str(key_file)}, env={"SIDECAR_API_KEY": "other"})
    assert e.value.field == "api_key_file"
    (tmp_path / "empty").write_text("\n")
    for path in (tmp_path / "empty", tmp_path / "missing"):
        with pytest.raises(InvalidRequestError) as e:
            build_config({"api_key_file": str(path)}, env={})
        assert e.value.field == "api_key_file"


def test_in_process_llm_refuses_a_tp_size_it_cannot_run() -> None:
    from inference.engine.llm import LLM, check_tp_size
    from inference.parallel import TPInfo

    with pytest.raises(InvalidRequestError, match="sidecar launch --tp 2") as e:
        LLM(device="cpu", tp_size=2)
    assert e.value.field == "tp_size"
    # refused before anything loads: this model directory does not exist
    with pytest.raises(InvalidRequestError, match="tp_size is 4 but tp") as e:
        LLM(config=EngineConfig(model="/nonexistent", tp_size=4), tp=TPInfo(rank=0, size=2, group=object()))
    assert e.value.field == "tp_size"
    check_tp_size(EngineConfig(model="m", tp_size=2), TPInfo(rank=1, size=2, group=object()))  # a rank of TP 2
    check_tp_size(EngineConfig(model="m"), None)
