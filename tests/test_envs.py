"""Environment variables go through one registry (inference/envs.py), and docs/configuration.md lists them."""

from __future__ import annotations

import ast
import re
from dataclasses import fields
from pathlib import Path

import pytest

from inference import envs
from inference.core import InvalidRequestError, SamplingParams
from sidecar.config import LaunchConfig
from tests.helpers_sidecar import REPO

PACKAGES = ("checksum", "inference", "sidecar", "trainer_hooks")
# checksum is a leaf (torch and xxhash only), so it cannot import the registry; it reads no SIDECAR_* name.
REGISTRY_ONLY = ("inference", "sidecar", "trainer_hooks")
# (module, function) -> why touching os.environ there reads no setting
ALLOWED = {
    ("sidecar/cli/launch.py", "launch"): "hands the environment to place_ranks, which sets CUDA_VISIBLE_DEVICES "
                                         "for the rank processes to inherit",
    ("sidecar/cli/demo.py", "start"): "copies the environment for the sidecar subprocess it starts",
    ("sidecar/fleet_ray.py", "__init__"): "copies the environment for the replica it starts, adding the fleet's "
                                          "API key",
}
SIDECAR_NAME = re.compile(r"SIDECAR_[A-Z0-9_]+")
LAUNCH_NAMES = {envs.LAUNCH_PREFIX + f.name.upper() for f in fields(LaunchConfig)}


def _modules() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py"))


def _environ_uses(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, enclosing function) of every os.environ / os.getenv / environ / getenv reference."""
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST, func: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            func = node.name
        hit = (isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv")
               and isinstance(node.value, ast.Name) and node.value.id == "os")
        hit = hit or (isinstance(node, ast.ImportFrom) and node.module == "os"
                      and any(a.name in ("environ", "getenv") for a in node.names))
        if hit:
            found.append((node.lineno, func))
        for child in ast.iter_child_nodes(node):
            visit(child, func)

    visit(tree, "<module>")
    return found


def test_no_module_reads_the_environment_but_the_registry() -> None:
    bad, seen = [], set()
    for path in _modules():
        rel = path.relative_to(REPO).as_posix()
        if rel == "inference/envs.py" or not rel.startswith(REGISTRY_ONLY):
            continue
        for line, func in _environ_uses(ast.parse(path.read_text(), rel)):
            seen.add((rel, func))
            if (rel, func) not in ALLOWED:
                bad.append(f"{rel}:{line} in {func}")
    assert not bad, "read environment variables through inference/envs.py: " + ", ".join(bad)
    assert seen == set(ALLOWED)  # the scan finds what it must (and the exceptions are not stale)


def test_every_sidecar_variable_named_in_the_code_is_registered() -> None:
    known = set(envs.SWITCHES) | LAUNCH_NAMES
    bad = []
    for path in _modules():
        rel = path.relative_to(REPO).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            named = isinstance(node, ast.Constant) and SIDECAR_NAME.fullmatch(str(node.value))
            if named and (rel != "inference/envs.py" or node.value not in known):
                bad.append(f"{rel}:{node.lineno} {node.value}")
    assert not bad, "name SIDECAR_* variables only in inference/envs.py (and register them): " + ", ".join(bad)


def test_launch_variables_meet_the_switches_only_where_they_agree() -> None:
    assert LAUNCH_NAMES & set(envs.SWITCHES) == {"SIDECAR_API_KEY"}  # the api_key field's own variable
    assert envs.launch_overrides(["api_key", "tp"], {"SIDECAR_API_KEY": "k", "SIDECAR_HOME": "/h"}) == {
        "api_key": ("SIDECAR_API_KEY", "k")}


def test_switches_parse_their_values_and_name_themselves_when_bad() -> None:
    assert envs.PDL.get({}) is True and envs.PDL.get({"SIDECAR_PDL": " "}) is True
    for text, value in (("0", False), ("off", False), ("NO", False), ("1", True), ("True", True), ("on", True)):
        assert envs.PDL.get({"SIDECAR_PDL": text}) is value
    assert envs.HOME.get({}) is None and envs.HOME.get({"SIDECAR_HOME": "/x"}) == "/x"
    with pytest.raises(InvalidRequestError) as e:
        envs.PDL.get({"SIDECAR_PDL": "2"})
    assert e.value.field == "env SIDECAR_PDL"
    for switch in envs.SWITCHES.values():
        assert switch.read_at in ("import", "call") and switch.doc and switch.kind in (bool, int, str)


def test_the_registry_holds_user_settings_only() -> None:
    """No experiment is a variable: a measured winner is the only code path (docs/dev/benchmark-log.md)."""
    assert set(envs.SWITCHES) == {"SIDECAR_PDL", "TRITON_INTERPRET", "SIDECAR_HOME", "SIDECAR_API_KEY",
                                  "TRITON_CACHE_DIR", "HF_HUB_CACHE", "HF_HOME"}
    ours = [s for s in envs.SWITCHES.values() if s.owner == "sidecar"]  # the others are Triton's and the hub's
    assert len(ours) <= 3


def test_the_kernel_cache_lives_under_sidecar_home_unless_set() -> None:
    """Compiled kernels persist where the user's other Sidecar files are, and a user's own choice wins."""
    env = {"SIDECAR_HOME": "/data/sidecar"}
    assert envs.use_kernel_cache(env) == "/data/sidecar/triton" == env["TRITON_CACHE_DIR"]
    env = {"SIDECAR_HOME": "/data/sidecar", "TRITON_CACHE_DIR": "/mine"}
    assert envs.use_kernel_cache(env) == "/mine" and env["TRITON_CACHE_DIR"] == "/mine"
    env = {}
    assert envs.use_kernel_cache(env) is None and env == {}  # Triton's own default


def test_pdl_is_read_at_each_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """SIDECAR_PDL is a setting the process may change before an engine captures its graphs (tests do)."""
    monkeypatch.setenv("SIDECAR_PDL", "0")
    assert envs.PDL.get() is False and envs.PDL.read_at == "call"
    monkeypatch.setenv("SIDECAR_PDL", "sometimes")
    with pytest.raises(InvalidRequestError, match="env SIDECAR_PDL"):
        envs.PDL.get()


def test_docs_list_every_setting_flag_and_variable() -> None:
    doc = (REPO / "docs" / "configuration.md").read_text()
    missing = [name for name in envs.SWITCHES if f"`{name}`" not in doc]
    missing += [f.name for f in fields(LaunchConfig)
                if f"`--{f.name.replace('_', '-')}`" not in doc or f"`SIDECAR_{f.name.upper()}`" not in doc]
    missing += [f"sampling {f.name}" for f in fields(SamplingParams) if f"`{f.name}`" not in doc]
    assert not missing, f"docs/configuration.md misses {missing}"


def _module_names(tree: ast.AST) -> dict[str, str]:
    """Local name -> module, for every `from pkg import module [as name]` and `import pkg.module as name`."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    names[alias.asname] = alias.name
    return names


def _constant_name(name: str) -> bool:
    """UPPER_CASE, leading underscores allowed: a module constant or flag by the house's naming."""
    bare = name.lstrip("_")
    return bool(bare) and bare.isupper()


def _package_globals() -> set[str]:
    """Every UPPER_CASE name a module of the four packages assigns or imports at its top level."""
    names = set()
    for path in _modules():
        for node in ast.parse(path.read_text(), path.name).body:
            if isinstance(node, ast.ImportFrom):
                names |= {a.asname or a.name for a in node.names if _constant_name(a.asname or a.name)}
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name) and _constant_name(n.id)}
    return names


def _assigned_globals(tree: ast.AST, modules: dict[str, str], package_globals: set[str]) -> list[tuple[int, str]]:
    """(line, target) of every assignment of an UPPER_CASE global of the packages in a test module:
    setattr(module, "NAME", ...) (monkeypatch's or the builtin), setattr("pkg.module.NAME", ...) and
    module.NAME = .... The module is the test's import of it, or any other name (a fixture that returns
    one) whose attribute is a name some package module defines; a module outside the packages is left
    alone."""
    found = []

    def check(line: int, owner: ast.expr, attr: str) -> None:
        if not _constant_name(attr):
            return
        module = modules.get(owner.id, "") if isinstance(owner, ast.Name) else ""
        ours = module.split(".")[0] in PACKAGES
        if ours or (not module and attr in package_globals):
            found.append((line, f"{module or ast.unparse(owner)}.{attr}"))

    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and (
                (isinstance(node.func, ast.Attribute) and node.func.attr == "setattr")
                or (isinstance(node.func, ast.Name) and node.func.id == "setattr")) and node.args:
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                path, _, attr = first.value.rpartition(".")
                if path.split(".")[0] in PACKAGES and _constant_name(attr):
                    found.append((node.lineno, first.value))
            elif len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
                check(node.lineno, first, node.args[1].value)
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for t in ast.walk(target):
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id != "self":
                        check(node.lineno, t.value, t.attr)
    return found


@pytest.mark.slow
def test_no_test_assigns_a_module_global_of_the_packages() -> None:
    """Tests reach a path through an argument (a size, a rule, a backend's field), the inputs or a scoped
    context (kernel_device.interpreted_on_cpu(), device_digest.kernel_on_cpu()), never by assigning an
    UPPER_CASE global of checksum, inference, sidecar or trainer_hooks. Function spies stay allowed."""
    package_globals = _package_globals()
    assert {"SEGMENT_BYTES", "STREAM_BYTES", "LOG2E"} <= package_globals  # the scan finds what it must
    bad = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        tree = ast.parse(path.read_text(), path.name)
        bad += [f"{path.name}:{line} {what}" for line, what in _assigned_globals(tree, _module_names(tree),
                                                                                 package_globals)]
    assert not bad, bad


def test_the_scan_sees_each_form_of_assignment() -> None:
    sample = ast.parse("""
from checksum import definition
import inference.layers.triton_attention as ta
import os
monkeypatch.setattr(definition, "SEGMENT_BYTES", 1)
monkeypatch.setattr("inference.transfer.backends.chain.STREAM_BYTES", 2)
setattr(fixture_module, "_INTERPRET", False)
ta.LOG2E = 1.0
monkeypatch.setattr(os, "SEP", "/")
monkeypatch.setattr(definition, "digest_bytes", spy)
end.sizes = None
""")
    found = _assigned_globals(sample, _module_names(sample), {"SEGMENT_BYTES", "_INTERPRET", "LOG2E"})
    assert sorted(line for line, _ in found) == [5, 6, 7, 8], found
