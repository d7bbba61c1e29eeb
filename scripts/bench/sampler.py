"""Benchmark the sampler at a GRPO batch: 512 rows x 151936 vocabulary, bf16 logits. One JSON line per case.

Cases: greedy, unseeded (temperature 1), seeded (temperature 1, a seed per row: what RL runs) and
seeded + top_p 0.9. Each line times, in the same run on the same logits:
  old_ms        the previous sampler (kept here as `old_sample`): a full [B, V] sort for top-k/top-p,
                torch's exponential noise, and a torch.Generator seeded per seeded row, every step
  new_ms        `sample_pairs`, eager (what the runner launches without graphs)
  new_graph_ms  the same captured in a CUDA graph (what a decode step replays)
  old_build_us  host: the previous SamplingBatch.build, which ran every step for seeded rows
  new_step_us   host: this step's batch from cached rows (positions array + one copy)
GPU times are triton's do_bench medians (they include the GPU's idle gaps when the host is the limit).

    python3 scripts/bench/sampler.py                     # H200
    python3 scripts/bench/sampler.py --rows 128 --vocab 32000
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from array import array
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

from inference.core import SamplingParams
from inference.sample.batch import SamplingBatch, position_seed
from inference.sample.sampler import row_stats, sample_pairs
from scripts.bench.attention import graph_replay, timer

CASES = {"greedy": (SamplingParams(temperature=0.0), False),
         "unseeded": (SamplingParams(temperature=1.0), False),
         "seeded": (SamplingParams(temperature=1.0), True),
         "seeded_top_p": (SamplingParams(temperature=1.0, top_p=0.9), True)}


def old_build(params: list[SamplingParams], seeds: list[int | None], positions: list[int], vocab: int,
              device: torch.device) -> dict:
    """The previous SamplingBatch.build: per-row lists, a tensor copy per field, a seed per (row, position)."""
    temps = [p.temperature for p in params]
    all_greedy = all(t == 0.0 for t in temps)

    def t(x: list, dtype: torch.dtype) -> torch.Tensor | None:
        return None if all_greedy else torch.tensor(x, dtype=dtype).to(device, non_blocking=True)

    top_ps = [p.top_p for p in params]
    return {"temperatures": t(temps, torch.float32), "top_ps": t(top_ps, torch.float32),
            "row_seeds": [None if s is None or p.greedy else position_seed(s, pos)
                          for p, s, pos in zip(params, seeds, positions)],
            "all_greedy": all_greedy, "any_top_p": any(p < 1.0 for p in top_ps)}


def old_sample(logits: torch.Tensor, sb: dict, generator: torch.Generator, out: torch.Tensor) -> torch.Tensor:
    """The previous sampler's path for these cases (raw logprobs, no top-k/min-p rows)."""
    raw = row_stats(logits)
    tokens = raw.argmax
    if not sb["all_greedy"]:
        temps = sb["temperatures"]
        x = logits.float() / torch.where(temps == 0.0, torch.ones_like(temps), temps)[:, None]
        if sb["any_top_p"]:
            sorted_x, order = x.sort(dim=-1, descending=True)
            probs = torch.softmax(sorted_x, dim=-1)
            drop = (probs.cumsum(dim=-1) - probs) >= sb["top_ps"][:, None]
            x = x.masked_fill(torch.zeros_like(drop).scatter_(-1, order, drop), float("-inf"))
        noise = torch.empty_like(x).exponential_(generator=generator)
        for row, seed in enumerate(sb["row_seeds"]):
            if seed is not None:
                g = torch.Generator(device=logits.device)
                g.manual_seed(seed)
                noise[row].exponential_(generator=g)
        tokens = torch.where(temps == 0.0, raw.argmax, (x - noise.log()).argmax(dim=-1))
    out[:, 0].copy_(tokens)
    out[:, 1].copy_(raw.logprobs(logits.gather(-1, tokens[:, None])).squeeze(-1))
    return out


def host_us(fn: Callable[[], object], reps: int = 50) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e6


def bench_case(name: str, args: argparse.Namespace, logits: torch.Tensor) -> dict:
    params, seeded = CASES[name]
    device, rows = logits.device, logits.shape[0]
    measure = timer("cuda")
    plist = [params] * rows
    seeds = [1000 + i for i in range(rows)] if seeded else [None] * rows
    positions = [300 + i % 7 for i in range(rows)]
    # the runner gives every row a noise seed (unseeded ones: from its seed and the sequence id)
    rows_sb = SamplingBatch.build_rows(plist, [s if s is not None else 7 + i for i, s in enumerate(seeds)],
                                       args.vocab, device)
    sb = rows_sb if rows_sb.all_greedy else rows_sb.at(torch.tensor(positions, device=device))
    old_sb = old_build(plist, seeds, positions, args.vocab, device)
    gen = torch.Generator(device).manual_seed(0)
    out_old, out_new = (torch.empty(rows, 2, dtype=torch.float64, device=device) for _ in range(2))
    old = lambda: old_sample(logits, old_sb, gen, out_old)
    new = lambda: sample_pairs(logits, sb, out_new)
    step = (lambda: rows_sb) if rows_sb.all_greedy else (
        lambda: rows_sb.at(torch.frombuffer(array("q", positions), dtype=torch.int64).to(device, non_blocking=True)))
    row = {"bench": "sampler", "case": name, "rows": rows, "vocab": args.vocab,
           "old_ms": round(measure(old), 4), "new_ms": round(measure(new), 4),
           "new_graph_ms": round(measure(graph_replay(new)), 4),
           "old_build_us": round(host_us(lambda: old_build(plist, seeds, positions, args.vocab, device)), 1),
           "new_step_us": round(host_us(step), 1)}
    row["speedup_eager"] = round(row["old_ms"] / row["new_ms"], 2)
    if params.greedy:
        row["tokens_equal_old"] = bool(torch.equal(old()[:, 0], new()[:, 0]))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    args = ap.parse_args()
    gen = torch.Generator("cuda").manual_seed(0)
    logits = (4 * torch.randn(args.rows, args.vocab, generator=gen, device="cuda")).to(torch.bfloat16)
    for name in args.cases:
        print(json.dumps(bench_case(name, args, logits)), flush=True)


if __name__ == "__main__":
    main()
