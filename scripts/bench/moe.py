"""Benchmark one MoE layer (router + grouped expert GEMMs, inference/layers/moe.py) at the Qwen3-30B-A3B
shape against its active-weight roofline: the bytes of the router and of the experts the step touches,
at the device-to-device copy bandwidth measured in the same run.

Prints one JSON line per token count: our time, the roofline, their ratio, the experts touched. Each
timing is a CUDA graph of LAYERS layer calls (each its own weights and routing, > L2) replayed under CUDA
events, as the engine's decode graphs run them.

    python3 scripts/bench/moe.py                  # tokens 1, 8, 64
    python3 scripts/bench/moe.py --tokens 1,256 --invariant
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

from inference.layers import moe

E, K, H, INTER = 128, 8, 2048, 768
LAYERS = 6  # 6 x 1.2 GB of experts: every call streams its experts from HBM


def timed(fn: object, reps: int = 20) -> float:
    """Seconds per replay of a CUDA graph of fn()."""
    fn()  # compile the kernels before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def copy_bandwidth() -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read + write counted)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / timed(lambda: dst.copy_(src))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1,8,64")
    ap.add_argument("--invariant", action="store_true", help="the batch-invariant mode's fixed tiles")
    args = ap.parse_args()
    bandwidth = copy_bandwidth()
    layers = [(torch.randn(E, 2 * INTER, H, device="cuda", dtype=torch.bfloat16) * 0.02,
               torch.randn(E, H, INTER, device="cuda", dtype=torch.bfloat16) * 0.02,
               torch.randn(E, H, device="cuda", dtype=torch.bfloat16) * 0.02) for _ in range(LAYERS)]
    for tokens in (int(t) for t in args.tokens.split(",")):
        xs = [torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]

        def step(xs: list[torch.Tensor] = xs) -> None:
            for x, (gate_up, down, router) in zip(xs, layers):
                weights, ids = moe.route(torch.nn.functional.linear(x, router), K, True)
                moe.experts_grouped(x, gate_up, down, ids, weights, moe.pick_block_m(ids.numel(), args.invariant))

        ours = timed(step) / LAYERS
        touched = []
        for x, (_, _, router) in zip(xs, layers):
            touched.append(moe.route(torch.nn.functional.linear(x, router), K, True)[1].unique().numel())
        experts = sum(touched) / len(touched)
        active = (experts * 3 * INTER * H + E * H) * 2  # bf16 bytes of the touched experts and the router
        roofline = active / bandwidth
        print(json.dumps({"bench": "moe_layer", "shape": "qwen3-30b-a3b", "tokens": tokens,
                          "invariant": args.invariant, "experts_touched": experts, "ours_us": round(ours * 1e6, 2),
                          "roofline_us": round(roofline * 1e6, 2), "ratio": round(ours / roofline, 3),
                          "copy_gbps": round(bandwidth / 1e9, 1)}))


if __name__ == "__main__":
    main()
