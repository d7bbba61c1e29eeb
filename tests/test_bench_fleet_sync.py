"""scripts/bench/fleet_sync.py, run as a user runs it: the launches the H200 run makes (four replicas sharing
GPU 0 against one replica with their memory, from --dry-run), the setups it refuses, and the whole script on
CPU over gloo with rollouts (2 tiny replicas), which shares every code path with the H200 run except the
device and the backend."""

from __future__ import annotations

import httpx
import pytest

from tests.helpers_bench import bench_lines, refused

BENCH = "scripts.bench.fleet_sync"
H200 = ["--device", "cuda", "--backend", "ipc", "--shape", "qwen2-0.5b", "--replicas", "4", "--rollout-batch", "128"]


def _after_dashdash(cmd: list[str], flag: str) -> str:
    """The value of a `sidecar launch` flag (after --) in a `sidecar fleet` command."""
    launch = cmd[cmd.index("--") + 1:]
    return launch[launch.index(flag) + 1]


def _fleet_flag(cmd: list[str], flag: str) -> str:
    own = cmd[:cmd.index("--")]
    return own[own.index(flag) + 1]


def _launches(*argv: str) -> tuple[list[str], list[str]]:
    (line,) = bench_lines(BENCH, *argv, "--dry-run")
    assert line["bench"] == "fleet_sync_launches"
    return line["fleet"], line["one_replica"]


@pytest.mark.slow
def test_h200_fleet_shares_gpu_0_and_the_one_replica_gets_all_its_memory() -> None:
    fleet, one = _launches(*H200)
    assert _fleet_flag(fleet, "--replicas") == "4" and _fleet_flag(fleet, "--gpus") == "0,0,0,0"
    assert _fleet_flag(one, "--replicas") == "1" and _fleet_flag(one, "--gpus") == "0"
    for cmd in (fleet, one):
        assert _fleet_flag(cmd, "--device") == "cuda" and _after_dashdash(cmd, "--model") == "<model>"
        assert _after_dashdash(cmd, "--max-model-len") == "256"
    assert int(_after_dashdash(one, "--kv-cache-bytes")) == 4 * int(_after_dashdash(fleet, "--kv-cache-bytes"))
    assert _after_dashdash(fleet, "--max-num-seqs") == "32" and _after_dashdash(one, "--max-num-seqs") == "128"
    fleet, one = _launches(*H200, "--gpu-memory-utilization", "0.2")
    assert _after_dashdash(fleet, "--gpu-memory-utilization") == "0.2" and "--kv-cache-bytes" not in fleet
    assert _after_dashdash(one, "--gpu-memory-utilization") == "0.8" and "--kv-cache-bytes" not in one


@pytest.mark.slow
def test_the_cpu_default_launch_is_unchanged() -> None:
    cmd, _ = _launches()
    assert cmd[cmd.index("fleet"):] == ["fleet", "--replicas", "3", "--tp", "1,1,1", "--port", "0", "--device", "cpu",
                                        "--startup-timeout-s", "300.0", "--", "--model", "<model>", "--log-level",
                                        "warning", "--kv-cache-bytes", str(16 << 20)]


@pytest.mark.parametrize("argv", [["--backend", "ipc"], ["--rollout-batch", "-1"],
                                  ["--replicas", "4", "--gpu-memory-utilization", "0.3", "--device", "cuda"]])
@pytest.mark.slow
def test_bad_setups_are_refused_before_anything_starts(argv: list[str]) -> None:
    refused(BENCH, *argv, "--dry-run")


@pytest.mark.slow
def test_cpu_run_with_rollouts_prints_one_row_and_stops_every_replica() -> None:
    (row,) = bench_lines(BENCH, "--replicas", "2", "--hidden-size", "64", "--layers", "2", "--iters", "2",
                         "--rollout-batch", "4", "--rollout-prompt-len", "8", "--rollout-tokens", "6")
    assert (row["backend"], row["device"], row["replicas"], row["shape"], row["target_ratio"]) == ("gloo", "cpu", 2,
                                                                                                  "tiny", 1.5)
    for key in ("one_replica_ms", "fleet_ms", "separate_syncs_ms"):
        assert 0 < row[key]["min"] <= row[key]["median"]
    assert row["ratio"] == round(row["fleet_ms"]["median"] / row["one_replica_ms"]["median"], 3)
    assert row["replica_memory"] == {"kv-cache-bytes": 16 << 20}
    assert row["one_replica_memory"] == {"kv-cache-bytes": 32 << 20}
    fleet, one = row["rollout"]["fleet"], row["rollout"]["one_replica"]
    assert fleet["prompts_per_replica"] == [2, 2] and one["prompts_per_replica"] == [4]
    assert fleet["generated_tokens"] == one["generated_tokens"] == 4 * 6  # seeded, exactly --rollout-tokens each
    assert row["rollout"]["ratio"] == round(fleet["tok_s"] / one["tok_s"], 3)
    assert len(fleet["urls"]) == 2 and len(one["urls"]) == 1
    for url in fleet["urls"] + one["urls"]:  # the fleet, then the one replica: both stopped
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{url}/health", timeout=2.0)
