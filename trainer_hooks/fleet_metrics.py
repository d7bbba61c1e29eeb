"""A Fleet's rotation view as Prometheus metrics, in the trainer's process.

Why here and not in the replicas' /metrics: only the trainer's Fleet knows which replicas are in
rotation, why one was taken out, the fleet's weight version and the sequences it has sent each replica
and not yet received back; a replica knows none of it. So the view is exported where it lives, from one
scrape target, and each replica's own /metrics keeps its engine's figures; the `url` label joins the two.

A scrape reads `Fleet.rotation()` under the fleet's lock and contacts no replica: it costs no HTTP
call, never waits on a slow or dead replica and never changes the rotation (`Fleet.status()` probes).
The metrics and their use: docs/fleet.md, "Metrics".

    from prometheus_client import REGISTRY, start_http_server
    REGISTRY.register(FleetCollector(fleet)); start_http_server(9400)   # or: fleet.metrics_text()
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


class RotationView(Protocol):
    """What a scrape reads of a Fleet (trainer_hooks/fleet.py): its version and `rotation()` rows."""

    version: int | None

    def rotation(self) -> list[dict[str, Any]]: ...

_LABELS = ["replica", "url"]
# (row key, metric name, help) of the per-replica gauges and counters
_GAUGES = (("in_rotation", "sidecar_fleet_replica_in_rotation", "1 while the fleet routes rollouts to the replica"),
           ("outstanding", "sidecar_fleet_replica_outstanding_sequences",
            "Sequences (n per prompt) the fleet sent the replica and has not received back"),
           ("ranks", "sidecar_fleet_replica_ranks", "The replica's rank processes, as last probed"))
_COUNTERS = (("times_out", "sidecar_fleet_replica_taken_out", "Times the replica left rotation"),
             ("retried", "sidecar_fleet_replica_retried_prompts",
              "Prompts moved from the replica to another one (it died mid-request or answered another version)"),
             ("served", "sidecar_fleet_replica_served_sequences", "Sequences the replica returned to the fleet"))


class FleetCollector(Collector):
    """The fleet's view at each scrape (module docstring); register it on any CollectorRegistry.

    Every per-replica metric is labelled replica="dp{i}" and url: sidecar_fleet_replicas,
    sidecar_fleet_replicas_in_rotation, sidecar_fleet_weight_version (absent until the fleet first finds
    one); sidecar_fleet_replica_in_rotation (1/0), _weight_version (the target version it was admitted at;
    absent until admitted), _outstanding_sequences, _ranks; counters sidecar_fleet_replica_taken_out_total,
    _retried_prompts_total (prompts moved from it to another replica), _served_sequences_total.
    """

    def __init__(self, fleet: RotationView) -> None:
        self.fleet = fleet

    def collect(self) -> Iterator[Metric]:
        rows = self.fleet.rotation()
        version = self.fleet.version
        yield GaugeMetricFamily("sidecar_fleet_replicas", "Replicas in the fleet", value=len(rows))
        yield GaugeMetricFamily("sidecar_fleet_replicas_in_rotation", "Replicas the fleet routes rollouts to",
                                value=sum(r["in_rotation"] for r in rows))
        fleet_version = GaugeMetricFamily("sidecar_fleet_weight_version", "The fleet's target weight version")
        if version is not None:
            fleet_version.add_metric([], version)
        yield fleet_version
        held = GaugeMetricFamily("sidecar_fleet_replica_weight_version",
                                 "The target weight version the replica was admitted at", labels=_LABELS)
        for r in rows:
            if r["version"] is not None:
                held.add_metric([r["replica"], r["url"]], r["version"])
        yield held
        for key, name, doc in _GAUGES:
            gauge = GaugeMetricFamily(name, doc, labels=_LABELS)
            for r in rows:
                gauge.add_metric([r["replica"], r["url"]], float(r[key]))
            yield gauge
        for key, name, doc in _COUNTERS:
            counter = CounterMetricFamily(name, doc, labels=_LABELS)
            for r in rows:
                counter.add_metric([r["replica"], r["url"]], r[key])
            yield counter

    def describe(self) -> Iterator[Metric]:
        return iter(())  # read fresh at every scrape


def metrics_text(fleet: RotationView) -> str:
    """The fleet's metrics in Prometheus' text exposition format."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FleetCollector(fleet))
    return generate_latest(registry).decode()
