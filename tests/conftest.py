"""Shared pytest wiring: the `cuda` mark skips itself where no GPU is present; a run leaves nothing behind.

Each run gets a private temp dir (TMPDIR and `tempfile.tempdir`, so subprocesses use it too): runs side
by side on one machine do not see each other's files, and whatever the run leaves there, beside
pytest's own basetemp, fails a run whose tests passed, as does a new untracked file in the work tree.
The dir is removed at the end of a clean run (kept, and named, when something was left).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels then run in Triton's interpreter on CPU tensors, where tests ask for it. It must be
    # set before Triton is imported anywhere.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """torch on one thread for a module: on this 2-core box two threads contend many times slower, and
    the batch-invariance facts are stated for one thread (inference/layers/invariant.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):
        return  # an xdist worker: the controller's run owns the dir (inherited through TMPDIR)
    run_tmp = Path(tempfile.mkdtemp(prefix="sidecar-tests-"))
    config.stash[_RUN_TMP] = (run_tmp, os.environ.get("TMPDIR"))
    config.stash[_UNTRACKED] = _untracked(config.rootpath)
    os.environ["TMPDIR"] = str(run_tmp)
    tempfile.tempdir = str(run_tmp)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    if _RUN_TMP not in config.stash:
        return
    run_tmp, old = config.stash[_RUN_TMP]
    _remove_helper_dirs()
    tempfile.tempdir = None
    if old is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = old
    left = sorted(p.name for p in run_tmp.iterdir() if not p.name.startswith(TOOL_CACHES))
    new_files = sorted(_untracked(config.rootpath) - config.stash[_UNTRACKED])
    if exitstatus == 0 and (left or new_files):
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if left:
            reporter.write_line(f"the tests left {left} in the temp dir {run_tmp} (kept for a look)", red=True)
        if new_files:
            reporter.write_line(f"the tests left untracked files in the work tree: {new_files}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        return
    if not left:
        shutil.rmtree(run_tmp, ignore_errors=True)


# what pytest and torch keep in the temp dir by their own design (removed with the run's dir)
TOOL_CACHES = ("pytest-of-", "torchinductor_")
_RUN_TMP = pytest.StashKey[tuple[Path, "str | None"]]()
_UNTRACKED = pytest.StashKey[frozenset[str]]()


def _remove_helper_dirs() -> None:
    """The dirs helpers keep for the whole process (sidecar logs read after a stop), removed now rather
    than at interpreter exit, which comes after this check."""
    import sys

    helpers = sys.modules.get("tests.helpers_sidecar")
    if helpers is not None and helpers._log_dir.cache_info().currsize:
        helpers._log_dir().cleanup()
        helpers._log_dir.cache_clear()


def _untracked(root: Path) -> frozenset[str]:
    """Untracked, not ignored paths under `root` (empty outside a git work tree)."""
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all", "."], cwd=root,
                             capture_output=True, text=True, timeout=60, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return frozenset()
    return frozenset(line[3:] for line in out.splitlines() if line.startswith("?? "))
