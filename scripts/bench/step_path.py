"""The cost of a decode step through `sidecar launch` (HTTP process + rank process) against in-process `LLM`.

Both run the same engine configuration (the sidecar's own EngineConfig, built from the same launch
arguments) on the same device, with the same torch thread count and a frozen warm heap, one after
the other (the idle one only waits). A step's cost is measured free of prefill and of per-call
overhead (HTTP, tokenization, the first step): for each batch size, one greedy ignore_eos call of
`--short` and one of `--long` max_tokens, and per-step time = (T(long) - T(short)) / (long - short),
medians over `--repeats` rounds that alternate which path runs first. One JSON line per batch size:
sidecar_step_us, inprocess_step_us and ratio = sidecar / in-process (1.0: the sidecar's path adds
nothing per step), and the same from the fastest call of each kind (`_min`: steadier on a busy host).

    python3 scripts/bench/step_path.py                                   # CPU, the tiny model, batch 1 and 128
    python3 scripts/bench/step_path.py --device cuda --model qwen2-0.5b  # the 0.5B shape, random bf16 weights
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a file from a checkout too

REPO = Path(__file__).resolve().parents[2]


def model_dir(name: str) -> str:
    """The tiny model, the 0.5B shape with seeded random weights (built once into the model cache, as
    `sidecar demo --model qwen2-0.5b` does), or a directory."""
    if name in ("tiny", "qwen2-0.5b"):
        from sidecar.demo.task import resolve_model

        return str(resolve_model(name).path)
    return name


def launch_settings(args: argparse.Namespace, model: str) -> dict[str, Any]:
    """The launch settings both paths run with (LaunchConfig field -> value)."""
    return {"model": model, "device": args.device, "threads": args.threads, "kv_cache_bytes": args.kv_cache_bytes,
            "log_level": "warning"}


def launch_argv(settings: dict[str, Any]) -> list[str]:
    return [arg for k, v in settings.items() for arg in (f"--{k.replace('_', '-')}", str(v))]


class Sidecar:
    """`sidecar launch` on a free port, stopped on exit."""

    def __init__(self, argv: list[str]) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
        self.proc = subprocess.Popen([sys.executable, "-m", "sidecar.cli.main", "launch", "--port", "0", *argv],
                                     cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            match = re.search(r"Sidecar serving on (http://\S+)", line)
            if match:
                self.url = match.group(1)
                threading.Thread(target=self.proc.stdout.read, daemon=True).start()  # keep the pipe drained
                return
        raise SystemExit(f"sidecar exited with {self.proc.wait()} before serving")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def inprocess_engine(args: argparse.Namespace, model: str) -> Any:
    """An LLM built from the EngineConfig the sidecar's ranks build from the same arguments."""
    import torch

    from inference.engine.llm import LLM
    from inference.memory.host_heap import freeze_startup_heap
    from sidecar.config import build_config, engine_config

    torch.set_num_threads(args.threads)
    cfg = build_config(launch_settings(args, model))
    llm = LLM(config=engine_config(cfg, model, args.device))
    freeze_startup_heap()  # as every rank does once built
    return llm


def timed_inprocess(llm: Any, prompts: list[list[int]], tokens: int) -> float:
    from inference.core import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    took = time.perf_counter() - t0
    assert all(len(o.outputs[0].token_ids) == tokens for o in outs)
    return took


def timed_sidecar(web: Any, prompts: list[list[int]], tokens: int) -> float:
    body = {"prompts": prompts, "sampling_params": {"temperature": 0.0, "max_tokens": tokens, "ignore_eos": True}}
    t0 = time.perf_counter()
    resp = web.post("/generate", json=body)
    took = time.perf_counter() - t0
    resp.raise_for_status()
    outs = resp.json()["outputs"]
    assert all(len(o["completions"][0]["token_ids"]) == tokens for o in outs), resp.text[:300]
    return took


def per_step_us(short: list[float], long: list[float], steps: int, stat: Any = statistics.median) -> float:
    return (stat(long) - stat(short)) / steps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--model", default=None, help="tiny, qwen2-0.5b or a directory (default: tiny on cpu, "
                                                  "qwen2-0.5b on cuda)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 128])
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--short", type=int, default=None, help="max_tokens of the short call (default 8 cpu, 32 cuda)")
    ap.add_argument("--long", type=int, default=None, help="max_tokens of the long call (default 40 cpu, 288 cuda)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch threads of the rank and of this process "
                                                                "(default: 1, the rank's default on cuda)")
    ap.add_argument("--kv-cache-bytes", type=int, default=None, help="per engine (default 64 MiB cpu, 4 GiB cuda)")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    args.model = args.model or ("qwen2-0.5b" if cuda else "tiny")
    args.short = args.short or (32 if cuda else 8)
    args.long = args.long or (288 if cuda else 40)
    args.threads = args.threads or 1
    args.kv_cache_bytes = args.kv_cache_bytes or ((4 << 30) if cuda else (64 << 20))
    import httpx
    import torch

    model = model_dir(args.model)
    sidecar = Sidecar(launch_argv(launch_settings(args, model)))
    try:
        llm = inprocess_engine(args, model)
        vocab = llm.model_config.vocab_size
        gen = torch.Generator().manual_seed(0)
        with httpx.Client(base_url=sidecar.url, timeout=600) as web:
            for batch in args.batch:
                prompts = torch.randint(10, vocab, (batch, args.prompt_len), generator=gen).tolist()
                times: dict[str, list[float]] = {"in_short": [], "in_long": [], "sc_short": [], "sc_long": []}
                for round_ in range(args.repeats + 1):  # round 0 warms both paths (graphs, allocator, caches)
                    gc.collect()
                    runs = [("in", timed_inprocess, llm), ("sc", timed_sidecar, web)]
                    sample = {f"{path}_{which}": run(engine, prompts, n)
                              for path, run, engine in runs[::1 if round_ % 2 else -1]
                              for which, n in (("short", args.short), ("long", args.long))}
                    if round_:
                        for k, v in sample.items():
                            times[k].append(v)
                steps = args.long - args.short
                sc = per_step_us(times["sc_short"], times["sc_long"], steps)
                inp = per_step_us(times["in_short"], times["in_long"], steps)
                sc_min = per_step_us(times["sc_short"], times["sc_long"], steps, min)
                in_min = per_step_us(times["in_short"], times["in_long"], steps, min)
                print(json.dumps({"device": args.device, "model": args.model, "batch": batch,
                                  "prompt_len": args.prompt_len, "short": args.short, "long": args.long,
                                  "repeats": args.repeats, "threads": args.threads, "sidecar_step_us": round(sc, 1),
                                  "inprocess_step_us": round(inp, 1), "ratio": round(sc / inp, 4),
                                  "sidecar_step_us_min": round(sc_min, 1), "inprocess_step_us_min": round(in_min, 1),
                                  "ratio_min": round(sc_min / in_min, 4),
                                  "sidecar_long_s": round(statistics.median(times["sc_long"]), 4),
                                  "inprocess_long_s": round(statistics.median(times["in_long"]), 4)}), flush=True)
    finally:
        sidecar.stop()


if __name__ == "__main__":
    main()
