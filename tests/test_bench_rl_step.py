"""scripts/bench/rl_step.py on CPU with the tiny model against a real `sidecar launch`, run as a user runs it and
held to the JSON lines it prints: every mode's line, every group consumed once, staleness as each mode promises."""

from __future__ import annotations

import pytest

from tests.helpers_bench import bench_lines, refused

pytestmark = pytest.mark.slow  # every test here starts real processes or runs for seconds

BENCH = "scripts.bench.rl_step"
SMOKE = ["--shape", "tiny", "--steps", "3", "--prompts", "8", "--samples", "2", "--prompt-min", "8",
         "--prompt-max", "24", "--len-median", "12", "--len-cap", "48"]
MODES = ["sync", "partial_keep", "partial_recompute", "disagg_keep"]


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return bench_lines(BENCH, *SMOKE, timeout=300)


def test_dry_run_prints_the_plan() -> None:
    (plan,) = bench_lines(BENCH, *SMOKE, "--dry-run")
    assert plan["bench"] == "rl_step_plan" and plan["modes"] == MODES and plan["backend"] == "gloo"
    assert len(plan["first_lengths"]) == 12 and max(plan["first_lengths"]) <= 48  # 8 groups x 1.5 in flight


def test_every_mode_prints_one_line_in_order(rows: list[dict]) -> None:
    assert [r["mode"] for r in rows] == MODES
    for r in rows:
        assert r["bench"] == "rl_step" and r["shape"] == "tiny" and r["groups_per_s"] > 0 and r["tok_s"] > 0
        assert 0 <= r["tail_share"] < 1 and r["sync_audit_ms"] > 0 and r["train_s"] > 0
    assert rows[0]["ratio_to_sync"] is None and all(r["ratio_to_sync"] > 0 for r in rows[1:])
    assert all(r["sleep_ms"] is not None for r in rows[:3]) and rows[3]["sleep_ms"] is None  # disagg never sleeps


def test_every_submitted_group_is_consumed_once_or_left(rows: list[dict]) -> None:
    for r in rows:
        assert r["submitted"] == r["consumed"] + r["left"] and r["failed"] == 0, r
        assert r["consumed"] == 8 * (r["steps"] + r["warmup_steps"]) and r["duplicates"] == 0
        assert r["short_samples"] == 0  # every sample of a taken group generated its group's whole length
    assert rows[0]["left"] == 0 and all(r["left"] > 0 for r in rows[1:])  # over-sampled: a tail stays in flight


def test_staleness_is_what_each_mode_promises(rows: list[dict]) -> None:
    sync, keep, recompute, disagg = rows
    # synchronous: every token from the live weights
    assert sync["staleness_samples"] == {"0": 48} and set(sync["staleness_tokens"]) == {"0"}
    assert sync["max_spread"] == 0 and sync["carried"] == 0
    for r in (keep, recompute, disagg):
        assert r["carried"] > 0 and r["max_staleness_seen"] >= 1  # carried groups crossed a sync
        assert sum(r["staleness_samples"].values()) == 48 and sum(r["staleness_tokens"].values()) > 0
    assert disagg["max_spread"] >= 1  # a sync landed in the middle of a sample, which kept generating


def test_max_staleness_bounds_the_versions_within_a_sample() -> None:
    rows = bench_lines(BENCH, *SMOKE, "--modes", "sync,partial_recompute,disagg_keep", "--max-staleness", "1",
                       "--oversample", "2", timeout=300)
    assert [r["mode"] for r in rows] == ["sync", "partial_recompute", "disagg_keep"]
    for r in rows:
        assert r["max_staleness"] == 1 and r["max_spread"] <= 1, r
        assert r["submitted"] == r["consumed"] + r["left"] and r["duplicates"] == 0 and r["short_samples"] == 0


def test_refuses_a_run_without_the_sync_mode_or_a_train_time() -> None:
    assert "--train-s" in refused(BENCH, "--shape", "tiny", "--modes", "disagg_keep")
