"""Benchmark the small-M Triton GEMV against cuBLAS (F.linear) on decode projection shapes.

Prints one JSON line per (model, projection, M): both times, the weight-bytes roofline from a device
to device copy measured in the same run, and the ratios. Every timing is a CUDA graph of many calls
replayed under CUDA events (no launch overhead, as the engine's decode graphs see it), and the calls
cycle through enough copies of the weight (>= 256 MB) that the 50 MB L2 cannot hold them: each call
streams its weight from HBM, as a layer of the real model does. The `down+silu` rows time
silu_mul_gemv against silu_and_mul followed by F.linear (two launches); the `+norm` rows norm_gemv
(residual add + RMSNorm + projection) against add_rms_norm followed by F.linear.

    python3 scripts/bench/gemv.py                         # Qwen2-0.5B and 7B shapes, M = 1 and 8
    python3 scripts/bench/gemv.py --sweep --models 0.5b   # best (kind, block_n, block_k, warps, split_k)
    python3 scripts/bench/gemv.py --invariant --m 1,128   # the batch-invariant GEMM (gemm_invariant.py)
    python3 scripts/bench/gemv.py --invariant --m 1,128,4096 --inv-tiles 64x32x64,64x64x64,128x64x64

--invariant times gemm_invariant's product instead of the GEMV (`+norm` and `+silu` after add_rms_norm and
silu_and_mul, as the mode's layers run them) against the same cuBLAS rows, at any M; --inv-tiles adds one
time per tile shape BMxBNxBK (split-K as pick_tiles gives it for that BLOCK_N/BLOCK_K) or BMxBNxBKxSPLIT.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

from inference.layers import gemm_invariant as inv
from inference.layers.fused import add_rms_norm, silu_and_mul
from inference.layers.gemv import GemvConfig, gemv, norm_gemv, pick_config, silu_mul_gemv

# (name, N, K) per model; "down+silu" is the down projection fed by the fused [gate; up] activation,
# "+norm" the projection fed by the residual add and RMSNorm in its prologue (norm_gemv), as the model runs it.
MODELS = {
    "0.5b": [("qkv", 1152, 896), ("qkv+norm", 1152, 896), ("o_proj", 896, 896), ("gate_up", 9728, 896),
             ("gate_up+norm", 9728, 896), ("down", 896, 4864), ("down+silu", 896, 4864), ("lm_head", 151936, 896)],
    "7b": [("qkv", 4608, 3584), ("qkv+norm", 4608, 3584), ("o_proj", 3584, 3584), ("gate_up", 37888, 3584),
           ("gate_up+norm", 37888, 3584), ("down", 3584, 18944), ("down+silu", 3584, 18944),
           ("lm_head", 152064, 3584)],
}
L2_FLUSH_BYTES = 256 << 20


def bandwidths(nbytes: int = 1 << 30) -> tuple[float, float]:
    """Bytes per second of a device-to-device copy (read + write counted) and of a read-only sum.

    A copy turns the bus around for writes; a GEMV only reads, so the read figure is its roofline.
    """
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    copy_ms = time_graph(lambda _i: dst.copy_(src), copies=1, calls=10)
    read_ms = time_graph(lambda _i: src.sum(dtype=torch.float32), copies=1, calls=10)
    return 2 * nbytes / (copy_ms * 1e-3), nbytes / (read_ms * 1e-3)


def time_graph(fn: Callable[[int], object], copies: int, calls: int, replays: int = 5) -> float:
    """Median milliseconds per call of fn(i % copies), captured `calls` times in one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(min(copies, 2)):
            fn(i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i % copies)
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    del graph
    return sorted(times)[len(times) // 2]


class Case:
    """Weights (several copies, to defeat L2), input and bias of one (projection, M)."""

    def __init__(self, name: str, m: int, n: int, k: int, dtype: torch.dtype, flush: bool = True) -> None:
        self.name, self.m, self.n, self.k = name, m, n, k
        self.silu = name.endswith("+silu")
        self.norm = name.endswith("+norm")
        self.weight_bytes = n * k * torch.empty((), dtype=dtype).element_size()
        self.copies = max(1, math.ceil(L2_FLUSH_BYTES / self.weight_bytes)) if flush else 1
        self.calls = max(64, self.copies) if self.weight_bytes < (64 << 20) else 16
        w = torch.randn(n, k, device="cuda", dtype=dtype) * k ** -0.5
        self.weights = [w] + [w.clone() for _ in range(self.copies - 1)]
        self.x = torch.randn(m, 2 * k if self.silu else k, device="cuda", dtype=dtype)
        self.bias = torch.randn(n, device="cuda", dtype=dtype) if name.startswith("qkv") else None
        self.residual = torch.randn_like(self.x)
        self.norm_weight = torch.rand(k, device="cuda", dtype=dtype) + 0.5

    def ours(self, config: GemvConfig | None = None) -> Callable[[int], object]:
        if self.silu:
            return lambda i: silu_mul_gemv(self.x, self.weights[i], config=config)
        if self.norm:
            return lambda i: norm_gemv(self.x, self.residual, self.norm_weight, 1e-6, self.weights[i], self.bias,
                                       config=config)[0]
        return lambda i: gemv(self.x, self.weights[i], self.bias, config=config)

    def invariant(self, tiles: inv.InvariantTiles | None = None) -> Callable[[int], object]:
        """The batch-invariant product of this case (its norm or activation launched first, as the mode's
        layers run them)."""
        if self.silu:
            return lambda i: inv.invariant_gemm(silu_and_mul(self.x), self.weights[i], None, tiles)
        if self.norm:
            return lambda i: inv.invariant_gemm(add_rms_norm(self.x, self.residual, self.norm_weight, 1e-6)[0],
                                                self.weights[i], self.bias, tiles)
        return lambda i: inv.invariant_gemm(self.x, self.weights[i], self.bias, tiles)

    def cublas(self) -> Callable[[int], object]:
        if self.silu:
            return lambda i: F.linear(silu_and_mul(self.x), self.weights[i])
        if self.norm:
            return lambda i: F.linear(add_rms_norm(self.x, self.residual, self.norm_weight, 1e-6)[0],
                                      self.weights[i], self.bias)
        return lambda i: F.linear(self.x, self.weights[i], self.bias)

    def time(self, fn: Callable[[int], object]) -> float:
        return time_graph(fn, self.copies, self.calls) * 1e3

    def check(self, config: GemvConfig | None = None) -> None:
        got, ref = self.ours(config)(0), self.cublas()(0)
        torch.testing.assert_close(got.float(), ref.float(), atol=5e-2, rtol=2e-2)


# Per-thread fp32 values of the [BLOCK_M, BLOCK_N, BLOCK_K] product each kind allows (lanes keeps it
# whole as the accumulator; reduce folds it each step; dot never forms it).
TILE_PER_THREAD = {"lanes": (8, 64), "reduce": (8, 256), "dot": (0, 1 << 30)}


def sweep_configs(m: int, n: int, k: int, num_sms: int, grid: dict[str, list]) -> list[GemvConfig]:
    """Valid configs of the grid: tiles within TILE_PER_THREAD, dot with BLOCK_N >= 16, K split only into
    full blocks and only where the row blocks alone give fewer than four programs per SM."""
    out = []
    for kind, bn, bk, warps, split in itertools.product(grid["kinds"], grid["block_n"], grid["block_k"],
                                                        grid["warps"], grid["splits"]):
        cfg = GemvConfig(bn, bk, warps, split, kind=kind)
        lo, hi = TILE_PER_THREAD[kind]
        if not lo * 32 * warps <= cfg.block_m(m) * bn * bk <= hi * 32 * warps or (kind == "dot" and bn < 16):
            continue
        if k < split * bk or (split > 1 and -(-n // bn) >= 4 * num_sms):
            continue
        out.append(cfg)
    return out


def cases(args: argparse.Namespace) -> list[tuple[str, str, int, int, int]]:
    """(model, projection, m, n, k) selected by the command line."""
    wanted = set(filter(None, args.proj.split(",")))
    return [(model, name, m, n, k) for model in args.models.split(",") for name, n, k in MODELS[model]
            if not wanted or name in wanted for m in (int(v) for v in args.m.split(","))]


def compiles(case: Case, cfg: GemvConfig) -> bool:
    """Run the config once; False where it asks for more shared memory or registers than an SM has."""
    from triton.runtime.errors import OutOfResources

    try:
        case.ours(cfg)(0)
    except OutOfResources:
        return False
    return True


def warm_shard(args: argparse.Namespace, num_sms: int) -> None:
    """Compile (into Triton's disk cache) every sweep config whose index falls in this shard."""
    shard, total = (int(v) for v in args.warm_shard.split("/"))
    index = 0
    for _model, name, m, n, k in cases(args):
        case = Case(name, m, n, k, torch.bfloat16, flush=False)
        for cfg in sweep_configs(m, n, k, num_sms, args.grid):
            if index % total == shard:
                compiles(case, cfg)
            index += 1
        del case
    torch.cuda.synchronize()


def warm_in_parallel(jobs: int) -> None:
    """Compiling is most of a sweep's time: do it in `jobs` processes first, then time serially."""
    argv = [sys.executable, *sys.argv]
    procs = [subprocess.Popen([*argv, "--warm-shard", f"{i}/{jobs}"]) for i in range(jobs)]
    failed = [p.args for p in procs if p.wait() != 0]
    assert not failed, f"warm-up failed: {failed}"


def run_case(model: str, name: str, m: int, n: int, k: int, args: argparse.Namespace, bw: float,
             num_sms: int) -> dict:
    case = Case(name, m, n, k, torch.bfloat16)
    case.check()
    default = pick_config(m, n, k, num_sms, "silu" if case.silu else "norm" if case.norm else "")
    ours, theirs = case.time(case.ours()), case.time(case.cublas())
    roof = case.weight_bytes / bw * 1e6
    row = {"bench": "gemv", "model": model, "proj": name, "m": m, "n": n, "k": k,
           "weight_mb": round(case.weight_bytes / 2**20, 2),
           "gemv_us": round(ours, 2), "cublas_us": round(theirs, 2), "roofline_us": round(roof, 2),
           "gemv_over_roofline": round(ours / roof, 2), "cublas_over_gemv": round(theirs / ours, 2),
           "config": [default.kind, default.block_n, default.block_k, default.num_warps, default.split_k]}
    if args.sweep:
        results = []
        for cfg in sweep_configs(m, n, k, num_sms, args.grid):
            if compiles(case, cfg):
                results.append((case.time(case.ours(cfg)), cfg))
        results.sort(key=lambda r: r[0])
        best_us, best = results[0]
        case.check(best)
        row.update(best_us=round(best_us, 2), best_over_roofline=round(best_us / roof, 2),
                   best=[best.kind, best.block_n, best.block_k, best.num_warps, best.split_k], tried=len(results),
                   next=[[round(us, 2), c.kind, c.block_n, c.block_k, c.num_warps, c.split_k]
                         for us, c in results[1:6]])
    del case
    torch.cuda.empty_cache()
    return row


def parse_tiles(text: str, n: int, k: int, num_sms: int) -> list[inv.InvariantTiles]:
    """--inv-tiles: BMxBNxBK (pick_tiles' split for that BLOCK_N and BLOCK_K) or BMxBNxBKxSPLIT, comma-separated."""
    out = []
    for spec in filter(None, text.split(",")):
        bm, bn, bk, *split = (int(v) for v in spec.split("x"))
        split_k = split[0] if split else inv.split_for(n, k, bn, bk, num_sms)
        out.append(inv.InvariantTiles(block_n=bn, block_k=bk, split_k=split_k, block_m=bm))
    return out


def run_invariant_case(model: str, name: str, m: int, n: int, k: int, args: argparse.Namespace, bw: float,
                       num_sms: int) -> dict:
    """One row of --invariant: the mode's product (its default tiles, then each of --inv-tiles) and cuBLAS."""
    case = Case(name, m, n, k, torch.bfloat16)
    got, ref = case.invariant()(0), case.cublas()(0)
    torch.testing.assert_close(got.float(), ref.float(), atol=5e-2, rtol=2e-2)
    tiles = inv.invariant_tiles(n, k, torch.device("cuda"))
    ours, theirs = case.time(case.invariant()), case.time(case.cublas())
    roof = case.weight_bytes / bw * 1e6
    row = {"bench": "invariant_gemm", "model": model, "proj": name, "m": m, "n": n, "k": k,
           "weight_mb": round(case.weight_bytes / 2**20, 2), "invariant_us": round(ours, 2),
           "cublas_us": round(theirs, 2), "roofline_us": round(roof, 2),
           "invariant_over_cublas": round(ours / theirs, 2),
           "tiles": [tiles.block_m, tiles.block_n, tiles.block_k, tiles.split_k]}
    others = []
    for t in parse_tiles(args.inv_tiles, n, k, num_sms):
        others.append([t.block_m, t.block_n, t.block_k, t.split_k, round(case.time(case.invariant(t)), 2)])
    if others:
        row["other_tiles_us"] = others
    del case
    torch.cuda.empty_cache()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="0.5b,7b", help="comma list of " + ",".join(MODELS))
    p.add_argument("--m", default="1,8", help="comma list of row counts (<= 8; any with --invariant)")
    p.add_argument("--invariant", action="store_true",
                   help="time the batch-invariant GEMM (gemm_invariant.py) against cuBLAS instead of the GEMV")
    p.add_argument("--inv-tiles", default="", help="--invariant: also time these tiles, BMxBNxBK[xSPLIT],...")
    p.add_argument("--proj", default="", help="comma list of projection names (default: all)")
    p.add_argument("--sweep", action="store_true", help="also try block shapes and print the best per shape")
    p.add_argument("--jobs", type=int, default=8, help="sweep: processes that compile the configs first")
    p.add_argument("--warm-shard", default="", help=argparse.SUPPRESS)
    p.add_argument("--kinds", default="lanes,reduce,dot", help="sweep: kernel kinds")
    p.add_argument("--block-n", default="1,2,4,8,16,32,64", help="sweep: BLOCK_N values")
    p.add_argument("--block-k", default="128,256,512,1024", help="sweep: BLOCK_K values")
    p.add_argument("--warps", default="2,4,8", help="sweep: num_warps values")
    p.add_argument("--splits", default="1,2,4,8", help="sweep: split_k values")
    args = p.parse_args()
    args.grid = {key: [int(v) for v in getattr(args, key).split(",")]
                 for key in ("block_n", "block_k", "warps", "splits")}
    args.grid["kinds"] = args.kinds.split(",")
    if not torch.cuda.is_available():
        sys.exit("scripts/bench/gemv.py needs a CUDA GPU")
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    if args.warm_shard:
        return warm_shard(args, num_sms)
    if args.sweep and args.jobs > 1:
        warm_in_parallel(args.jobs)
    copy_bw, read_bw = bandwidths()
    bw = max(copy_bw, read_bw)
    print(json.dumps({"device": torch.cuda.get_device_name(0), "sms": num_sms, "copy_gbs": round(copy_bw / 1e9),
                      "read_gbs": round(read_bw / 1e9), "roofline_gbs": round(bw / 1e9)}), flush=True)
    run = run_invariant_case if args.invariant else run_case
    for model, name, m, n, k in cases(args):
        print(json.dumps(run(model, name, m, n, k, args, bw, num_sms)), flush=True)


if __name__ == "__main__":
    main()
