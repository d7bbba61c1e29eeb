"""Benchmark sleep and wake of the memory arenas against the pinned-copy ceiling and torch_memory_saver.

Prints one JSON line per (scope, level). Scope "weights" releases the weights arena alone, exactly the
bytes torch_memory_saver is given, and is the headline comparison: level 1 against the pinned copy
ceiling and the peer with CPU backup, level 2 against the 20 ms target and the peer without backup
("accepted" holds both). Scope "worker" adds the KV arena (weights + KV, what a worker releases) and
is reported on its own, without peer ratios. `*_s` figures are wall-clock medians of the whole call, as
the peer's are; freed bytes come from cudaMemGetInfo around the call, outside the timing (the peer's
too). Level 2 and the peer without backup alternate cycle by cycle in one process (who goes first
alternates too), and every wake, ours and the peer's, comes --gap-ms after its sleep: on the H200 the
driver makes every other 15 GB cuMemCreate that follows a release at once take ~50-60 ms (the peer's
too: it is the driver's, not the caller's), while one that follows 100 ms later takes ~5 ms; a real
wake follows a training step. --verbose adds
each transition's driver calls (count and seconds) and the cost of the host-side calls around them.

    python scripts/bench/sleep.py                        # Qwen2.5-7B bf16 shape (15.2 GB) on cuda
    python scripts/bench/sleep.py --alloc-mib 1024       # 1 GiB physical allocations instead of one
    python scripts/bench/sleep.py --device cpu --gb 0.01 # smoke test
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

from inference.memory.arenas import KV_TAG, Arena, round_up
from inference.memory.sleep import MemoryManager
from scripts.bench.sleep_peer import PeerCycles, load_peer, peer_cycles

# Qwen2.5-7B: untied embeddings, qkv biases.
QWEN25_7B = {"hidden": 3584, "intermediate": 18944, "layers": 28, "heads": 28, "kv_heads": 4, "vocab": 152064}
LEVEL2_TARGET_S = 0.020


def qwen_shapes(gb: float | None) -> list[tuple[int, ...]]:
    """Parameter shapes of the Qwen2.5-7B layout, with hidden, intermediate and vocab scaled by one
    factor so the bf16 total is about `gb` GB (None: the full 15.2 GB)."""
    full = _shapes(**QWEN25_7B)
    full_bytes = 2 * sum(math.prod(s) for s in full)
    if gb is None or gb * 1e9 >= full_bytes:
        return full
    f = math.sqrt(gb * 1e9 / full_bytes)
    dims = {k: max(8, round(QWEN25_7B[k] * f / 8) * 8) for k in ("hidden", "intermediate", "vocab")}
    return _shapes(**dims, layers=28, heads=28, kv_heads=4)


def _shapes(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int) -> list:
    kv = max(1, hidden * kv_heads // heads)
    layer = [(hidden, hidden), (hidden,), (kv, hidden), (kv,), (kv, hidden), (kv,), (hidden, hidden)]
    layer += [(intermediate, hidden), (intermediate, hidden), (hidden, intermediate), (hidden,), (hidden,)]
    return [(vocab, hidden), *(layer * layers), (hidden,), (vocab, hidden)]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_free(device: torch.device) -> int | None:
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None


def fingerprint(arena: Arena) -> int:
    """An exact (integer, order-free) digest of the arena's bytes."""
    return int(arena.base.view(torch.int64).sum().item())


def copy_bandwidth(arena: Arena, sample_bytes: int) -> tuple[float, float]:
    """(device->host, host->device) bytes/s of one plain copy between the arena and a pinned host
    buffer (best of three), the ceiling a level-1 sleep and wake are held against."""
    n = min(arena.nbytes, sample_bytes)
    src = arena.base[:n]
    host = torch.empty(n, dtype=torch.uint8, pin_memory=arena.device.type == "cuda")
    results = []
    for copy in (lambda: host.copy_(src, non_blocking=True), lambda: src.copy_(host, non_blocking=True)):
        copy()  # warm-up
        best = math.inf
        for _ in range(3):
            sync(arena.device)
            t0 = time.perf_counter()
            copy()
            sync(arena.device)
            best = min(best, time.perf_counter() - t0)
        results.append(n / best)
    return results[0], results[1]


def build(args: argparse.Namespace, device: torch.device) -> tuple[MemoryManager, float]:
    """A manager holding one filled weights arena of the model shape; returns it with the seconds
    spent allocating the pinned host mirror up front."""
    nbytes = 0
    for s in qwen_shapes(args.gb):
        nbytes = round_up(nbytes, 256) + 2 * math.prod(s)
    alloc_bytes = (args.alloc_mib << 20) if args.alloc_mib > 0 else None
    mgr = MemoryManager(device, chunk_bytes=args.chunk_mib << 20, alloc_bytes=alloc_bytes)
    weights = mgr.create_arena("weights", nbytes)
    for s in qwen_shapes(args.gb):
        weights.alloc(s, torch.bfloat16).normal_()
    mgr.mark_loaded("weights")
    t0 = time.perf_counter()
    mgr.prepare_host_mirrors()
    return mgr, time.perf_counter() - t0


def add_kv(mgr: MemoryManager, args: argparse.Namespace) -> None:
    kv_gb = args.kv_gb if args.kv_gb is not None else (2.0 if args.gb is None else args.gb / 8)
    mgr.create_arena(KV_TAG, max(1, int(kv_gb * 1e9))).base.zero_()


# ---- our transitions ------------------------------------------------------------------------
def start_traces(mgr: MemoryManager) -> list[list[tuple[str, float]]]:
    """Give every CUDA arena's VMM range a fresh driver-call trace; returns the lists."""
    traces = []
    for tag in mgr.tags:
        vmm = getattr(mgr.arena(tag), "vmm", None)
        if vmm is not None:
            vmm.trace = []
            traces.append(vmm.trace)
    return traces


def summarise(traces: list[list[tuple[str, float]]]) -> dict[str, tuple[int, float]]:
    out: dict[str, tuple[int, float]] = {}
    for trace in traces:
        for name, seconds in trace:
            count, total = out.get(name, (0, 0.0))
            out[name] = (count + 1, total + seconds)
    return out


def timed(mgr: MemoryManager, op: Callable[[], object], verbose: bool) -> tuple[float, object, dict]:
    """Wall seconds of `op()`, its result and (verbose) its driver calls by name."""
    traces = start_traces(mgr) if verbose else []
    t0 = time.perf_counter()
    result = op()
    wall = time.perf_counter() - t0
    calls = summarise(traces)
    for tag in mgr.tags:  # tracing stays off outside the measured call
        if hasattr(mgr.arena(tag), "vmm"):
            mgr.arena(tag).vmm.trace = None
    return wall, result, calls


def run_level(mgr: MemoryManager, level: int, repeats: int, verbose: bool, gap_s: float,
              between: Callable[[], None] | None = None) -> dict:
    """Sleep/wake cycles at `level`: wall and in-call seconds, device bytes freed by each sleep; each
    wake comes `gap_s` after its sleep (the training step's place). `between` (the peer's own cycle)
    runs after ours on even cycles and before ours on odd ones, so neither side always follows the
    other: the driver makes every other immediate re-allocation after a release slow, and a fixed
    order would give all the slow ones to one side."""
    weights = mgr.arena("weights")
    digest = fingerprint(weights)
    res: dict = {k: [] for k in ("sleep_s", "wake_s", "sleep_core_s", "wake_core_s", "freed")}
    calls: dict[str, list[dict]] = {"sleep": [], "wake": []}
    verified = True
    for cycle in range(repeats):
        if between is not None and cycle % 2:
            between()
        sync(mgr.device)
        free0 = device_free(mgr.device)
        wall, stats, sleep_calls = timed(mgr, lambda: mgr.sleep(level), verbose)
        res["sleep_s"].append(wall)
        res["sleep_core_s"].append(stats.seconds)  # type: ignore[attr-defined]
        res["freed"].append(None if free0 is None else device_free(mgr.device) - free0)
        time.sleep(gap_s)
        wall, stats, wake_calls = timed(mgr, mgr.wake_up, verbose)
        res["wake_s"].append(wall)
        res["wake_core_s"].append(stats.seconds)  # type: ignore[attr-defined]
        calls["sleep"].append(sleep_calls)
        calls["wake"].append(wake_calls)
        if level == 1:
            verified = verified and fingerprint(weights) == digest
        mgr.mark_loaded("weights")  # stands in for the weight sync that follows a level-2 wake
        if between is not None and not cycle % 2:
            between()
    out = {k: statistics.median(v) for k, v in res.items() if k != "freed"}
    out |= {"sleep_s_all": res["sleep_s"], "wake_s_all": res["wake_s"]}
    out["freed_bytes"] = None if res["freed"][0] is None else int(statistics.median(res["freed"]))
    out["verified"] = verified if level == 1 else None
    if verbose:
        out["breakdown"] = {op: breakdown(per_cycle, out[f"{op}_s"]) for op, per_cycle in calls.items()}
    return out


def breakdown(per_cycle: list[dict[str, tuple[int, float]]], wall_s: float) -> dict:
    """Per driver call: calls per transition and median seconds; plus what lies outside them."""
    names = sorted({n for cycle in per_cycle for n in cycle})
    rows = {
        n: {"calls": per_cycle[-1].get(n, (0, 0))[0], "s": statistics.median(c.get(n, (0, 0))[1] for c in per_cycle)}
        for n in names
    }
    driver_s = statistics.median(sum(s for _, s in c.values()) for c in per_cycle)
    return {"driver_calls": rows, "driver_s": driver_s, "outside_driver_s": wall_s - driver_s}


def host_costs(device: torch.device, n: int = 20) -> dict[str, float]:
    """Median seconds of the host-side calls a transition makes around its driver calls."""
    if device.type != "cuda":
        return {}
    calls = {
        "mem_get_info_s": lambda: torch.cuda.mem_get_info(device),
        "synchronize_idle_s": lambda: torch.cuda.synchronize(device),
        "empty_cache_s": torch.cuda.empty_cache,
    }
    out = {}
    for name, fn in calls.items():
        samples = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
        out[name] = statistics.median(samples)
    return out


# ---- report ---------------------------------------------------------------------------------
def level_row(scope: str, level: int, res: dict, nbytes: int, d2h: float, h2d: float, peer: dict) -> dict:
    """The judged figures of one (scope, level): ratios to the ceiling or target, and to the peer on
    the weights scope, where both release the same bytes."""
    row = {"bench": "sleep", "scope": scope, "level": level}
    row |= {k: res[k] for k in ("sleep_s", "wake_s", "sleep_core_s", "wake_core_s", "freed_bytes")}
    if level == 1:
        ceil_sleep, ceil_wake = nbytes / d2h, nbytes / h2d  # only the weights are copied
        row |= {
            "ceiling_sleep_s": ceil_sleep,
            "ceiling_wake_s": ceil_wake,
            "ratio_sleep": res["sleep_s"] / ceil_sleep,
            "ratio_wake": res["wake_s"] / ceil_wake,
            "ratio_of": "pinned copy ceiling",
        }
    else:
        row |= {
            "target_s": LEVEL2_TARGET_S,
            "meets_target": res["sleep_s"] <= LEVEL2_TARGET_S and res["wake_s"] <= LEVEL2_TARGET_S,
        }
    if scope != "weights":
        return row | {"peer_note": "compared with the peer on the weights scope only"}
    row |= peer
    if "peer_pause_s" in row:
        row["ratio_vs_peer_sleep"] = res["sleep_s"] / row["peer_pause_s"]
        row["ratio_vs_peer_wake"] = res["wake_s"] / row["peer_resume_s"]
        if level == 2:
            row["no_slower_than_peer"] = row["ratio_vs_peer_sleep"] <= 1 and row["ratio_vs_peer_wake"] <= 1
            row["accepted"] = row["meets_target"] and row["no_slower_than_peer"]
    return row


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--gb", type=float, default=None, help="weights size (default: Qwen2.5-7B, 15.2 GB)")
    parser.add_argument("--kv-gb", type=float, default=None, help="KV arena size (default 2 GB, or gb/8)")
    parser.add_argument("--chunk-mib", type=int, default=1024, help="copy and host-mirror chunk")
    parser.add_argument("--alloc-mib", type=int, default=0, help="physical allocation size; 0: one per arena")
    parser.add_argument("--repeats", type=int, default=3, help="level-1 cycles (and peer-with-backup cycles)")
    parser.add_argument("--repeats-l2", type=int, default=30, help="level-2 cycles (and peer-without-backup)")
    parser.add_argument("--bw-sample-gb", type=float, default=4.0, help="bytes copied to measure bandwidth")
    parser.add_argument("--gap-ms", type=float, default=100.0,
                        help="idle time between each sleep and its wake, ours and the peer's alike (the training "
                             "step's place; 0: wake at once, where the driver makes every other allocation slow)")
    parser.add_argument("--skip-peer", action="store_true")
    parser.add_argument("--verbose", action="store_true", help="per driver call breakdown (adds ~1 us a call)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu {platform.machine()}"

    mgr, mirror_s = build(args, device)
    mgr.measure_device = False  # the bench queries free memory itself, outside the timed calls
    weights = mgr.arena("weights")
    nbytes = weights.nbytes
    d2h, h2d = copy_bandwidth(weights, int(args.bw_sample_gb * 1e9))
    repeats = {1: args.repeats, 2: args.repeats_l2}
    tms, note = (None, "skipped") if args.skip_peer else load_peer(device)
    peer: dict[bool, dict] = {True: {"peer_note": note}, False: {"peer_note": note}}
    # Level 2 and the peer without backup take turns, cycle by cycle, in the same process: both
    # release the same bytes under the same conditions (driver state, clocks, other tenants).
    gap = args.gap_ms / 1e3
    interleaved = PeerCycles(tms, nbytes, device, False, note, gap) if tms is not None else None
    results = {"weights": {
        1: run_level(mgr, 1, repeats[1], args.verbose, gap),
        2: run_level(mgr, 2, repeats[2], args.verbose, gap, interleaved.cycle if interleaved else None),
    }}
    if interleaved is not None:
        peer[False] = interleaved.result() | {"peer_interleaved": True}
        del interleaved
    add_kv(mgr, args)
    results["worker"] = {lv: run_level(mgr, lv, repeats[lv], args.verbose, gap) for lv in (1, 2)}
    arenas = {t: mgr.arena(t).nbytes for t in mgr.tags}
    allocs = {t: len(mgr.arena(t).vmm.allocs) for t in mgr.tags if hasattr(mgr.arena(t), "vmm")}
    span_unmap = getattr(getattr(weights, "vmm", None), "span_unmap", None)
    mgr.close()
    if tms is not None:
        peer[True] = peer_cycles(tms, nbytes, device, True, note, args.repeats, gap)

    common = {
        "pinned_d2h_GBps": d2h / 1e9,
        "pinned_h2d_GBps": h2d / 1e9,
        "mirror_prep_s": mirror_s,
        "chunk_bytes": args.chunk_mib << 20,
        "alloc_bytes": (args.alloc_mib << 20) or None,
        "allocs_per_arena": allocs,
        "span_unmap": span_unmap,
        "gap_ms": args.gap_ms,
        "device": name,
    }
    for scope, levels in results.items():
        scope_arenas = {t: b for t, b in arenas.items() if scope == "worker" or t == "weights"}
        for level, res in levels.items():
            row = level_row(scope, level, res, nbytes, d2h, h2d, peer[level == 1])
            row |= {"bytes": sum(scope_arenas.values()), "arenas": scope_arenas, "verified": res["verified"]}
            row |= {"repeats": repeats[level], "sleep_s_all": res["sleep_s_all"], "wake_s_all": res["wake_s_all"]}
            if args.verbose:
                row["breakdown"] = res["breakdown"]
            print(json.dumps(row | common), flush=True)
    if args.verbose:
        print(json.dumps({"bench": "sleep_host_costs", **host_costs(device), "device": name}), flush=True)


if __name__ == "__main__":
    main()
