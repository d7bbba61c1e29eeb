"""scripts/bench/delta.py, run as a user runs it, on the tiny shape over gloo: the fraction changed and each
encoding's bytes, then full and delta audited syncs with their bytes on the wire (the 0.5B run shares
every code path but the shape)."""

from __future__ import annotations

import pytest

from tests.helpers_bench import bench_lines

BENCH = "scripts.bench.delta"


@pytest.mark.slow
def test_the_cpu_smoke_reports_the_fraction_changed_and_full_against_delta() -> None:
    changed, wire = bench_lines(BENCH, "--shape", "tiny", "--iters", "1", "--lr", "1e-3")
    assert changed["figure"] == "changed" and 0 < changed["changed_fraction"] <= 1
    each = (changed["full_bytes"], changed["index_only_bytes"], changed["runs_only_bytes"])
    assert changed["chosen_bytes"] <= min(each)
    assert wire["figure"] == "wire" and wire["full"]["modes"] == ["full"] and wire["delta"]["modes"] == ["delta"]
    assert wire["delta"]["wire_bytes"] <= wire["full"]["wire_bytes"] and wire["delta"]["kept_copy_bytes"] > 0


@pytest.mark.slow
def test_the_cpu_smoke_reports_adapter_only_syncs_against_the_full_sync() -> None:
    lines = bench_lines(BENCH, "--shape", "tiny", "--iters", "1", "--lr", "1e-3", "--skip-changed", "--skip-delta",
                         "--lora-rank", "4")
    (lora,) = lines
    assert lora["figure"] == "lora" and lora["rank"] == 4 and lora["lora"]["modes"] == ["full"]
    assert 0 < lora["lora"]["wire_bytes"] < lora["full"]["wire_bytes"] and lora["bytes_ratio"] < 1
    assert lora["time_ratio"] > 0
