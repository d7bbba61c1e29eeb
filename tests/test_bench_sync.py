"""scripts/bench/sync.py, run as a user runs it, on the tiny shape over gloo on the CPU, with its FP8 columns:
the rank quantizing on receive, and the trainer quantizing on send (the linears' FP8 values and row scales
on the wire), each delivered sync with and without the rank's check of its installed digests. The larger
shapes share every code path but the sizes."""

from __future__ import annotations

import pytest

from inference.models.naming import expected_hf_tensors
from inference.quant.installed import is_fp8_linear
from scripts.bench.sync import model_config
from tests.helpers_bench import bench_lines, refused

BENCH = "scripts.bench.sync"


@pytest.mark.slow
def test_the_cpu_smoke_prints_bf16_and_both_fp8_columns_with_their_wire_bytes() -> None:
    bf16, fp8, on_send = bench_lines(BENCH, "--shape", "tiny", "--backend", "gloo", "--device", "cpu", "--iters", "1",
                                     "--quantization", "bf16,fp8,fp8-send")
    assert [r["quantization"] for r in (bf16, fp8, on_send)] == ["bf16", "fp8", "fp8-send"]
    assert bf16["bytes"] == bf16["wire_bytes"] == fp8["wire_bytes"] == on_send["bytes"]
    linears = [s for n, s in expected_hf_tensors(model_config("tiny")).items() if is_fp8_linear(n)]
    saved = sum(2 * n * k - (n * k + 4 * n) for n, k in linears)  # bf16 against FP8 values + fp32 row scales
    assert on_send["wire_bytes"] == bf16["bytes"] - saved
    for row in (fp8, on_send):  # into an FP8 rank the delivered sync checks the installed digests (or not)
        assert row["sync_audit_ms"] > 0 and row["fp8_over_bf16"] > 0
        assert row["installed_section_ms"] > 0 and row["sync_audit_delivered_unchecked_ms"] > 0
    assert bf16["installed_section_ms"] == 0  # a bf16 rank asks for none
    assert on_send["fp8_send_over_fp8"] > 0


def test_an_unknown_quantization_is_refused() -> None:
    assert "--quantization" in refused(BENCH, "--quantization", "bf16,int4")
