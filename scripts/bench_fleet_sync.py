"""Time one weight sync of a fleet of replicas against one replica's, over gloo on the CPU.

    python scripts/bench_fleet_sync.py [--replicas 3] [--tp 1] [--hidden-size 512] [--layers 4] [--iters 5]

`sidecar fleet` starts --replicas replicas of a random model of the tiny family (written to a temporary
directory at the given width and depth, so that the bytes, not the HTTP calls, dominate); this process
is the trainer. The same processes are measured twice: as a Fleet of the first replica alone, then as a
Fleet of all of them, each after one warm-up sync (which joins the group and sends the layout). A fleet
sync puts every rank of every replica in ONE transfer group, so the bytes go out in one broadcast; the
issue's acceptance asks for a fleet sync under 1.5x one replica's. Each timed sync is
Fleet.sync_weights (a /state per replica, start, update beside send, finish with its per-rank audit).
For comparison it also times the same replicas synced one after the other, each in a group of its own
(what one hook per replica would do: "separate_syncs_ms"). Prints one JSON line: the medians (ms), the
ratios to one replica, the model's bytes and the setup. A script, not a test: on a shared machine a
timed assertion would fail for reasons of load; the receivers' unpacking and digests compete for the
same cores on one machine, so a CPU run overstates what a fleet costs where each replica has its own.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from inference.tiny import TinyModelSpec, random_weights, write_model_dir
from inference.transfer.sender import WeightSender
from trainer_hooks.fleet import Fleet

TARGET_RATIO = 1.5


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=3, help="replicas in the fleet (default: 3)")
    p.add_argument("--tp", default="1", help="tensor-parallel size of each replica, or one per replica (default: 1)")
    p.add_argument("--hidden-size", type=int, default=512, help="model width (default: 512)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (default: 4)")
    p.add_argument("--iters", type=int, default=5, help="timed syncs per configuration (default: 5)")
    p.add_argument("--timeout-s", type=float, default=300.0, help="startup and transfer timeout (default: 300)")
    args = p.parse_args()
    spec = TinyModelSpec(seed=1, hidden_size=args.hidden_size, num_layers=args.layers,
                         intermediate_size=args.hidden_size * 11 // 4, num_heads=8, num_kv_heads=4)
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
        model_dir = write_model_dir(spec, Path(tmp) / "model")
        weights = [random_weights(dataclasses.replace(spec, seed=s)) for s in (2, 3)]
        with fleet_process(args.replicas, args.tp, model_dir, args.timeout_s) as urls:
            one = time_syncs([urls[:1]], weights, args.iters, args.timeout_s, first_version=1)
            many = time_syncs([urls], weights, args.iters, args.timeout_s, first_version=1000)
            apart = time_syncs([[u] for u in urls], weights, args.iters, args.timeout_s, first_version=2000)
    nbytes = sum(t.numel() * t.element_size() for t in weights[0].values())
    print(json.dumps({
        "bench": "fleet_sync", "backend": "gloo", "device": "cpu", "replicas": args.replicas, "tp": args.tp,
        "model_bytes": nbytes, "iters": args.iters, "one_replica_ms": one, "fleet_ms": many,
        "ratio": round(many["median"] / one["median"], 3), "target_ratio": TARGET_RATIO,
        "separate_syncs_ms": apart, "separate_ratio": round(apart["median"] / one["median"], 3),
    }))
    return 0


def time_syncs(fleets: list[list[str]], weights: list[dict[str, Any]], iters: int, timeout_s: float,
               first_version: int) -> dict[str, float]:
    """Median and min (ms) of `iters` rounds after one warm-up round; a round syncs every fleet in turn
    (several one-replica fleets: a sync per replica, each in its own group, as one hook per replica
    would do)."""
    make = lambda n: WeightSender("gloo", num_receivers=n, timeout_s=timeout_s)
    times = []
    made = [Fleet(urls, timeout=timeout_s) for urls in fleets]
    try:
        for k in range(iters + 1):
            t0 = time.perf_counter()
            for fleet in made:
                report = fleet.sync_weights(make, weights[k % 2], first_version + k)
                if not report["ok"] or report["out_of_rotation"]:
                    raise SystemExit(f"sync {k} failed: {report['summary']}\n{report['table']}")
            if k:
                times.append((time.perf_counter() - t0) * 1e3)
    finally:
        for fleet in made:
            fleet.close()
    return {"median": round(statistics.median(times), 2), "min": round(min(times), 2)}


@contextmanager
def fleet_process(replicas: int, tp: str, model_dir: Path, timeout_s: float) -> Iterator[list[str]]:
    """`sidecar fleet` on free ports; its URLs; SIGTERM (every replica stops) on exit."""
    cmd = [sys.executable, "-m", "sidecar.cli", "fleet", "--replicas", str(replicas), "--tp", tp, "--port", "0",
           "--device", "cpu", "--startup-timeout-s", str(timeout_s), "--", "--model", str(model_dir),
           "--kv-cache-bytes", str(16 << 20), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            match = re.match(r"Sidecar fleet serving on (.+)", line)
            if match:
                yield match.group(1).split()
                break
        else:
            raise SystemExit(f"sidecar fleet exited with {proc.wait()} before serving")
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        proc.wait(120)


if __name__ == "__main__":
    sys.exit(main())
