"""`sidecar generate`: run the engine in-process on a model directory (default: the embedded tiny model).

It builds an engine of its own in this process: a running `sidecar launch` is neither used nor
needed (query that one over HTTP: /generate, /v1/completions, /v1/chat/completions). With --json,
stdout holds only JSON lines (one per completion); the timing line goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from inference.core import InvalidRequestError, SamplingParams
from sidecar.cli.common import check_device


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompts", nargs="*", default=["The quick brown fox", "Once upon a time"],
                   help="prompt strings (default: two short prompts)")
    p.add_argument("--model", default=None, metavar="DIR",
                   help="HF model directory (default: the embedded tiny model, whose random weights write "
                        "gibberish)")
    p.add_argument("--device", default="auto", help="cuda, cpu or auto (cuda when available)")
    p.add_argument("--dtype", default="auto", help="bfloat16, float16, float32, model (the checkpoint's) or "
                                                   "auto (bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--max-tokens", type=int, default=32, help="new tokens per completion")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--n", type=int, default=1, help="completions per prompt")
    p.add_argument("--seed", type=int, default=None, help="seed of every completion's sampling")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object per completion on stdout and nothing else (timing on stderr)")


def run(args: argparse.Namespace) -> int:
    from inference.engine.llm import LLM

    try:
        params = SamplingParams(n=args.n, temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
        llm = LLM(args.model, device=check_device(args.device), dtype=args.dtype)
        start = time.perf_counter()
        outputs = llm.generate(args.prompts, params)
    except InvalidRequestError as e:
        print(f"sidecar generate: error: {e}", file=sys.stderr)
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
    print(f"{tokens} tokens in {seconds:.2f} s ({tokens / max(seconds, 1e-9):.1f} tok/s) on {llm.worker.device}",
          file=sys.stderr if args.json else sys.stdout)
    return 0
