"""Creep: does a sidecar that lives for days grow? N cycles against one real `sidecar launch`.

Each cycle is what an RL step does to the sidecar, through a real WeightSyncHook: sleep (levels 1 and 2
alternate), wake and a sync with its audit (the hook's sync wakes the weights; its rollouts wake the
KV cache), then a rollout batch. Measured at start (after the first cycle), after warm-up (--warm-up
cycles) and at the end (the lowest RSS of the last --settle cycles), for the launcher and every rank
process: host RSS and open file descriptors, and GPU memory in use at the driver level (NVML through
cuda-bindings or nvidia-smi; null on CPU).
One JSON line: each figure at the three points and its growth after warm-up in percent; exit status 1
when a descriptor count changed after warm-up or an RSS grew past --max-rss-growth percent.

    python scripts/tools/creep.py --cycles 1000                       # tiny model on CPU
    python scripts/tools/creep.py --cycles 1000 --device cuda --model DIR
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

from scripts.tools.sidecar_proc import start_sidecar

MIB = 1 << 20


def launch(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    """`sidecar launch` on 127.0.0.1, port 0; returns once it prints its serving line."""
    cmd = [sys.executable, "-m", "sidecar.cli.main", "launch", "--host", "127.0.0.1", "--port", "0",
           "--device", args.device, "--log-level", "warning", "--max-model-len", "256"]
    if args.device == "cpu":
        cmd += ["--kv-cache-bytes", str(args.kv_cache_bytes)]
    else:  # the trainer shares the sidecar's GPU: CUDA IPC (NCCL refuses two ranks on one device)
        cmd += ["--transfer", "ipc", "--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    if args.model:
        cmd += ["--model", args.model]
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    return start_sidecar(cmd)


def processes(root: int) -> list[int]:
    """`root` and every process below it (the launcher, its ranks, their helpers)."""
    parent: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(p for p, pp in parent.items() if pp == pid)
    return sorted(found)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def gpu_used_bytes() -> int | None:
    """Device memory in use on every GPU, as the driver counts it (every process's, not only torch's)."""
    try:
        from cuda.bindings import nvml  # type: ignore[import-not-found]

        nvml.init_v2()
        try:
            return sum(int(nvml.device_get_memory_info(nvml.device_get_handle_by_index_v2(i)).used)
                       for i in range(nvml.device_get_count_v2()))
        finally:
            nvml.shutdown()
    except Exception:
        pass
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30, check=False)
    if out.returncode != 0:
        return None
    return sum(int(v) for v in out.stdout.split()) * MIB


def snapshot(root: int) -> dict[str, Any]:
    """Per process of the sidecar (by its place: launcher, child 1, ...): RSS and open descriptors."""
    procs = {}
    for pid in processes(root):
        try:
            name = "launcher" if pid == root else f"child-{pid}"
            procs[name] = {"pid": pid, "rss": rss_bytes(pid), "fds": open_fds(pid)}
        except OSError:
            continue  # it ended between the listing and the read
    return {"procs": procs, "gpu_used": gpu_used_bytes()}


def settled(tail: list[dict[str, Any]]) -> dict[str, Any]:
    """The end point from the last cycles' snapshots: each process's lowest RSS among them, its last descriptor
    count and the last GPU figure. The allocator holds a freed buffer or two for a while (a level-2 sleep frees
    and re-allocates every weight), so one snapshot's RSS jitters by a few MB; a leak raises every one of the
    last cycles, so their lowest still shows it."""
    last = tail[-1]
    procs = {}
    for name, p in last["procs"].items():
        seen = [t["procs"][name]["rss"] for t in tail if name in t["procs"]]
        procs[name] = {**p, "rss": min(seen)}
    return {"procs": procs, "gpu_used": last["gpu_used"]}


def growth(warm: float | None, end: float | None) -> float | None:
    if warm is None or end is None or warm == 0:
        return None
    return round(100.0 * (end - warm) / warm, 3)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from inference.core import SamplingParams
    from inference.models.tiny import default_model_dir
    from trainer_hooks.client import SidecarClient
    from trainer_hooks.hook import WeightSyncHook
    from trainer_hooks.toy_policy import ToyPolicy

    proc, url = launch(args)
    points: dict[str, dict[str, Any]] = {}
    tail: list[dict[str, Any]] = []  # the last --settle cycles' snapshots
    try:
        policy = ToyPolicy.from_dir(args.model or default_model_dir(), device=args.device)
        prompts = [[1 + (7 * i + j) % 50 for j in range(8)] for i in range(args.prompts)]
        sampling = SamplingParams(n=args.samples, temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True)
        with SidecarClient(url) as client, WeightSyncHook(client, policy) as hook:
            for cycle in range(args.cycles):
                hook.sleep_level = 1 + cycle % 2
                hook.before_training()
                with torch.no_grad():
                    next(policy.parameters()).add_(1e-6)  # the step's new weights
                report = hook.after_optimizer_step()
                if not report or not report.get("ok"):
                    raise RuntimeError(f"cycle {cycle}: the sync's audit failed: {report}")
                hook.rollouts(prompts, sampling)
                if cycle == 0:
                    points["start"] = snapshot(proc.pid)
                if cycle + 1 == args.warm_up:
                    points["warm"] = snapshot(proc.pid)
                in_tail = cycle >= args.cycles - args.settle
                tell = bool(args.progress) and (cycle + 1) % args.progress == 0  # a cut-short run says how far
                now = snapshot(proc.pid) if in_tail or tell else None
                if in_tail:
                    tail.append(now)
                if tell:
                    print(f"creep: cycle {cycle + 1}: gpu_used {now['gpu_used']}, " + ", ".join(
                        f"{name} rss {p['rss'] / MIB:.1f} MiB fds {p['fds']}" for name, p in now["procs"].items()),
                        file=sys.stderr, flush=True)
            points["end"] = settled(tail)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return report_line(args, points)


def report_line(args: argparse.Namespace, points: dict[str, dict[str, Any]]) -> dict[str, Any]:
    warm = points.get("warm", points["start"])
    procs: dict[str, Any] = {}
    failed = []
    for name, end in points["end"]["procs"].items():
        at = {p: points[p]["procs"].get(name) for p in ("start", "warm", "end") if p in points}
        if at.get("warm") is None and name in warm["procs"]:
            at["warm"] = warm["procs"][name]
        w = at.get("warm") or end
        rss_growth, fds_growth = growth(w["rss"], end["rss"]), end["fds"] - w["fds"]
        procs[name] = {"rss_mb": {p: round(v["rss"] / MIB, 1) for p, v in at.items() if v},
                       "fds": {p: v["fds"] for p, v in at.items() if v},
                       "rss_growth_pct": rss_growth, "fds_growth": fds_growth}
        if fds_growth != 0 or (rss_growth is not None and rss_growth > args.max_rss_growth):
            failed.append(name)
    gpu = {p: (round(points[p]["gpu_used"] / MIB, 1) if points[p]["gpu_used"] is not None else None)
           for p in ("start", "warm", "end") if p in points}
    return {"tool": "creep", "cycles": args.cycles, "warm_up_cycles": args.warm_up, "device": args.device,
            "procs": procs, "gpu_used_mb": gpu, "gpu_growth_pct": growth(gpu.get("warm"), gpu.get("end")),
            "max_rss_growth_pct": args.max_rss_growth, "flat": not failed, "grew": failed}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=1000)
    ap.add_argument("--warm-up", type=int, default=0, help="cycles before the warm point (default: a tenth)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default=None, help="an HF directory (default: the embedded tiny model)")
    ap.add_argument("--dtype", default=None, help="the sidecar's (default: its own; the trainer sends the model's)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--kv-cache-bytes", type=int, default=16 << 20, help="CPU only")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="CUDA only: the sidecar's share "
                                                                             "(the trainer's model shares the GPU)")
    ap.add_argument("--max-rss-growth", type=float, default=1.0, help="percent allowed after warm-up")
    ap.add_argument("--progress", type=int, default=0, help="a line on stderr every this many cycles (0: none)")
    ap.add_argument("--settle", type=int, default=5, help="the end's RSS is the lowest of this many last cycles")
    args = ap.parse_args(argv)
    if args.cycles < 2:
        ap.error("--cycles must be >= 2")
    args.warm_up = args.warm_up or max(1, args.cycles // 10)
    if not 1 <= args.warm_up < args.cycles:
        ap.error("--warm-up must be in [1, cycles)")
    if not 1 <= args.settle <= args.cycles - args.warm_up:
        ap.error("--settle must be in [1, cycles - warm-up]")
    return args


def main(argv: list[str] | None = None) -> int:
    line = run(parse_args(argv))
    print(json.dumps(line), flush=True)
    return 0 if line["flat"] else 1


if __name__ == "__main__":
    sys.exit(main())
