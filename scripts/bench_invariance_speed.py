"""The cost of the batch-invariant mode: tokens/s of each engine mode at fixed batch sizes, in one run, and
the mode's time per token over the default's (issue 23's bound: at most 1.10 at batch 1 and 128 of the
0.5B shape and batch 64 of the 7B shape). scripts/bench_invariance.py runs it after its cases.

Each batch: `batch` random prompts of --speed-prompt-len tokens, greedy, --new tokens each, ignore_eos,
timed after an untimed warm-up call of the same batch (Triton compiles; the decode graphs were captured
when the engine was built). Time per token is the call's wall time over the tokens each prompt gets (one
step per token), so it counts the prefill as a rollout does.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

from inference.core import SamplingParams
from inference.engine.llm import LLM

DEFAULT_BATCHES = {"tiny": (1, 8), "qwen2-0.5b": (1, 128), "qwen2.5-7b": (64,)}
BOUND = 1.10  # issue 23: the mode's time per token over the default's


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--speed-batches", default=None,
                    help="comma-separated batch sizes to time each engine mode at (0: none); default per shape: "
                         + ", ".join(f"{s} {','.join(map(str, b))}" for s, b in DEFAULT_BATCHES.items()))
    ap.add_argument("--speed-prompt-len", type=int, default=None, help="prompt tokens (default 128; tiny: 16)")


def resolve(args: argparse.Namespace) -> None:
    """Fill the speed defaults of args.shape (after parsing)."""
    text = args.speed_batches
    batches = DEFAULT_BATCHES[args.shape] if text is None else tuple(int(b) for b in text.split(",") if b.strip())
    args.speed_batches = [b for b in batches if b > 0]
    if args.speed_prompt_len is None:
        args.speed_prompt_len = 16 if args.shape == "tiny" else 128


def time_batch(llm: LLM, batch: int, args: argparse.Namespace) -> float:
    """Seconds per token step of one greedy call of `batch` prompts (after a warm-up call)."""
    rng = random.Random(args.seed + batch)
    vocab = llm.model_config.vocab_size
    prompts = [[rng.randrange(4, vocab) for _ in range(args.speed_prompt_len)] for _ in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=args.new, ignore_eos=True)
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    llm.block_manager.reset_prefix_cache()
    t0 = time.perf_counter()
    llm.generate(prompts, params)
    return (time.perf_counter() - t0) / args.new


def speed_lines(args: argparse.Namespace, build: Callable[..., LLM], release: Callable[[LLM], None],
                device: str) -> list[dict[str, object]]:
    """One line per (engine mode, batch), then one per batch with the mode's time per token over the
    default's when both modes ran."""
    per_token: dict[tuple[str, int], float] = {}
    for engine in args.engines:
        llm = build(args, invariant=engine == "invariant")
        for batch in args.speed_batches:
            per_token[engine, batch] = time_batch(llm, batch, args)
        release(llm)
    lines: list[dict[str, object]] = []
    for (engine, batch), seconds in per_token.items():
        lines.append({"bench": "invariance_speed", "shape": args.shape, "engine": engine, "batch": batch,
                      "prompt_len": args.speed_prompt_len, "new_tokens": args.new,
                      "ms_per_token": round(1e3 * seconds, 3), "tokens_per_s": round(batch / seconds, 1),
                      "device": device})
    for batch in args.speed_batches:
        if ("invariant", batch) in per_token and ("default", batch) in per_token:
            ratio = per_token["invariant", batch] / per_token["default", batch]
            lines.append({"bench": "invariance_cost", "shape": args.shape, "batch": batch,
                          "mode_over_default": round(ratio, 3), "bound": BOUND, "within": ratio <= BOUND,
                          "device": device})
    return lines
