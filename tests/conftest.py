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
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels then run in Triton's interpreter on CPU tensors, where tests ask for it. It must be
    # set before Triton is imported anywhere.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _interpreted_dots_by_row() -> None:
    """Triton's interpreter computes tl.dot with one numpy matmul of the whole block, and numpy's float32
    BLAS does not promise a row the same bits at every position in it: OpenBLAS's Haswell/Zen sgemm
    kernel rounds some rows differently by where they sit (seen on an AMD EPYC box, numpy 2.4), which an
    MMA instruction on the GPU never does. The batch-invariance tests would then test numpy, not the
    kernels, and pass or fail by the CI machine's CPU. So the interpreter multiplies each row on its own
    (one batched matmul of 1-row products: every row by the same code), in the same dtypes."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    import numpy as np
    import triton.language as tl

    builder = getattr(interpreter, "InterpreterBuilder", None)
    convert = getattr(interpreter, "_convert_float", None)
    if builder is None or convert is None or not hasattr(builder, "create_dot"):
        return  # another Triton's internals: its dots stay as they are (the invariance tests then say so)
    if getattr(builder.create_dot, "by_row", False):
        return

    def create_dot(self: Any, a: Any, b: Any, d: Any, input_precision: Any, max_num_imprecise_acc: Any) -> Any:
        a_data, b_data = a.data, b.data
        if (a.dtype.primitive_bitwidth == 8 and a.dtype.is_floating()) or \
           (b.dtype.primitive_bitwidth == 8 and b.dtype.is_floating()):  # FP8 operands: as the interpreter does
            a_data = convert(a_data, a.dtype, tl.float16, None).view(np.float16)
            b_data = convert(b_data, b.dtype, tl.float16, None).view(np.float16)
        rows = np.matmul(a_data[..., :, None, :], b_data[..., None, :, :], dtype=d.data.dtype)[..., 0, :]
        return interpreter.TensorHandle(rows + d.data, d.dtype.scalar)

    create_dot.by_row = True  # type: ignore[attr-defined]
    builder.create_dot = create_dot


_interpreted_dots_by_row()


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
