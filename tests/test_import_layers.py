"""The layering of the four packages, read statically from their source (docs/architecture.md):

- no import cycle among the modules of checksum/, inference/, sidecar/ and trainer_hooks/, counting
  imports inside functions and under `if TYPE_CHECKING:` too (neither makes a circle go away: the
  reader still walks it);
- no cycle among the sibling subfolders of any folder (inference/runner <-> inference/spec would be
  one), each subfolder counted with everything under it;
- checksum imports none of the others; inference imports neither sidecar nor trainer_hooks;
- trainer_hooks imports nothing of sidecar/ and, of inference/, only what the trainer's side may
  load (inference.core and the light weight sender), directly or through anything it imports.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("checksum", "inference", "sidecar", "trainer_hooks")
# what the trainer's side may load of inference/: the shared types, the env registry and the weight
# wire (inference/transfer/ is engine-free by design) and the FP8 rule (inference/quant/: torch and checksum
# only, so the trainer computes the bytes an FP8 rank installs), never an engine module
TRAINER_SIDE_INFERENCE = ("inference", "inference.core", "inference.envs")
TRAINER_SIDE_PREFIX = ("inference.transfer", "inference.quant")


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the four packages."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def imported_names(module: str, source: str, is_package: bool = False) -> Iterator[tuple[str, str | None]]:
    """(module, name) for `from module import name`, (module, None) for `import module`: every import
    statement of `source`, wherever it stands (in a function, under `if TYPE_CHECKING:`)."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                yield base, alias.name


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of the four packages it imports (`from a import b` counts a.b when b is
    a module, else a)."""
    files = module_files()
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        edges = set()
        for base, name in imported_names(module, path.read_text(), path.name == "__init__.py"):
            target = f"{base}.{name}" if name is not None and f"{base}.{name}" in files else base
            if target in files:
                edges.add(target)
        graph[module] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (or a self-import): Tarjan."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def subfolder_graph(graph: dict[str, set[str]], folder: str) -> dict[str, set[str]]:
    """The subfolders of `folder` (a module with modules under it, each counted with all of them)
    -> the sibling subfolders that its modules import."""
    prefix = folder + "."
    subs = {prefix + m[len(prefix):].split(".")[0] for m in graph
            if m.startswith(prefix) and "." in m[len(prefix):]}

    def sub(module: str) -> str | None:
        top = prefix + module[len(prefix):].split(".")[0] if module.startswith(prefix) else None
        return top if top in subs else None

    out: dict[str, set[str]] = {s: set() for s in subs}
    for module, targets in graph.items():
        a = sub(module)
        if a is not None:
            out[a] |= {b for b in map(sub, targets) if b is not None and b != a}
    return out


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        v = todo.pop()
        if v not in seen:
            seen.add(v)
            todo.extend(graph[v])
    return seen


def _package(module: str) -> str:
    return module.split(".")[0]


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


def test_the_graph_sees_imports_inside_functions(graph: dict[str, set[str]]) -> None:
    # sidecar/__init__ imports the client only inside its module __getattr__ (lazily, for httpx)
    assert "trainer_hooks.client" in graph["sidecar"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_graph_sees_type_checking_imports() -> None:
    code = ("from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n"
            "    from checksum.compare import Report\n"
            "    from . import sibling\n")
    assert list(imported_names("inference.speculative.decoder", code)) == [
        ("typing", "TYPE_CHECKING"), ("checksum.compare", "Report"), ("inference.speculative", "sibling")]


def test_no_import_cycles(graph: dict[str, set[str]]) -> None:
    assert cycles(graph) == []


def test_no_cycles_between_sibling_subfolders(graph: dict[str, set[str]]) -> None:
    toy = {"p": set(), "p.a": set(), "p.a.x": {"p.b.y", "p.c"}, "p.b": set(), "p.b.y": {"p.a"}, "p.c": set()}
    assert subfolder_graph(toy, "p") == {"p.a": {"p.b"}, "p.b": {"p.a"}}
    assert cycles(subfolder_graph(toy, "p")) == [["p.a", "p.b"]]
    folders = sorted(m for m, path in module_files().items() if path.name == "__init__.py")
    found = {f: c for f in folders if (c := cycles(subfolder_graph(graph, f)))}
    assert found == {}


@pytest.mark.parametrize(("importer", "forbidden"), [("checksum", {"inference", "sidecar", "trainer_hooks"}),
                                                     ("inference", {"sidecar", "trainer_hooks"}),
                                                     ("trainer_hooks", {"sidecar"})])
def test_lower_layers_never_import_higher_ones(graph: dict[str, set[str]], importer: str,
                                               forbidden: set[str]) -> None:
    bad = sorted(f"{m} -> {t}" for m, targets in graph.items() if _package(m) == importer
                 for t in targets if _package(t) in forbidden)
    assert bad == []


def test_trainer_hooks_reach_no_engine_module(graph: dict[str, set[str]]) -> None:
    reached = set().union(*(reachable(graph, m) for m in graph if _package(m) == "trainer_hooks"))
    wire = {m for m in reached if any(m == p or m.startswith(p + ".") for p in TRAINER_SIDE_PREFIX)}
    engine = sorted(m for m in reached - wire if _package(m) == "inference" and m not in TRAINER_SIDE_INFERENCE)
    assert engine == []
    assert "inference.transfer.sender" in reached  # the hook sends: the walk did follow it
    assert not any(_package(m) == "sidecar" for m in reached)


def test_the_client_imports_without_torch_or_the_engine() -> None:
    code = ("import sys\n"
            "import trainer_hooks.client, sidecar.client\n"
            "from sidecar import SidecarClient\n"
            "assert SidecarClient is trainer_hooks.client.SidecarClient is sidecar.client.SidecarClient\n"
            "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('inference.engine.llm', "
            "'inference.engine.worker', 'inference.models', 'sidecar.api.app', 'sidecar.rank')))\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
