"""trainer_hooks.fleet_metrics against fake replicas: the fleet's rotation view in Prometheus form
(versions after a sync, outstanding sequences while a call runs, served and retried counters, a replica
taken out at 0), read without contacting any replica. With real replicas on Ray: tests/test_fleet_ray.py."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from inference.core import SamplingParams
from tests.test_fleet import FakeReplica, FakeSender, _fleet, _three
from trainer_hooks.fleet_metrics import FleetCollector

prometheus_client = pytest.importorskip("prometheus_client")


def _metrics(text: str) -> dict[tuple[str, str], float]:
    """{(sample name, replica label or ""): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, s.labels.get("replica", "")): s.value for f in text_string_to_metric_families(text)
            for s in f.samples}


def test_metrics_show_versions_served_retried_and_a_replica_taken_out() -> None:
    reps = _three()
    with _fleet(*reps) as fleet:
        m = _metrics(fleet.metrics_text())
        assert ("sidecar_fleet_weight_version", "") not in m  # no version known before first contact
        assert ("sidecar_fleet_replica_weight_version", "dp0") not in m
        assert m[("sidecar_fleet_replicas", "")] == 3 and m[("sidecar_fleet_replica_ranks", "dp0")] == 0
        fleet.sync_weights(FakeSender, {"w": 0}, 4)
        fleet.generate([[1], [2], [3]], [SamplingParams(n=4, max_tokens=1), *[SamplingParams(max_tokens=1)] * 2])
        m = _metrics(fleet.metrics_text())
        assert m[("sidecar_fleet_weight_version", "")] == 4 and m[("sidecar_fleet_replicas_in_rotation", "")] == 3
        assert [m[("sidecar_fleet_replica_weight_version", f"dp{i}")] for i in range(3)] == [4, 4, 4]
        assert [m[("sidecar_fleet_replica_ranks", f"dp{i}")] for i in range(3)] == [2, 1, 1]
        assert [m[("sidecar_fleet_replica_served_sequences_total", f"dp{i}")] for i in range(3)] == [4, 1, 1]
        reps[1].alive = False
        fleet.generate([[1], [2], [3]])  # dp1 dies mid-request: its prompt moves to another replica
        m = _metrics(fleet.metrics_text())
        assert m[("sidecar_fleet_replica_in_rotation", "dp1")] == 0
        assert m[("sidecar_fleet_replicas_in_rotation", "")] == 2
        assert m[("sidecar_fleet_replica_taken_out_total", "dp1")] == 1
        assert m[("sidecar_fleet_replica_retried_prompts_total", "dp1")] == 1
        assert m[("sidecar_fleet_replica_weight_version", "dp1")] == 4  # what it was admitted at, still
        served = sum(m[("sidecar_fleet_replica_served_sequences_total", f"dp{i}")] for i in range(3))
        assert served == 6 + 3
        fleet.sync_weights(FakeSender, {"w": 0}, 5)  # dp1 misses it too: out once, counted once
        m = _metrics(fleet.metrics_text())
        assert m[("sidecar_fleet_replica_taken_out_total", "dp1")] == 1
        assert m[("sidecar_fleet_replica_weight_version", "dp0")] == 5 == m[("sidecar_fleet_weight_version", "")]
        assert m[("sidecar_fleet_replica_weight_version", "dp1")] == 4


def test_outstanding_sequences_show_while_a_call_runs_and_a_scrape_contacts_no_replica() -> None:
    reps = [FakeReplica("http://a"), FakeReplica("http://b")]
    release, entered = threading.Event(), threading.Event()
    generate, probes = reps[0].generate, []

    def slow(*a: Any, **k: Any) -> Any:
        entered.set()
        release.wait(30)
        return generate(*a, **k)

    reps[0].generate = slow  # type: ignore[method-assign]
    with _fleet(*reps) as fleet:
        fleet.status()
        for r in reps:
            state = r.state
            r.state = lambda state=state: probes.append(1) or state()  # type: ignore[method-assign]
        with ThreadPoolExecutor(1) as pool:
            call = pool.submit(fleet.generate, [[1], [2]], [SamplingParams(n=3, max_tokens=1),
                                                            SamplingParams(n=1, max_tokens=1)])
            assert entered.wait(30)
            registry = prometheus_client.CollectorRegistry()
            registry.register(FleetCollector(fleet))
            m = _metrics(prometheus_client.generate_latest(registry).decode())
            assert m[("sidecar_fleet_replica_outstanding_sequences", "dp0")] == 3
            release.set()
            call.result(30)
        assert probes == []  # neither scrape above nor below asked a replica anything
        m = _metrics(fleet.metrics_text())
        assert m[("sidecar_fleet_replica_outstanding_sequences", "dp0")] == 0
        assert m[("sidecar_fleet_replica_served_sequences_total", "dp0")] == 3
