"""sidecar.fleet_ray on a local Ray cluster (CPU, gloo): two replicas placed as actors, one bundle each;
the hook changes the weights and syncs once; every replica's greedy output equals transformers' on the
new weights; the audit lists every replica's rank; the fleet's metrics show real values, and a replica
taken out shows in_rotation 0; closing the fleet leaves no replica, rank, actor or placement group. A
replica that fails to start is named with its log's tail and nothing of the attempt is left.
Skipped only where Ray is not installed (the `ray` extra; .ci/run installs it through `dev`)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from torch import nn

from inference.core import InvalidRequestError
from inference.models.tiny import default_model_dir
from sidecar.fleet_ray import ReplicaStartError, _plan, fleet_key, place_fleet
from tests.helpers_sidecar import KV_BYTES, REPO, pid_exists
from tests.test_fleet_processes import GREEDY, PROMPTS, _new_weights, _served, _sync
from trainer_hooks import WeightSyncHook

transformers = pytest.importorskip("transformers")

FLAGS = ["--kv-cache-bytes", str(KV_BYTES), "--log-level", "warning"]


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    """A local Ray cluster of 2 CPUs (no dashboard), its files in a directory removed afterwards."""
    ray = pytest.importorskip("ray")
    folder = tempfile.mkdtemp(prefix="ray-")
    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=80 << 20,
             log_to_driver=False, _temp_dir=folder)
    try:
        yield ray
    finally:
        ray.shutdown()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def trainer() -> nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(default_model_dir()).eval()


def _tree(pid: int) -> set[int]:
    import psutil

    try:
        return {pid, *(p.pid for p in psutil.Process(pid).children(recursive=True))}
    except psutil.NoSuchProcess:
        return set()


def _ours() -> list[str]:
    """Replicas and replica actors among this process's descendants (Ray's own processes aside)."""
    import psutil

    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            line = " ".join(p.cmdline())
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        if "sidecar.cli.main launch" in line or "ReplicaProcess" in line:
            found.append(f"{p.pid}: {line}")
    return found


def _all_gone(pids: set[int], timeout: float = 20.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while (alive := sorted(p for p in pids if pid_exists(p))) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


def _metrics(text: str) -> dict[tuple[str, str], float]:
    """{(sample name, replica label or ""): value} of a Prometheus text exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, s.labels.get("replica", "")): s.value for f in text_string_to_metric_families(text)
            for s in f.samples}


def _placement_groups_left(ray: Any) -> list[str]:
    return [pg_id for pg_id, pg in ray.util.placement_group_table().items() if pg["state"] != "REMOVED"]


@pytest.mark.slow
def test_ray_places_replicas_that_sync_once_serve_like_transformers_and_leave_nothing(
        ray_cluster: Any, trainer: nn.Module) -> None:
    fleet = place_fleet(2, device="cpu", launch_args=FLAGS, timeout=60)
    try:
        placed = fleet.placed
        assert [(p.dp_rank, p.tp) for p in placed] == [(0, 1), (1, 1)]
        assert all(p.url.startswith(f"http://{p.node}:") for p in placed)
        # bound to the node's address, so never open: the fleet made a key, and only it gets in
        assert fleet.api_key and all(httpx.get(f"{p.url}/state", timeout=30).status_code == 401 for p in placed)
        processes = set().union(*(_tree(p.pid) | {p.actor_pid} for p in placed))
        assert all(len(_tree(p.pid)) >= 2 for p in placed)  # `sidecar launch` and its rank process
        want = _new_weights(trainer, seed=21)
        with WeightSyncHook(fleet, trainer) as hook:
            report = _sync(hook)
            assert report["ok"] and report["ranks"] == ["dp0:pp0:tp0", "dp1:pp0:tp0"], report
            outs = hook.rollouts(PROMPTS, GREEDY)
            tokens, replicas, versions = _served(outs)
            assert tokens == want and replicas == {0, 1} and versions == {hook.version} == {fleet.version}
            m = _metrics(fleet.metrics_text())
            assert m[("sidecar_fleet_weight_version", "")] == hook.version
            assert m[("sidecar_fleet_replicas_in_rotation", "")] == 2
            for i in (0, 1):
                name = f"dp{i}"
                assert m[("sidecar_fleet_replica_in_rotation", name)] == 1
                assert m[("sidecar_fleet_replica_weight_version", name)] == hook.version
                assert m[("sidecar_fleet_replica_outstanding_sequences", name)] == 0
                assert m[("sidecar_fleet_replica_served_sequences_total", name)] == sum(
                    o.metrics["replica"] == i for o in outs) > 0
                assert m[("sidecar_fleet_replica_taken_out_total", name)] == 0

            fleet.take_out(fleet.replicas[1], "drained by the test")
            m = _metrics(fleet.metrics_text())
            assert m[("sidecar_fleet_replica_in_rotation", "dp1")] == 0
            assert m[("sidecar_fleet_replica_taken_out_total", "dp1")] == 1
            assert m[("sidecar_fleet_replicas_in_rotation", "")] == 1
            tokens, replicas, _ = _served(hook.rollouts(PROMPTS, GREEDY))
            assert tokens == want and replicas == {0}
    finally:
        fleet.close()
    assert _all_gone(processes) == [], "a replica, rank or actor process outlived close()"
    assert _ours() == [] and _placement_groups_left(ray_cluster) == []
    with pytest.raises(ray_cluster.exceptions.RayActorError):
        ray_cluster.get(fleet._placement.actors[0].started.remote(), timeout=30)


@pytest.mark.slow
def test_a_replica_that_fails_to_start_is_named_with_its_log_and_nothing_is_left(ray_cluster: Any) -> None:
    with pytest.raises(ReplicaStartError) as failed:
        place_fleet(2, device="cpu", launch_args=[FLAGS, [*FLAGS, "--no-such-flag"]], startup_timeout_s=60)
    assert list(failed.value.failures) == ["dp1"]
    assert "exited with 2" in str(failed.value) and "unrecognized arguments: --no-such-flag" in str(failed.value)
    deadline = time.monotonic() + 20
    while _ours() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _ours() == [] and _placement_groups_left(ray_cluster) == []


def test_bundles_follow_tp_on_gpus_and_launch_flags_are_checked() -> None:
    plans, extras, bundles = _plan(3, "cuda", [2, 1, 1], ["--model", "m"], 2.0, None, "SPREAD")
    assert bundles == [{"CPU": 2.0, "GPU": 2.0}, {"CPU": 2.0, "GPU": 1.0}, {"CPU": 2.0, "GPU": 1.0}]
    cmd = plans[0].command("10.0.0.5", "cuda", extras[0])
    assert cmd[cmd.index("--dp-rank") + 1] == "0" and cmd[cmd.index("--port") + 1] == "0"
    assert cmd[cmd.index("--devices") + 1] == "0,1" and cmd[-2:] == ["--model", "m"]
    assert [p.gpus for p in plans[1:]] == [(0,), (0,)]  # Ray's CUDA_VISIBLE_DEVICES maps them to the bundle's
    _, _, shared = _plan(4, "cuda", 1, (), 1.0, 0.25, "PACK")
    assert shared == [{"CPU": 1.0, "GPU": 0.25}] * 4
    plans, extras, bundles = _plan(2, "cpu", 1, [["--seed", "1"], ["--seed", "2"]], 1.0, None, "PACK")
    assert bundles == [{"CPU": 1.0}] * 2 and extras == [["--seed", "1"], ["--seed", "2"]]
    assert all(p.gpus is None for p in plans)
    for args, field in (((2, "cuda", 2, (), 1.0, 0.5, "PACK"), "gpus_per_replica"),
                        ((2, "cpu", 1, (), 1.0, 0.5, "PACK"), "gpus_per_replica"),
                        ((2, "auto", 1, (), 1.0, None, "PACK"), "device"),
                        ((2, "cpu", 1, (), 1.0, None, "RANDOM"), "strategy"),
                        ((2, "cpu", 1, [["--seed", "1"]], 1.0, None, "PACK"), "launch_args"),
                        ((2, "cpu", 1, ["--port", "9"], 1.0, None, "PACK"), "port"),
                        ((2, "cpu", [1, 1, 1], (), 1.0, None, "PACK"), "tp")):
        with pytest.raises(InvalidRequestError) as bad:
            _plan(*args)
        assert bad.value.field == field


def test_the_helper_imports_without_ray_torch_or_prometheus() -> None:
    code = ("import sys\nimport sidecar.fleet_ray, trainer_hooks.fleet\n"
            "bad = sorted(m for m in ('ray', 'torch', 'prometheus_client') if m in sys.modules)\nassert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


@pytest.mark.slow
def test_the_fleets_key_is_given_or_made_never_a_launch_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SIDECAR_API_KEY", raising=False)
    assert fleet_key([[]], "given-key") == "given-key"
    made = fleet_key([["--log-level", "info"]], None)
    assert len(made) >= 24 and made != fleet_key([[]], None)
    monkeypatch.setenv("SIDECAR_API_KEY", "from-the-env")
    assert fleet_key([[]], None) == "from-the-env"
    with pytest.raises(InvalidRequestError, match=r"place_fleet\(\.\.\., api_key=KEY\)"):
        fleet_key([["--api-key=x"]], None)
