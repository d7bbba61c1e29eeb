"""The `sidecar` command as a new user meets it: help without torch and with every default, one clean line
when there is no GPU, JSON-only output, `status` on a fresh server, make-model's advice, and the torch
thread count every rank process runs with (--threads)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from inference.core import InvalidRequestError
from inference.models.tiny import TinyModelSpec, default_model_dir
from sidecar.cli.common import HelpFormatter
from sidecar.cli.main import COMMANDS, build_parser, main
from sidecar.config import LaunchConfig, build_config
from sidecar.ranks.pool import rank_threads
from tests.helpers_sidecar import REPO, Sidecar, launch

TORCH_FREE_HELP = sorted(COMMANDS)


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_option_has_help_and_shows_its_default(command: str) -> None:
    parser = _subparsers()[command]
    formatter = HelpFormatter(prog=command)
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or (not action.option_strings and action.nargs is None):
            continue
        name = action.option_strings[0] if action.option_strings else action.dest
        assert action.help, f"sidecar {command} {name} has no help"
        assert "default" in (formatter._get_help_string(action) or ""), f"sidecar {command} {name}: no default"
    assert parser.formatter_class is HelpFormatter


@pytest.mark.parametrize("command", TORCH_FREE_HELP)
def test_help_imports_only_the_chosen_command_and_no_torch(command: str) -> None:
    code = (f"import sys\nfrom sidecar.cli.main import main\ntry:\n    main([{command!r}, '--help'])\n"
            "except SystemExit:\n    pass\n"
            "mods = sorted(m for m in sys.modules if m == 'torch' or m.startswith('sidecar.cli.')\n"
            "               and m not in ('sidecar.cli.main', 'sidecar.cli.common'))\n"
            "print(mods, file=sys.stderr)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    module = COMMANDS[command][0]
    assert out.stderr.strip() == str([module]), out.stderr  # no torch, no other subcommand's module
    assert "usage: sidecar" in out.stdout


def test_top_level_help_lists_every_command_without_importing_them(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert all(name in text for name in COMMANDS)


# ---- no GPU ---------------------------------------------------------------------------------------
def test_generate_on_cuda_without_a_gpu_is_one_clean_line(monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["generate", "--device", "cuda"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and len(out.err.strip().splitlines()) == 1
    assert "no GPU" in out.err and "--device cpu" in out.err and "Traceback" not in out.err


def test_launch_on_cuda_without_a_gpu_says_there_is_no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from sidecar.cli.launch import rank_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(InvalidRequestError, match="no GPU here") as e:
        rank_device(LaunchConfig(device="cuda", tp=2))
    assert e.value.field == "device" and "needs 2 GPUs" in e.value.message
    assert rank_device(LaunchConfig(device="auto")) == "cpu"


# ---- output ---------------------------------------------------------------------------------------
def test_generate_json_prints_only_json_lines(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--json", "--device", "cpu", "--max-tokens", "3", "--n", "2", "The river"]) == 0
    out = capsys.readouterr()
    rows = [json.loads(line) for line in out.out.splitlines()]
    assert [(r["prompt"], r["index"], len(r["token_ids"])) for r in rows] == [("The river", 0, 3), ("The river", 1, 3)]
    assert "6 tokens in" in out.err


def test_make_model_on_an_existing_directory_names_the_flag(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "m"
    assert main(["make-model", str(out)]) == 0
    capsys.readouterr()
    assert main(["make-model", str(out)]) == 2
    err = capsys.readouterr().err
    assert "pass --overwrite" in err and "overwrite=True" not in err
    assert main(["make-model", str(out), "--overwrite"]) == 0


def test_make_model_defaults_write_the_model_launch_serves(tmp_path: Path) -> None:
    """A trainer that loads `sidecar make-model DIR` starts from the served default model's bytes."""
    assert main(["make-model", str(tmp_path / "m")]) == 0
    served = default_model_dir()
    for f in sorted(served.iterdir()):
        assert (tmp_path / "m" / f.name).read_bytes() == f.read_bytes(), f.name


def test_the_qwen2_05b_demo_model_is_not_cached_as_tiny(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sidecar.demo.task as demo_task

    asked = []

    def small_stand_in(spec: TinyModelSpec, root: Path | None = None, name: str | None = None) -> Path:
        asked.append(spec)  # a 0.5B model would take minutes to draw on the CPU: build a tiny one under its name
        return default_model_dir(TinyModelSpec(num_layers=1), root=tmp_path, name=name)

    monkeypatch.setattr(demo_task, "default_model_dir", small_stand_in)
    model = demo_task.resolve_model("qwen2-0.5b")
    assert asked == [demo_task.QWEN2_05B] and model.path.parent == tmp_path
    assert model.path.name.startswith("qwen2-0.5b-random-") and "tiny" not in model.path.name


# ---- status on a fresh server, threads on every rank ----------------------------------------------
def test_status_defaults_to_the_launch_address() -> None:
    args = _subparsers()["status"].parse_args([])
    assert args.url == f"http://{LaunchConfig.host}:{LaunchConfig.port}" == "http://127.0.0.1:8000"


@pytest.fixture(scope="module")
def two_ranks() -> Iterator[Sidecar]:
    proc = launch("--tp", "2", "--threads", "2", "--log-level", "debug")  # memory plans are debug lines
    yield proc
    assert proc.stop() == 0, proc.log


@pytest.mark.slow
def test_status_of_a_fresh_server_shows_version_0_memory_and_ready(two_ranks: Sidecar,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", two_ranks.url]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2] == "weights    target v0"
    assert lines[3] == "memory     weights: awake, kv_cache: awake"
    header, *ranks = [line.split() for line in lines[6:]]
    assert header[:5] == ["RANK", "PID", "ALIVE", "DEVICE", "READY"] and len(ranks) == 2
    assert all(r[2:5] == ["yes", "cpu", "yes"] and "target=0" in r for r in ranks)


@pytest.mark.slow
def test_every_rank_runs_with_the_threads_asked_for(two_ranks: Sidecar) -> None:
    plans = [line for line in two_ranks.log.splitlines() if "memory plan: rank" in line]
    assert len(plans) == 2 and all("; 2 torch thread(s)" in line for line in plans), plans


def test_thread_defaults_leave_room_for_a_trainer() -> None:
    assert rank_threads(None, "cuda", 1, cores=64) == 1
    assert [rank_threads(None, "cpu", 1, cores=c) for c in (1, 2, 4, 8, 64)] == [1, 1, 2, 4, 4]
    assert rank_threads(None, "cpu", 2, cores=8) == 2 and rank_threads(None, "cpu", 4, cores=8) == 1
    assert rank_threads(6, "cpu", 2, cores=2) == 6  # --threads wins
    assert build_config({}, env={"SIDECAR_THREADS": "3"}).threads == 3
    with pytest.raises(InvalidRequestError) as e:
        build_config({"threads": 0}, env={})
    assert e.value.field == "threads"
