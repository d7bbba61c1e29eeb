"""Benchmark decode attention: the triton backend (eager and CUDA-graph replay) against the reference
backend and torch SDPA over a contiguous cache. Prints one JSON line per (shape, batch, context); on CUDA
`triton_over_sdpa` is the graph-replay time over SDPA's.

Every sequence of a case has the same context; block tables are shuffled (non-contiguous). The triton
and reference timings include the KV store of the new token (what the engine calls); SDPA reads a
ready contiguous [B, Hkv, ctx, D] cache (a bandwidth yardstick, not a paged implementation).

    python scripts/bench/attention.py                              # H200: Qwen2-0.5B and Qwen2-7B shapes
    python scripts/bench/attention.py --decode-block-n 32 --num-warps 2 --max-splits 16
    python scripts/bench/attention.py --device cpu --batches 2 --contexts 64 --shapes 4,2,32   # smoke test
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

from inference.batch import AttentionMetadata
from inference.layers.attention import ReferenceAttention

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def decode_case(batch: int, context: int, heads: int, kv_heads: int, head_dim: int, block_size: int,
                dtype: torch.dtype, device: str) -> tuple[AttentionMetadata, list[torch.Tensor]]:
    """A decode step (the last of `context` tokens is new) over shuffled blocks: meta, [q, k, v, kc, vc]."""
    per_seq = -(-context // block_size)
    blocks = list(range(batch * per_seq))
    random.Random(0).shuffle(blocks)
    tables = [blocks[i * per_seq:(i + 1) * per_seq] for i in range(batch)]
    slots = [t[(context - 1) // block_size] * block_size + (context - 1) % block_size for t in tables]
    meta = AttentionMetadata.build([1] * batch, [context] * batch, slots, tables, block_size, device)
    cache = torch.randn(2, len(blocks), block_size, kv_heads, head_dim, device=device).to(dtype)
    q = torch.randn(batch, heads, head_dim, device=device).to(dtype)
    k, v = torch.randn(2, batch, kv_heads, head_dim, device=device).to(dtype)
    return meta, [q, k, v, cache[0], cache[1]]


def timer(device: str) -> Callable[[Callable[[], object]], float]:
    """Median milliseconds of fn: triton's do_bench on CUDA, best of three wall clocks elsewhere."""
    if device.startswith("cuda"):
        import triton.testing

        return lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")

    def wall(fn: Callable[[], object]) -> float:
        fn()
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        return best * 1e3

    return wall


def graph_replay(fn: Callable[[], object]) -> Callable[[], object]:
    """fn captured in a CUDA graph (after a warm-up that compiles the kernels); returns the replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def bench_case(ta: object, tiles: object, args: argparse.Namespace, shape: tuple[int, int, int], batch: int,
               context: int) -> dict:
    heads, kv_heads, head_dim = shape
    dtype = DTYPES[args.dtype]
    meta, (q, k, v, kc, vc) = decode_case(batch, context, heads, kv_heads, head_dim, args.block_size, dtype,
                                          args.device)
    scale = head_dim ** -0.5
    backend = ta.TritonAttention(tiles)
    measure = timer(args.device)
    fast = lambda: backend.forward(q, k, v, kc, vc, meta, scale, None)
    ref = lambda: ReferenceAttention().forward(q, k, v, kc, vc, meta, scale, None)
    err = (fast().float() - ref().float()).abs().max().item()
    row = {"bench": "attention", "dtype": args.dtype, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
           "batch": batch, "context": context, "block_size": args.block_size,
           "plan": dataclasses.asdict(backend.plan(q, kc, meta)),
           "max_abs_err_vs_reference": err, "triton_ms": measure(fast)}
    if args.device.startswith("cuda"):
        row["triton_graph_ms"] = measure(graph_replay(fast))
        # SDPA over a contiguous cache holding the same tokens (GQA expanded by the kernel).
        kd = torch.randn(batch, kv_heads, context, head_dim, device=args.device).to(dtype)
        vd = torch.randn_like(kd)
        qd = q.unsqueeze(2)
        sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, scale=scale, enable_gqa=True)
        row["sdpa_ms"] = measure(sdpa)
        row["sdpa_graph_ms"] = measure(graph_replay(sdpa))
    if not args.skip_reference:
        row["reference_ms"] = measure(ref)
    kv_bytes = 2 * batch * context * kv_heads * head_dim * kc.element_size()
    best = row.get("triton_graph_ms", row["triton_ms"])
    row["triton_kv_gb_per_s"] = kv_bytes / (best * 1e-3) / 1e9
    if "sdpa_graph_ms" in row:  # the yardstick measured in the same run
        row["triton_over_sdpa"] = round(row["triton_graph_ms"] / row["sdpa_graph_ms"], 3)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--shapes", default="14,2,64;28,4,128", help="heads,kv_heads,head_dim;...")
    parser.add_argument("--batches", default="1,32,128")
    parser.add_argument("--contexts", default="256,2048")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--decode-block-n", type=int, default=None)
    parser.add_argument("--num-warps", type=int, default=None)
    parser.add_argument("--num-stages", type=int, default=None)
    parser.add_argument("--max-splits", type=int, default=None)
    parser.add_argument("--num-splits", type=int, default=None, help="fixed split count (default: heuristic)")
    parser.add_argument("--skip-reference", action="store_true", help="the reference is slow at batch 128")
    args = parser.parse_args()
    if not args.device.startswith("cuda"):
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported
    ta = importlib.import_module("inference.layers.triton_attention")
    overrides = {"decode_block_n": args.decode_block_n, "num_warps": args.num_warps,
                 "num_stages": args.num_stages, "max_splits": args.max_splits, "num_splits": args.num_splits}
    tiles = ta.TritonAttentionTiles(**{key: val for key, val in overrides.items() if val is not None})
    for spec in args.shapes.split(";"):
        shape = tuple(int(x) for x in spec.split(","))
        for batch in (int(x) for x in args.batches.split(",")):
            for context in (int(x) for x in args.contexts.split(",")):
                print(json.dumps(bench_case(ta, tiles, args, shape, batch, context)), flush=True)


if __name__ == "__main__":
    main()
