"""scripts/tools/compile_check.py: the decode attention kernels compile for sm_90 on a machine without a GPU
(Triton compiles ahead of time; its wheel carries ptxas), so a kernel the interpreter accepts but the compiler
refuses is caught by CI, and ptxas's register and spill figures come back per config. In a child process:
the test process may run Triton's interpreter, whose kernels do not compile."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_kernels_compile_for_sm90_and_report_ptxas_figures() -> None:
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = REPO / "scripts" / "tools" / "compile_check.py"
    out = subprocess.run([sys.executable, str(script), "--kernels", "verify_rows", "inv_gemm", "mode_verify_rows",
                          "mode_prefill", "--shapes", "qwen2.5-7b", "--warps", "8", "--rope", "on"],
                         capture_output=True, text=True, timeout=600, env=env, check=True)
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    # the invariant GEMM at its own tiles and warps, then the verify kernels, then the batch-invariant mode's
    # key-segment kernels (verify split by segment with the fold merge; prefill folding the segments itself)
    assert [(r["kernel"], r["num_warps"], r["target"]) for r in rows] == [
        ("inv_gemm", 4, "sm_90a"), ("verify_rows", 8, "sm_90a"), ("mode_verify_rows", 8, "sm_90a"),
        ("mode_prefill", 8, "sm_90a")]
    for r in rows:
        assert 0 < r["registers"] <= 255 and r["shared_bytes"] > 0, r
        assert r["spill_store_bytes"] >= 0 and r["spill_load_bytes"] >= 0, r
