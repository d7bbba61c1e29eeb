"""Prometheus metrics of one sidecar, on a registry of its own (never the process-global one).

Timings (sync, sleep, wake) are observed by the HTTP layer around each call; generation figures
(tokens, tokens/s, queue depth, health) are read from the driver at scrape time, so they cost
nothing between scrapes. prometheus-client is imported here only (the `server` extra).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

_SECONDS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class GenerationSource(Protocol):
    """What the scrape reads (the Driver provides it)."""

    tokens_total: int

    def tokens_per_second(self) -> float: ...

    def queue_depth(self) -> int: ...

    def queued_sequences(self) -> int: ...

    @property
    def failure(self) -> str | None: ...

    @property
    def paused(self) -> bool: ...

    def held_weights(self) -> dict[str, dict[str, Any]]: ...

    engine_counters: dict[str, int]  # sidecar/ranks/driver.py ENGINE_COUNTERS, over finished requests


_ENGINE_DOCS = {
    "prefix_cache_hit_tokens": "Prompt tokens of finished requests served from the prefix cache",
    "draft_tokens_proposed": "Draft tokens proposed for finished requests (a draft model, or the batch-invariant "
                             "mode's own draft)",
    "draft_tokens_accepted": "Draft tokens the target accepted (with the mode's own draft: where the default and "
                             "the mode's kernels sampled the same token)",
    "preemptions": "Times a finished request's sequences were preempted for KV blocks (and recomputed)",
}


class Metrics:
    def __init__(self, source: GenerationSource) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.sync_seconds = Histogram("sidecar_weight_sync_seconds", "Seconds of one weight-sync phase",
                                      ["model", "phase"], registry=r, buckets=_SECONDS)
        self.sync_bytes = Counter("sidecar_weight_sync_bytes", "Bytes of weights received by successful syncs",
                                  ["model"], registry=r)
        self.syncs = Counter("sidecar_weight_syncs", "Weight syncs by result", ["model", "result"], registry=r)
        self.sleep_seconds = Histogram("sidecar_sleep_seconds", "Seconds of one sleep", ["level"],
                                       registry=r, buckets=_SECONDS)
        self.wake_seconds = Histogram("sidecar_wake_seconds", "Seconds of one wake-up", registry=r,
                                      buckets=_SECONDS)
        self.audit_failures = Counter("sidecar_audit_failures", "Audits (and sync finishes) that found a mismatch",
                                      registry=r)
        self.http_errors = Counter("sidecar_http_errors", "Error responses by status", ["status"], registry=r)
        r.register(_GenerationCollector(source))

    def add_gauge(self, name: str, doc: str, read: Callable[[], float]) -> None:
        """A gauge read at scrape time by `read` (on the event loop: the scrape is an async route)."""
        self.registry.register(_ReadGauge(name, doc, read))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _GenerationCollector(Collector):
    def __init__(self, source: GenerationSource) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        s = self.source
        yield CounterMetricFamily("sidecar_generated_tokens", "Tokens generated (finished requests)",
                                  value=s.tokens_total)
        yield _gauge("sidecar_generation_tokens_per_second", "Generated tokens per second over the last 10 s",
                     s.tokens_per_second())
        yield _gauge("sidecar_queue_depth", "Prompts accepted and not yet answered", s.queue_depth())
        yield _gauge("sidecar_queued_sequences", "Sequences (n per prompt) accepted and not yet answered, "
                     "bounded by --max-queued-sequences", s.queued_sequences())
        yield _gauge("sidecar_healthy", "1 while every rank process is alive and answering", s.failure is None)
        yield _gauge("sidecar_paused", "1 while generation is paused", s.paused)
        for name, value in getattr(s, "engine_counters", {}).items():
            yield CounterMetricFamily(f"sidecar_{name}", _ENGINE_DOCS[name], value=value)
        held = s.held_weights() if hasattr(s, "held_weights") else {}
        version = GaugeMetricFamily("sidecar_weight_version", "The live weight version of each model", labels=["model"])
        stale = GaugeMetricFamily("sidecar_weights_need_sync", "1 while some rank's bytes of the model are not its "
                                  "live version's (torn, or dropped by a level-2 sleep): only a sync fixes it",
                                  labels=["model"])
        for model, view in sorted(held.items()):
            version.add_metric([model], float(view["version"]))
            stale.add_metric([model], float(view["needs_sync"] is not None))
        yield version
        yield stale

    def describe(self) -> Iterator[Metric]:
        return iter(())  # collected fresh at every scrape


class _ReadGauge(Collector):
    def __init__(self, name: str, doc: str, read: Callable[[], float]) -> None:
        self.name, self.doc, self.read = name, doc, read

    def collect(self) -> Iterator[Metric]:
        yield _gauge(self.name, self.doc, self.read())

    def describe(self) -> Iterator[Metric]:
        return iter(())


def _gauge(name: str, doc: str, value: Any) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=float(value))
