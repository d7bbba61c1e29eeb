"""scripts/bench/first_batch.py on the CPU (the smoke run; the lead runs it on the GPU): one JSON line with
both batch times and their ratio, and its empty kernel cache removed afterwards."""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts.bench import first_batch


@pytest.mark.slow  # two tiny batches and an engine: ~15 s on the 2-core box
def test_first_batch_prints_both_times_and_removes_its_cache(capsys: pytest.CaptureFixture[str]) -> None:
    line = first_batch.main(["--shape", "tiny", "--prompts", "2", "--samples", "2", "--len-cap", "6",
                             "--prompt-min", "4", "--prompt-max", "8", "--device", "cpu"])
    assert line["first_s"] > 0 and line["second_s"] > 0
    # the printed times are rounded to 0.1 ms: the ratio must lie within what that rounding allows
    half = 5e-5
    low = (line["first_s"] - half) / (line["second_s"] + half)
    high = (line["first_s"] + half) / (line["second_s"] - half)
    assert low - 1e-3 <= line["first_over_second"] <= high + 1e-3
    assert not Path(str(line["kernel_cache"]).removeprefix("empty (").rstrip(")")).exists()
    assert capsys.readouterr().out.count("\n") == 1
    assert line["compiled"] is None and line["compiled_in_first"] is None  # CPU: nothing compiles


def test_the_compile_log_names_what_each_phase_compiled() -> None:
    log = first_batch.CompileLog(True)  # as install() leaves it on CUDA; Triton calls _hook by keyword
    log._hook(key=1, repr="_paged_attention_kernel[num_warps=4](q: *bf16, BLOCK_B: 512)", fn=None)
    log._hook(key=2, repr="_paged_attention_kernel[num_warps=4](q: *bf16, BLOCK_B: 1024)", fn=None)
    log.phase = "second"
    log._hook(key=3, repr="_sample_kernel[num_warps=8](x: *fp32)", fn=None)
    assert log.counts() == {"first": 2, "second": 1}
    assert log.names("first") == {"_paged_attention_kernel": 2} and log.names("second") == {"_sample_kernel": 1}
