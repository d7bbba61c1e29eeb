"""Nothing left behind, nothing installed by accident: `sidecar demo` and the tests' sidecars leave no file in
the temporary directory, and every third-party module the sidecar package imports is declared (the core
dependencies or the server extra, or one of their own dependencies)."""

from __future__ import annotations

import ast
import importlib.metadata as md
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers_sidecar import REPO

FIRST_PARTY = {"checksum", "inference", "sidecar", "trainer_hooks", "tests", "scripts"}


def _env(tmp: Path) -> dict[str, str]:
    tmp.mkdir(exist_ok=True)
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "TMPDIR": str(tmp)}


@pytest.mark.slow
def test_demo_leaves_no_file_in_the_temp_directory(tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    proc = subprocess.run([sys.executable, "-m", "sidecar.cli.main", "demo", "--device", "cpu", "--steps", "1",
                           "--batch", "2", "--samples", "2", "--max-tokens", "2"], cwd=REPO, env=_env(tmp),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _files(tmp) == []


def _files(tmp: Path) -> list[str]:
    """Every file under tmp (torch may leave its own empty cache directory, torchinductor_<user>)."""
    return sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if not p.is_dir())


@pytest.mark.slow
def test_a_test_sidecar_leaves_no_log_behind(tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    code = ("from tests.helpers_sidecar import launch\ns = launch()\nassert s.stop() == 0\n"
            "assert s.log_path.exists()\nprint(s.log_path)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=_env(tmp), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert Path(proc.stdout.strip()).is_relative_to(tmp)  # it was there while the process ran
    assert sorted(p.name for p in tmp.iterdir()) == []  # the logs' directory is gone too


def _imported_modules(paths: list[Path]) -> set[str]:
    names: set[str] = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names - FIRST_PARTY - set(sys.stdlib_module_names)


def _requirement_name(spec: str) -> str:
    return re.split(r"[\s<>=!~;\[(]", spec.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _requires(distribution: str) -> list[str]:
    """What an installed distribution requires; nothing for an extra not installed here (deepspeed)."""
    try:
        return md.requires(distribution) or []
    except md.PackageNotFoundError:
        return []


def test_every_module_the_sidecar_imports_is_declared() -> None:
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    # the core, and every extra a user installs (server, plot, cuda, deepspeed); dev is for the tests only
    user_extras = [spec for name, specs in project["optional-dependencies"].items() if name != "dev" for spec in specs]
    declared = {_requirement_name(s) for s in project["dependencies"] + user_extras}
    declared.discard("sidecar")
    # what a declared distribution brings itself (fastapi brings starlette)
    brought = {_requirement_name(r) for d in declared for r in _requires(d) if "extra ==" not in r}
    dists = md.packages_distributions()
    files = [*sorted((REPO / "sidecar").rglob("*.py")), REPO / "inference" / "text" / "chat_template.py"]
    missing = {}
    for module in sorted(_imported_modules(files)):
        names = {d.lower().replace("_", "-") for d in dists.get(module, [module])}
        if not names & (declared | brought):
            missing[module] = sorted(names)
    assert not missing, f"imported but not declared in pyproject.toml (dependencies or a user extra): {missing}"
