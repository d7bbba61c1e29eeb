"""Benchmark sleep and wake of the memory arenas against the pinned-copy ceiling and torch_memory_saver.

Prints one JSON line per sleep level. Level 1 (weights mirrored to pinned host memory) is compared with
bytes / pinned copy bandwidth measured in the same run and with torch_memory_saver's pause/resume with
CPU backup; level 2 (weights dropped) with the 20 ms target and torch_memory_saver without backup.

    python scripts/bench_sleep.py                        # Qwen2.5-7B bf16 shape (15.2 GB) on cuda
    python scripts/bench_sleep.py --device cpu --gb 0.01 # smoke test
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from inference.memory import Arena, MemoryManager, round_up

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
    """A manager with a filled weights arena of the model shape and an empty KV arena; returns it
    with the seconds spent allocating the pinned host mirror up front."""
    shapes = qwen_shapes(args.gb)
    nbytes = 0
    for s in shapes:
        nbytes = round_up(nbytes, 256) + 2 * math.prod(s)
    mgr = MemoryManager(device, chunk_bytes=args.chunk_mib << 20)
    weights = mgr.create_arena("weights", nbytes)
    for s in shapes:
        weights.alloc(s, torch.bfloat16).normal_()
    mgr.mark_loaded("weights")
    kv_gb = args.kv_gb if args.kv_gb is not None else (2.0 if args.gb is None else args.gb / 8)
    mgr.create_arena("kv_cache", max(1, int(kv_gb * 1e9))).base.zero_()
    t0 = time.perf_counter()
    mgr.prepare_host_mirrors()
    return mgr, time.perf_counter() - t0


def run_level(mgr: MemoryManager, level: int, repeats: int) -> dict:
    """Sleep/wake cycles at `level`; wall seconds of each call, device bytes freed by each sleep."""
    weights = mgr.arena("weights")
    digest = fingerprint(weights)
    sleeps, wakes, freed, verified = [], [], [], True
    for _ in range(repeats):
        sync(mgr.device)
        t0 = time.perf_counter()
        stats = mgr.sleep(level)
        sleeps.append(time.perf_counter() - t0)
        freed.append(stats.freed_bytes)
        t0 = time.perf_counter()
        mgr.wake_up()
        wakes.append(time.perf_counter() - t0)
        if level == 1:
            verified = verified and fingerprint(weights) == digest
        mgr.mark_loaded("weights")  # stands in for the weight sync that follows a level-2 wake
    return {
        "sleep_s": statistics.median(sleeps),
        "wake_s": statistics.median(wakes),
        "sleep_s_all": sleeps,
        "wake_s_all": wakes,
        "freed_bytes": None if freed[0] is None else int(statistics.median(freed)),
        "verified": verified if level == 1 else None,
    }


def bench_peer(nbytes: int, device: torch.device) -> dict[bool, dict]:
    """torch_memory_saver pausing and resuming the same bytes, with and without CPU backup."""
    if device.type != "cuda":
        return {b: {"peer_note": "skipped: torch_memory_saver needs CUDA"} for b in (True, False)}
    try:
        from torch_memory_saver import torch_memory_saver as tms

        version = importlib.metadata.version("torch_memory_saver")
    except Exception as e:  # the peer is optional: report why it is missing
        return {b: {"peer_note": f"torch_memory_saver unavailable: {e!r}"} for b in (True, False)}
    note = f"torch_memory_saver {version}"
    try:
        tms.hook_mode = "torch"  # must precede the first region(); preload mode needs LD_PRELOAD
        note += ", hook_mode=torch"
    except Exception as e:
        note += f", hook_mode not set ({e!r})"
    return {backup: _peer_cycle(tms, nbytes, device, backup, note) for backup in (True, False)}


def _peer_cycle(tms: object, nbytes: int, device: torch.device, backup: bool, note: str) -> dict:
    tag = "bench_backup" if backup else "bench_nobackup"
    try:
        with tms.region(tag=tag, enable_cpu_backup=backup):  # type: ignore[attr-defined]
            t = torch.empty(nbytes, dtype=torch.uint8, device=device)
        t.fill_(7)
        sync(device)
        free0 = torch.cuda.mem_get_info(device)[0]
        t0 = time.perf_counter()
        tms.pause(tag)  # type: ignore[attr-defined]
        sync(device)
        pause_s = time.perf_counter() - t0
        freed = torch.cuda.mem_get_info(device)[0] - free0
        t0 = time.perf_counter()
        tms.resume(tag)  # type: ignore[attr-defined]
        sync(device)
        resume_s = time.perf_counter() - t0
        kept = bool((t[:: max(1, nbytes // 4096)] == 7).all()) if backup else None
        del t
        return {
            "peer_pause_s": pause_s,
            "peer_resume_s": resume_s,
            "peer_freed_bytes": freed,
            "peer_verified": kept,
            "peer_note": f"{note}, cpu_backup={backup}",
        }
    except Exception as e:  # a broken peer must not hide our own figures
        return {"peer_note": f"{note}, cpu_backup={backup}: failed with {e!r}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--gb", type=float, default=None, help="weights size (default: Qwen2.5-7B, 15.2 GB)")
    parser.add_argument("--kv-gb", type=float, default=None, help="KV arena size (default 2 GB, or gb/8)")
    parser.add_argument("--chunk-mib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bw-sample-gb", type=float, default=4.0, help="bytes copied to measure bandwidth")
    parser.add_argument("--skip-peer", action="store_true")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu {platform.machine()}"

    mgr, mirror_s = build(args, device)
    nbytes, kv_bytes = mgr.arena("weights").nbytes, mgr.arena("kv_cache").nbytes
    d2h, h2d = copy_bandwidth(mgr.arena("weights"), int(args.bw_sample_gb * 1e9))
    levels = {level: run_level(mgr, level, args.repeats) for level in (1, 2)}
    mgr.close()
    peer = {True: {"peer_note": "skipped"}, False: {"peer_note": "skipped"}}
    if not args.skip_peer:
        peer = bench_peer(nbytes, device)

    for level, res in levels.items():
        row = {"bench": "sleep", "level": level, "bytes": nbytes, "kv_bytes": kv_bytes}
        row |= {k: res[k] for k in ("sleep_s", "wake_s", "freed_bytes")}
        if level == 1:
            ceil_sleep, ceil_wake = nbytes / d2h, nbytes / h2d
            row |= {
                "ceiling_s": max(ceil_sleep, ceil_wake),
                "ceiling_sleep_s": ceil_sleep,
                "ceiling_wake_s": ceil_wake,
                "ratio_sleep": res["sleep_s"] / ceil_sleep,
                "ratio_wake": res["wake_s"] / ceil_wake,
                "ratio_of": "pinned copy ceiling",
            }
        else:
            row |= {
                "ceiling_s": None,
                "target_s": LEVEL2_TARGET_S,
                "ratio_sleep": res["sleep_s"] / LEVEL2_TARGET_S,
                "ratio_wake": res["wake_s"] / LEVEL2_TARGET_S,
                "ratio_of": "20 ms target",
            }
        row |= peer[level == 1]
        if "peer_pause_s" in row:
            row["ratio_vs_peer_sleep"] = res["sleep_s"] / row["peer_pause_s"]
            row["ratio_vs_peer_wake"] = res["wake_s"] / row["peer_resume_s"]
        row |= {
            "pinned_d2h_GBps": d2h / 1e9,
            "pinned_h2d_GBps": h2d / 1e9,
            "mirror_prep_s": mirror_s,
            "verified": res["verified"],
            "repeats": args.repeats,
            "sleep_s_all": res["sleep_s_all"],
            "wake_s_all": res["wake_s_all"],
            "chunk_bytes": args.chunk_mib << 20,
            "device": name,
        }
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
