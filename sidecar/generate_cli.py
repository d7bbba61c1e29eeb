"""`sidecar generate`: run the engine in-process on a model directory (default: the embedded tiny model)."""

from __future__ import annotations

import argparse
import json
import time

from inference.core import InvalidRequestError, SamplingParams


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompts", nargs="*", default=["The quick brown fox", "Once upon a time"],
                   help="prompt strings (default: two short prompts)")
    p.add_argument("--model", default=None, help="HF model directory (default: the embedded tiny model)")
    p.add_argument("--device", default="auto", help="cuda, cpu or auto")
    p.add_argument("--dtype", default="auto", help="bfloat16, float32, ... or auto")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--json", action="store_true", help="print one JSON object per output")


def run(args: argparse.Namespace) -> int:
    from inference.llm import LLM

    try:
        params = SamplingParams(n=args.n, temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
        llm = LLM(args.model, device=args.device, dtype=args.dtype)
        start = time.perf_counter()
        outputs = llm.generate(args.prompts, params)
    except InvalidRequestError as e:
        print(f"sidecar generate: {e}")
        return 2
    seconds = time.perf_counter() - start
    tokens = 0
    for out in outputs:
        for c in out.outputs:
            tokens += len(c.token_ids)
            if args.json:
                print(json.dumps({"prompt": out.prompt, "index": c.index, "text": c.text, "token_ids": c.token_ids,
                                  "logprobs": c.logprobs, "finish_reason": c.finish_reason.value,
                                  "weight_version": out.weight_version}))
            else:
                print(f"{out.prompt!r} -> {c.text!r} ({c.finish_reason.value}, {len(c.token_ids)} tokens)")
    print(f"{tokens} tokens in {seconds:.2f} s ({tokens / max(seconds, 1e-9):.1f} tok/s) on {llm.worker.device}")
    return 0
