"""Benchmark one weight sync through the user-facing path: SidecarClient.sync_weights over HTTP.

A `sidecar launch` subprocess serves --model (tiny or qwen2-0.5b, built as `sidecar demo` builds them);
this process is the trainer: a WeightSender holding the checkpoint's own tensors on --device, joined
once with connect_sender. Each digest rule is measured in the same run: the one the sender picks for
its tensors (the device rule, "xxh3_64_seg64k", for CUDA tensors) and the other one for comparison
(set on the sender, `digest_algorithm`). Each is measured on the sync's one path (ONE request: the update
carries the start, the sender delivers its digests over the group, the answer is the audit). Per rule,
after --warmup syncs, each of --iters syncs is timed on the client:
- sync_audit_ms: the whole sync_weights call, whose answer carries the audit (every rank compared what it
  holds with the sender's digests, and the version is live);
- sync_ms: the same call until sender.send() returned (the bytes in place on every rank and the sender's
  digests delivered to them): sync_audit_ms minus the audit's tail;
- per phase: the update's client-side time and sender.send();
- requests_per_sync: the HTTP requests one sync made (1);
- server_*_ms: the mean time the sidecar's handlers report for the same calls (its Prometheus histogram
  sidecar_weight_sync_seconds: start, update, finish; "audit" is the ranks' part of finish), i.e. the
  same bytes moved and checked with no HTTP or client in the way; `ratio` is client / server;
- control_ms: per call, the client's time minus the handler's own time that the sidecar reports on that
  answer (its Server-Timing header, `handler`: the same span its histogram observes, the start included
  when it rode on the update), median: what HTTP, JSON and the framework add to a control message
  (against a sidecar without that header: the client's median minus the histogram's mean);
- wire_ms: per call, the client's time minus the app's time in the same header (framework, body and
  handler), median: the client's HTTP code, TCP and the server's HTTP parser. control_ms minus wire_ms
  is the server framework's share (routing, validation, the answer's JSON).
- hops_ms: per call, the handler's time minus the slowest rank's own time on its command (Server-Timing
  `ranks`, /weights/update only), median: the sidecar's hops inside the handler (the driver thread, the
  rank pipe both ways, the event loop's wake), which no HTTP figure above shows.
- round_trip_ms: median client time of a bare control message with no sync around it (GET /health,
  GET /state), the floor of what any control message costs end to end.
Prints one JSON line: the picked rule's figures at the top level, every rule's under "by_algorithm".
CPU: --model tiny --backend gloo --device cpu (the defaults); H200: --model qwen2-0.5b --backend ipc
--device cuda.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

from checksum import ALGORITHMS, pick_algorithm
from inference.transfer.sender import WeightSender
from sidecar.cli.demo import SidecarProcess
from sidecar.client import SidecarClient
from sidecar.demo.task import DemoModel, resolve_model
from trainer_hooks.wire import Wire

PHASES = ("start", "update", "finish", "audit")  # the sidecar's sync_seconds phases (start and audit inside the update)
_PATHS = {"/weights/update": "update"}


class _Setup:
    """What SidecarProcess.start reads (the demo's setup, reduced to the launch fields)."""

    def __init__(self, model: DemoModel, device: str, backend: str) -> None:
        self.model, self.device, self.backend = model, device, backend


class TimedClient(SidecarClient):
    """A SidecarClient that records each weight call's wall time (ms) by phase."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.times: dict[str, list[float]] = defaultdict(list)
        self.wire_ms: dict[str, list[float]] = defaultdict(list)  # per call: client time minus Server-Timing app
        self.control: dict[str, list[float]] = defaultdict(list)  # per call: client time minus the handler's
        self.hops: dict[str, list[float]] = defaultdict(list)  # per call: handler time minus the ranks' own
        self.requests = 0

        self.wire._send = self._timed_send  # type: ignore[method-assign]

    def _timed_send(self, method: str, path: str, *args: Any) -> Callable[[], Any]:
        """Every request passes here (trainer_hooks/wire.py): timed from its write to its answer read (an
        update is written before send() starts and read once it returned)."""
        self.requests += 1
        t0 = time.perf_counter()
        read = Wire._send(self.wire, method, path, *args)

        def timed() -> Any:
            resp = None
            try:
                resp = read()
                return resp
            finally:
                if path in _PATHS:
                    ms = (time.perf_counter() - t0) * 1e3
                    self.times[_PATHS[path]].append(ms)
                    app, handler, ranks = _server_timing(resp)
                    if app is not None:
                        self.wire_ms[_PATHS[path]].append(ms - app)
                    if handler is not None:
                        self.control[_PATHS[path]].append(ms - handler)
                    if handler is not None and ranks is not None:
                        self.hops[_PATHS[path]].append(handler - ranks)

        return timed


def _server_timing(resp: Any) -> tuple[float | None, float | None, float | None]:
    """The sidecar's `Server-Timing` app, handler and ranks durations (ms; sidecar/api/guard.py), None
    where absent."""
    header = resp.headers.get("server-timing", "") if resp is not None else ""
    found = dict(re.findall(r"(app|handler|ranks);dur=([0-9.]+)", header))
    keys = ("app", "handler", "ranks")
    return tuple(float(found[k]) if k in found else None for k in keys)  # type: ignore[return-value]


@contextmanager
def timed_send(sender: WeightSender, times: dict[str, list[float]], ends: list[float]) -> Iterator[None]:
    """Time each sender.send() into times["send"] (ms) and note when it returned in `ends` (perf_counter)."""
    real = sender.send

    def send(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            ends.append(time.perf_counter())
            times["send"].append((ends[-1] - t0) * 1e3)

    sender.send = send  # type: ignore[method-assign]
    try:
        yield
    finally:
        del sender.send


def server_sums(client: SidecarClient) -> dict[str, float]:
    """Seconds summed per phase of sidecar_weight_sync_seconds for the target model."""
    sums = dict.fromkeys(PHASES, 0.0)
    pattern = re.compile(r'^sidecar_weight_sync_seconds_sum\{(?P<labels>[^}]*)\} (?P<value>\S+)$')
    for line in client.metrics().splitlines():
        m = pattern.match(line)
        if m and 'model="target"' in m["labels"]:
            phase = re.search(r'phase="(\w+)"', m["labels"])
            if phase and phase[1] in sums:
                sums[phase[1]] = float(m["value"])
    return sums


def load_weights(model: DemoModel, device: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v.to(device).contiguous().clone() for k, v in load_file(str(model.path / "model.safetensors")).items()}


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = resolve_model(args.model)
    weights = load_weights(model, args.device)
    picked = pick_algorithm(weights.values())
    server = SidecarProcess.start(_Setup(model, args.device, args.backend),  # type: ignore[arg-type]
                                  kv_bytes=args.kv_bytes, seed=0, timeout=600)
    sender = WeightSender(args.backend, num_receivers=1, timeout_s=300, device=args.device)
    version = 0
    try:
        with TimedClient(server.url, timeout=300) as client:
            client.connect_sender(sender)
            runs = {}
            for algorithm in (picked, *(a for a in ALGORITHMS if a != picked)):
                sender.digest_algorithm = algorithm
                runs[algorithm], version = measure(args, client, sender, weights, version)
            out = {"bench": "client_sync", "model": args.model, "backend": args.backend, "device": args.device,
                   "tensors": len(weights), "bytes": sum(t.numel() * t.element_size() for t in weights.values()),
                   "iters": args.iters, "algorithm": picked, **runs[picked], "by_algorithm": runs,
                   "round_trip_ms": round_trips(client)}
            return out
    finally:
        sender.close()
        server.stop()


def round_trips(client: SidecarClient, n: int = 50) -> dict[str, float]:
    """Median client ms of a bare control message with no sync around it: GET /health (no engine work)
    and GET /state (the engine's state, through the driver): what HTTP, the framework and the hop to the
    driver cost a message on their own, apart from the sender's work an update's time includes."""
    out = {}
    for name, call in (("health", client.health), ("state", client.state)):
        call()
        laps = []
        for _ in range(n):
            t0 = time.perf_counter()
            call()
            laps.append((time.perf_counter() - t0) * 1e3)
        out[name] = round(statistics.median(laps), 3)
    return out


def measure(args: argparse.Namespace, client: TimedClient, sender: WeightSender, weights: dict[str, torch.Tensor],
            version: int) -> tuple[dict[str, Any], int]:
    """--warmup then --iters syncs under the sender's current rule; (figures, last version)."""
    for _ in range(args.warmup):
        version += 1
        client.sync_weights(sender, weights, version=version)
    client.times.clear()
    client.wire_ms.clear()
    client.control.clear()
    client.hops.clear()
    before = server_sums(client)
    requests = client.requests
    totals, syncs, ends = [], [], []
    with timed_send(sender, client.times, ends):
        for _ in range(args.iters):
            version += 1
            t0 = time.perf_counter()
            result = client.sync_weights(sender, weights, version=version)
            t1 = time.perf_counter()
            totals.append((t1 - t0) * 1e3)
            syncs.append((ends[-1] - t0) * 1e3)
            if not result["ok"] or result.get("algorithm") != sender.digest_algorithm:
                raise SystemExit(f"audit failed or of another rule:\n{result.get('table')}")
    per_sync = (client.requests - requests) / args.iters
    after = server_sums(client)
    out = summary(args, client.times, totals, syncs, before, after)
    if client.control:  # per call, median: robust where the histogram's mean is not (one slow call)
        out["control_ms"] = {k: round(statistics.median(v), 3) for k, v in client.control.items() if v}
    out["wire_ms"] = {k: round(statistics.median(v), 3) for k, v in client.wire_ms.items() if v}
    out["hops_ms"] = {k: round(statistics.median(v), 3) for k, v in client.hops.items() if v}
    return {**out, "requests_per_sync": per_sync}, version


def summary(args: argparse.Namespace, times: dict[str, list[float]], totals: list[float], syncs: list[float],
            before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    med = {k: statistics.median(v) for k, v in times.items() if v}
    server = {p: (after[p] - before[p]) * 1e3 / args.iters for p in PHASES}
    sync_ms, sync_audit_ms = statistics.median(syncs), statistics.median(totals)
    server_sync = server["start"] + server["update"]
    server_audit = server_sync + server["finish"]
    return {
        "sync_ms": round(sync_ms, 2), "sync_audit_ms": round(sync_audit_ms, 2),
        "server_sync_ms": round(server_sync, 2), "server_sync_audit_ms": round(server_audit, 2),
        "ratio_sync": round(sync_ms / server_sync, 3) if server_sync else None,
        "ratio_sync_audit": round(sync_audit_ms / server_audit, 3) if server_audit else None,
        "control_ms": control_ms(med, server),
        "client_phase_ms": {k: round(v, 2) for k, v in med.items()},
        "server_phase_ms": {k: round(v, 2) for k, v in server.items()},
    }


def control_ms(client: dict[str, float], server: dict[str, float]) -> dict[str, float]:
    """Client minus server per HTTP call; an update that carried the start (and finish) is compared with
    all it carried."""
    out = {p: round(client[p] - server[p], 3) for p in ("start", "finish") if p in client}
    if "update" in client:
        carried = sum(server[p] for p in ("start", "finish") if p not in client)
        out["update"] = round(client["update"] - server["update"] - carried, 3)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help="tiny, qwen2-0.5b or a model directory")
    p.add_argument("--backend", default="gloo", choices=("gloo", "ipc"))
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--kv-bytes", type=int, default=None, help="KV cache bytes (default 4 MB cpu, 64 MiB cuda)")
    args = p.parse_args()
    if args.kv_bytes is None:
        args.kv_bytes = 4_000_000 if args.device == "cpu" else 64 * 2**20
    if args.device == "cuda":
        torch.cuda.set_device(0)
    print(json.dumps(run(args)), flush=True)


if __name__ == "__main__":
    main()
