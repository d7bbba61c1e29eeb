"""Where a decode step's GPU time goes: kernel table of eager decode steps under torch.profiler.

A development tool (not a benchmark): prints the top kernels by total CUDA time for one shape/batch.
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from inference.core import SamplingParams
from scripts.bench_generate import SHAPES, hf_model, our_llm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen2-0.5b", choices=sorted(SHAPES))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    llm = our_llm(hf_model(args.shape, 512), args.batch, 512, enforce_eager=True)
    prompts = [[1 + i] * 64 for i in range(args.batch)]
    params = SamplingParams(temperature=0.0, max_tokens=1 + 2 * args.steps, ignore_eos=True)
    ids = [llm.add_request(p, params) for p in prompts]
    llm.step()  # prefill
    for _ in range(args.steps // 2):
        llm.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps // 2):
            llm.step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=60))
    assert ids


if __name__ == "__main__":
    main()
