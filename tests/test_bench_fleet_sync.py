"""scripts/bench_fleet_sync.py: the launches the H200 run makes (four replicas sharing GPU 0 against one
replica with their memory), and the whole script on CPU over gloo with rollouts (2 tiny replicas), which
shares every code path with the H200 run except the device and the backend."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from scripts import bench_fleet_sync as bench

H200 = ["--device", "cuda", "--backend", "ipc", "--shape", "qwen2-0.5b", "--replicas", "4", "--rollout-batch", "128"]


def _after_dashdash(cmd: list[str], flag: str) -> str:
    """The value of a `sidecar launch` flag (after --) in a `sidecar fleet` command."""
    launch = cmd[cmd.index("--") + 1:]
    return launch[launch.index(flag) + 1]


def _fleet_flag(cmd: list[str], flag: str) -> str:
    own = cmd[:cmd.index("--")]
    return own[own.index(flag) + 1]


def test_h200_fleet_shares_gpu_0_and_the_one_replica_gets_all_its_memory() -> None:
    args = bench.parse_args(H200)
    fleet = bench.launch_command(args, bench.Path("/m"), one=False)
    one = bench.launch_command(args, bench.Path("/m"), one=True)
    assert _fleet_flag(fleet, "--replicas") == "4" and _fleet_flag(fleet, "--gpus") == "0,0,0,0"
    assert _fleet_flag(one, "--replicas") == "1" and _fleet_flag(one, "--gpus") == "0"
    for cmd in (fleet, one):
        assert _fleet_flag(cmd, "--device") == "cuda" and _after_dashdash(cmd, "--model") == "/m"
        assert _after_dashdash(cmd, "--max-model-len") == "256"
    assert int(_after_dashdash(one, "--kv-cache-bytes")) == 4 * int(_after_dashdash(fleet, "--kv-cache-bytes"))
    assert _after_dashdash(fleet, "--max-num-seqs") == "32" and _after_dashdash(one, "--max-num-seqs") == "128"
    shares = bench.parse_args([*H200, "--gpu-memory-utilization", "0.2"])
    fleet, one = (bench.launch_command(shares, bench.Path("/m"), one=x) for x in (False, True))
    assert _after_dashdash(fleet, "--gpu-memory-utilization") == "0.2" and "--kv-cache-bytes" not in fleet
    assert _after_dashdash(one, "--gpu-memory-utilization") == "0.8" and "--kv-cache-bytes" not in one


def test_the_cpu_default_launch_is_unchanged() -> None:
    cmd = bench.launch_command(bench.parse_args([]), bench.Path("/m"), one=False)
    assert cmd[cmd.index("fleet"):] == ["fleet", "--replicas", "3", "--tp", "1,1,1", "--port", "0", "--device", "cpu",
                                        "--startup-timeout-s", "300.0", "--", "--model", "/m", "--log-level",
                                        "warning", "--kv-cache-bytes", str(16 << 20)]


@pytest.mark.parametrize("argv", [["--backend", "ipc"], ["--rollout-batch", "-1"],
                                  ["--replicas", "4", "--gpu-memory-utilization", "0.3", "--device", "cuda"]])
def test_bad_setups_are_refused_before_anything_starts(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv)
    assert e.value.code == 2


def test_a_trainer_step_writes_new_bytes_into_the_same_storages() -> None:
    weights = {"a": torch.arange(6.0).reshape(3, 2), "b": torch.tensor([1.0, 2.0, 3.0])}
    ptrs = {k: t.data_ptr() for k, t in weights.items()}
    bench.trainer_step(weights)
    assert {k: t.data_ptr() for k, t in weights.items()} == ptrs  # ipc keeps its handles
    assert weights["a"].tolist() == [[4.0, 5.0], [0.0, 1.0], [2.0, 3.0]] and weights["b"].tolist() == [3.0, 1.0, 2.0]


def test_rollout_requests_are_seeded_and_of_fixed_length() -> None:
    args = bench.parse_args(["--rollout-batch", "3", "--rollout-prompt-len", "5", "--rollout-tokens", "7"])
    prompts, params = bench.rollout_requests(args, vocab=100)
    assert (prompts, params) == bench.rollout_requests(args, vocab=100)
    assert [len(p) for p in prompts] == [5, 5, 5] and all(4 <= t < 100 for p in prompts for t in p)
    assert [p.seed for p in params] == [0, 1, 2]
    assert all(p.ignore_eos and p.max_tokens == 7 and p.temperature == 1.0 for p in params)


@pytest.mark.slow
def test_cpu_run_with_rollouts_prints_one_row_and_stops_every_replica(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    served: list[list[str]] = []
    real = bench.time_rollout

    def recording(urls: list[str], *a: object) -> dict:
        served.append(list(urls))
        return real(urls, *a)

    monkeypatch.setattr(bench, "time_rollout", recording)
    assert bench.main(["--replicas", "2", "--hidden-size", "64", "--layers", "2", "--iters", "2",
                       "--rollout-batch", "4", "--rollout-prompt-len", "8", "--rollout-tokens", "6"]) == 0
    row = json.loads(capsys.readouterr().out.strip())
    assert (row["backend"], row["device"], row["replicas"], row["shape"], row["target_ratio"]) == ("gloo", "cpu", 2,
                                                                                                  "tiny", 1.5)
    for key in ("one_replica_ms", "fleet_ms", "separate_syncs_ms"):
        assert 0 < row[key]["min"] <= row[key]["median"]
    assert row["ratio"] == round(row["fleet_ms"]["median"] / row["one_replica_ms"]["median"], 3)
    assert row["replica_memory"] == {"kv-cache-bytes": 16 << 20}
    assert row["one_replica_memory"] == {"kv-cache-bytes": 32 << 20}
    fleet, one = row["rollout"]["fleet"], row["rollout"]["one_replica"]
    assert fleet["prompts_per_replica"] == [2, 2] and one["prompts_per_replica"] == [4]
    assert fleet["generated_tokens"] == one["generated_tokens"] == 4 * 6
    assert row["rollout"]["ratio"] == round(fleet["tok_s"] / one["tok_s"], 3)
    assert len(served) == 2 and len(served[0]) == 2 and len(served[1]) == 1
    for url in served[0] + served[1]:  # the fleet, then the one replica: both stopped
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{url}/health", timeout=2.0)
