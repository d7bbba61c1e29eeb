"""The first GRPO batch after start-up against the second, on an empty kernel cache (a fresh machine).

In this process, with TRITON_CACHE_DIR pointed at a new empty folder (removed at the end), the engine
is built as `inference.LLM(...)` builds it (its start-up warm-up included: inference/engine/warm_up.py),
then the batch of scripts/bench/rollout.py (64 prompts x 8 samples of the 0.5B shape, seeded, by
default) runs twice: the second time with other prompts of the same lengths and the same sample
lengths (so no prefix-cache hit and the same schedule). One JSON line: construction and warm-up
seconds, both batch times and tok/s, and first / second (the goal: at most 1.10). On CUDA it also counts
the Triton kernels compiled in each phase (Triton's post-compile hook): `compiled_in_first` names what
the first batch compiled that the start-up warm-up did not (each specialization in full on stderr), the
warm-up's gap to close.

    python3 -m scripts.bench.first_batch                               # qwen2-0.5b, seeded (GPU)
    python3 -m scripts.bench.first_batch --shape tiny --prompts 2 --samples 2 --len-cap 8   # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a file from a checkout too


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen2-0.5b", help="qwen2-0.5b, qwen2.5-7b or tiny")
    ap.add_argument("--mode", default="seeded", choices=["greedy", "sampled", "seeded"])
    return ap.parse_known_args(argv)  # the rest: scripts/bench/rollout.py's workload and engine options


def main(argv: list[str] | None = None) -> dict[str, object]:
    args, rest = parse_args(argv)
    cache = tempfile.mkdtemp(prefix="first-batch-triton-")
    before = os.environ.get("TRITON_CACHE_DIR")
    os.environ["TRITON_CACHE_DIR"] = cache  # before Triton is imported: nothing compiled is found
    try:
        return _measure(args, rest, cache)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
        if before is None:
            os.environ.pop("TRITON_CACHE_DIR", None)
        else:
            os.environ["TRITON_CACHE_DIR"] = before


def _measure(args: argparse.Namespace, rest: list[str], cache: str) -> dict[str, object]:
    import torch

    from scripts.bench import rollout

    ropts = rollout.parse_args(["--shapes", args.shape, *rest])
    max_len = ropts.prompt_max + ropts.len_cap
    t0 = time.perf_counter()
    llm = rollout.build_llm(args.shape, ropts, max_len)
    built_s = time.perf_counter() - t0
    vocab = llm.model_config.vocab_size
    first = rollout.draw_workload(ropts, vocab, ropts.seed)
    other = rollout.draw_workload(ropts, vocab, ropts.seed + 7)
    second = rollout.Workload(_same_lengths(other.prompts, first.prompts, vocab), first.lengths)
    times = []
    compiles = CompileLog.install()
    for phase, work in (("first", first), ("second", second)):
        compiles.phase = phase
        _sync(torch)
        t = time.perf_counter()
        rollout.run(llm, work, args.mode)
        _sync(torch)
        times.append(time.perf_counter() - t)
    compiles.uninstall()
    tokens = first.num_tokens
    line = {"bench": "first_batch", "shape": args.shape, "mode": args.mode, "device": str(llm.worker.device),
            "samples": first.num_samples, "tokens": tokens, "kernel_cache": "empty (" + cache + ")",
            "build_s": round(built_s, 2), "warm_up_s": round(llm.warm_up_s, 2),
            "first_s": round(times[0], 4), "second_s": round(times[1], 4),
            "first_tok_s": round(tokens / times[0]), "second_tok_s": round(tokens / times[1]),
            "first_over_second": round(times[0] / times[1], 3),
            "compiled": compiles.counts(), "compiled_in_first": compiles.names("first")}
    for text in compiles.seen.get("first", []):
        print(f"first_batch: compiled in the first batch: {text}", file=sys.stderr, flush=True)
    print(json.dumps(line), flush=True)
    return line


class CompileLog:
    """Triton's compiles per phase, through its post-compile hook (a kernel specialization not found in this
    process's memory: compiled, or loaded from the disk cache, which is empty here). None on CPU."""

    def __init__(self, hooked: bool) -> None:
        self.hooked = hooked
        self.phase = "first"
        self.seen: dict[str, list[str]] = {}
        self._before = None

    @classmethod
    def install(cls) -> CompileLog:
        import torch

        if not torch.cuda.is_available():
            return cls(False)
        from triton import knobs

        log = cls(True)
        log._before = knobs.runtime.jit_post_compile_hook
        knobs.runtime.jit_post_compile_hook = log._hook
        return log

    def uninstall(self) -> None:
        if self.hooked:
            from triton import knobs

            knobs.runtime.jit_post_compile_hook = self._before

    def _hook(self, **info: object) -> None:  # Triton passes key, repr, fn, compile, ... by keyword
        self.seen.setdefault(self.phase, []).append(str(info["repr"]))

    def counts(self) -> dict[str, int] | None:
        return {p: len(self.seen.get(p, [])) for p in ("first", "second")} if self.hooked else None

    def names(self, phase: str) -> dict[str, int] | None:
        """Kernel name -> specializations compiled in `phase`."""
        if not self.hooked:
            return None
        out: dict[str, int] = {}
        for text in self.seen.get(phase, []):
            name = text.split("[", 1)[0]
            out[name] = out.get(name, 0) + 1
        return out


def _same_lengths(prompts: list[list[int]], like: list[list[int]], vocab: int) -> list[list[int]]:
    """Prompts of `like`'s lengths with other tokens (no prefix-cache hit on the first batch's)."""
    out = []
    for i, (p, q) in enumerate(zip(prompts, like)):
        tokens = (p * (len(q) // max(1, len(p)) + 1))[:len(q)]
        out.append([(t + 1 + i) % vocab for t in tokens])
    return out


def _sync(torch: object) -> None:
    cuda = torch.cuda  # type: ignore[attr-defined]
    if cuda.is_available():
        cuda.synchronize()


if __name__ == "__main__":
    main()
