"""Where a decode step's GPU time goes: a kernel table of decode steps under torch.profiler.

A development tool (not a benchmark). Eager (default): the top kernels of a few engine steps. With
--graph: the captured decode graph of the batch's size replayed --steps times; prints the kernel table,
then one JSON line with the step's wall time, the sum of its kernel times and the idle time between
kernels (what launches and dependencies cost inside the graph). --trace PATH writes a chrome trace.
PDL is off here unless --pdl: with it, kernels overlap and per-kernel times add up to more than the step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a file from a checkout too

from inference.core import SamplingParams
from scripts.bench.generate import SHAPES, hf_model, our_llm


def kernel_spans(prof: profile) -> list[tuple[str, float, float]]:
    """(name, start us, duration us) of every GPU kernel the profiler saw, in start order."""
    spans = [(e.name, e.time_range.start, e.time_range.elapsed_us()) for e in prof.events()
             if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.elapsed_us() > 0]
    return sorted(spans, key=lambda s: s[1])


def graph_report(llm, batch: int, steps: int) -> tuple[profile, dict]:
    graphs = llm.worker.runner.graphs
    bs = next(b for b in graphs.sizes if b >= batch)
    for _ in range(5):
        graphs.graphs[bs].replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        graphs.graphs[bs].replay()
    end.record()
    torch.cuda.synchronize()
    step_us = start.elapsed_time(end) * 1e3 / steps
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            graphs.graphs[bs].replay()
        torch.cuda.synchronize()
    spans = kernel_spans(prof)
    busy = sum(d for _, _, d in spans) / steps
    per_name: dict[str, float] = defaultdict(float)
    for name, _, d in spans:
        per_name[name] += d / steps
    top = sorted(per_name.items(), key=lambda kv: -kv[1])[:12]
    return prof, dict(batch=batch, graph_size=bs, step_us=round(step_us, 1), kernels_per_step=len(spans) / steps,
                      kernel_us=round(busy, 1), idle_us=round(step_us - busy, 1),
                      top_us={k[:60]: round(v, 1) for k, v in top}, first_us=in_step_order(spans, steps))


def in_step_order(spans: list[tuple[str, float, float]], steps: int, first: int = 16) -> list:
    """[name, mean us] of a step's first `first` kernels in launch order (one layer and a bit): which
    launch of a kernel that runs several times a layer (the GEMV) costs what."""
    per_step = len(spans) // steps
    if per_step * steps != len(spans):
        return []
    return [[spans[j][0][:40], round(sum(spans[s * per_step + j][2] for s in range(steps)) / steps, 2)]
            for j in range(min(first, per_step))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen2-0.5b", choices=sorted(SHAPES))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--context", type=int, default=128, help="prompt tokens per row (the decode context)")
    ap.add_argument("--graph", action="store_true", help="profile the captured decode graph's replays")
    ap.add_argument("--trace", default="", help="write a chrome trace here")
    ap.add_argument("--pdl", action="store_true", help="keep programmatic dependent launch on")
    ap.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
                    help="the engine in the batch-invariant mode or not; unset: the engine's default")
    args = ap.parse_args()
    if not args.pdl:
        os.environ["SIDECAR_PDL"] = "0"  # read at each launch (inference/layers/pdl.py)
    max_len = max(512, args.context + 2 * args.steps + 16)
    mode = {} if args.batch_invariant is None else {"batch_invariant": args.batch_invariant}
    if args.batch_invariant:  # a decode step of the mode's kernels, not its own draft's rounds
        mode["self_draft"] = False
    llm = our_llm(hf_model(args.shape, max_len), args.batch, max_len, enforce_eager=not args.graph, **mode)
    prompts = [[1 + i] * args.context for i in range(args.batch)]
    params = SamplingParams(temperature=0.0, max_tokens=1 + 2 * args.steps, ignore_eos=True)
    ids = [llm.add_request(p, params) for p in prompts]
    llm.step()  # prefill
    for _ in range(args.steps // 2):
        llm.step()
    torch.cuda.synchronize()
    if args.graph:
        prof, report = graph_report(llm, args.batch, args.steps)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=60))
        print(json.dumps(report))
    else:
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps // 2):
                llm.step()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=60))
    if args.trace:
        prof.export_chrome_trace(args.trace)
    assert ids


if __name__ == "__main__":
    main()
