"""Speculative decoding throughput: tokens/s with and without the draft, per batch size (H200).

The pair: a target of --shape with random (dummy) bf16 weights and a draft made of the target's first
--draft-layers layers plus its embedding, final norm and LM head (the same seeded dummy values; an
untied head is copied). Random layers make such a draft a poor guesser, so the target's layers beyond
the draft are damped in place (their o_proj and down_proj scaled by the tail scale): they still cost
their full compute, and the pair agrees often, as a trained target and its small draft do. With
--tail-scale auto the scale is bisected (log scale) until the greedy acceptance rate at k lands in
--accept-band on calibration prompts; the measured runs use other prompts.

Greedy decoding, both engines with CUDA graphs; the script also reports whether both runs emitted
identical tokens. Nothing is written to disk but two config.json files. Run as
`python3 -m scripts.bench.spec [--shape qwen2.5-7b] [--draft-layers 1] [--batches 1,16]`.
One JSON line per batch size: tokens/s of each run, the ratio and the acceptance rate.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a file from a checkout too

from inference.core import SamplingParams
from inference.engine.llm import LLM
from scripts.bench.generate import SHAPES, hf_config

DAMPED = ("o_proj.weight", "down_proj.weight")


def config_dir(shape: str, layers: int, max_len: int) -> Path:
    cfg = hf_config(shape, layers, max_len)
    d = Path(tempfile.mkdtemp(prefix=f"bench-spec-{layers}l-"))
    cfg.save_pretrained(d)  # config.json only: load_format="dummy" makes the weights
    return d


def build(target: Path, draft: Path | None, args: argparse.Namespace) -> LLM:
    extra = {"draft_model": str(draft), "num_speculative_tokens": args.k} if draft is not None else {}
    return LLM(target, device="cuda", dtype="bfloat16", load_format="dummy", max_num_seqs=max(args.batches),
               max_model_len=args.max_len, kv_cache_bytes=args.kv_gib << 30, **extra)


def tail(model: torch.nn.Module, draft_layers: int) -> dict[str, torch.nn.Parameter]:
    """The parameters the damping scales: o_proj and down_proj of the layers beyond the draft's."""
    return {n: p for n, p in model.named_parameters()
            if n.startswith("model.layers.") and int(n.split(".")[2]) >= draft_layers and n.endswith(DAMPED)}


@torch.no_grad()
def tie_draft(llm: LLM, draft_layers: int) -> None:
    """Give the draft the target's head and check that its layers are the target's first ones."""
    target, draft = llm.worker.models["target"], llm.worker.models["draft"]
    t_params = dict(target.named_parameters())
    for name, p in draft.named_parameters():
        if name == "lm_head.weight" and not llm.model_config.tie_word_embeddings:
            p.copy_(t_params[name])
        elif not torch.equal(p.view(torch.uint8) if p.element_size() == 1 else p,  # FP8: compare the bytes
                             t_params[name].view(torch.uint8) if p.element_size() == 1 else t_params[name]):
            raise RuntimeError(f"draft {name} differs from the target's: the dummy weights did not line up")


def acceptance(llm: LLM, prompts: list[list[int]], new: int) -> float:
    before = (llm.spec_stats.proposed, llm.spec_stats.accepted)
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True))
    proposed = llm.spec_stats.proposed - before[0]
    return (llm.spec_stats.accepted - before[1]) / max(1, proposed)


@torch.no_grad()
def calibrate(llm: LLM, originals: dict[str, torch.Tensor], params: dict[str, torch.nn.Parameter],
              prompts: list[list[int]], band: tuple[float, float]) -> tuple[float, float]:
    """Bisect log(scale) until the acceptance rate lands in band; returns (scale, rate)."""
    lo, hi = math.log(1e-4), math.log(1.0)
    scale, rate = 1.0, 0.0
    for _ in range(12):
        scale = math.exp((lo + hi) / 2)
        for name, p in params.items():
            p.copy_(originals[name] * scale)
        rate = acceptance(llm, prompts, 32)
        if band[0] <= rate <= band[1]:
            break
        lo, hi = (math.log(scale), hi) if rate > band[1] else (lo, math.log(scale))
    return scale, rate


def timed(llm: LLM, prompts: list[list[int]], new: int, repeats: int) -> tuple[float, list[list[int]]]:
    """Best wall time of `repeats` greedy generations (after a short warm-up) and the tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    best, tokens = float("inf"), []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
        tokens = [o.outputs[0].token_ids for o in outs]
    return best, tokens


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen2.5-7b", choices=sorted(SHAPES))
    ap.add_argument("--draft-layers", type=int, default=1)
    ap.add_argument("--tail-scale", default="auto", help="a float, or 'auto' to calibrate")
    ap.add_argument("--accept-band", default="0.75,0.9")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--kv-gib", type=int, default=4)
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    lo, hi = (float(x) for x in args.accept_band.split(","))
    args.accept_band = (lo, hi)
    return args


def main() -> None:
    args = parse_args()
    target_dir = config_dir(args.shape, SHAPES[args.shape]["num_hidden_layers"], args.max_len)
    draft_dir = config_dir(args.shape, args.draft_layers, args.max_len)
    vocab = SHAPES[args.shape]["vocab_size"]
    gen = torch.Generator().manual_seed(0)
    calib_prompts = torch.randint(0, vocab, (4, args.prompt_len), generator=gen).tolist()
    prompt_sets = {b: torch.randint(0, vocab, (b, args.prompt_len), generator=gen).tolist() for b in args.batches}

    t0 = time.perf_counter()
    spec = build(target_dir, draft_dir, args)
    tie_draft(spec, args.draft_layers)
    params = tail(spec.worker.models["target"], args.draft_layers)
    originals = {n: p.detach().clone() for n, p in params.items()}
    if args.tail_scale == "auto":
        scale, calib_rate = calibrate(spec, originals, params, calib_prompts, args.accept_band)
    else:
        scale, calib_rate = float(args.tail_scale), None
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(originals[name] * scale)
    del originals
    spec_runs = {}
    for b in args.batches:
        before = (spec.spec_stats.proposed, spec.spec_stats.accepted)
        seconds, tokens = timed(spec, prompt_sets[b], args.new, args.repeats)
        rate = (spec.spec_stats.accepted - before[1]) / max(1, spec.spec_stats.proposed - before[0])
        spec_runs[b] = (seconds, tokens, rate)
    spec.worker.shutdown()
    del spec

    base = build(target_dir, None, args)
    with torch.no_grad():
        for p in tail(base.worker.models["target"], args.draft_layers).values():
            p.copy_(p * scale)  # the same bf16 product as the spec engine's originals * scale
    for b in args.batches:
        base_s, base_tokens = timed(base, prompt_sets[b], args.new, args.repeats)
        seconds, tokens, rate = spec_runs[b]
        n = b * args.new
        print(json.dumps({
            "bench": "spec_decode", "shape": args.shape, "draft_layers": args.draft_layers, "k": args.k,
            "batch": b, "new_tokens": args.new, "tail_scale": round(scale, 6),
            "calibration_acceptance": None if calib_rate is None else round(calib_rate, 4),
            "tokens_per_s_spec": round(n / seconds, 1), "tokens_per_s_target_only": round(n / base_s, 1),
            "speedup": round(base_s / seconds, 3), "acceptance_rate": round(rate, 4),
            "identical_greedy": tokens == base_tokens, "device": torch.cuda.get_device_name(),
            "wall_s": round(time.perf_counter() - t0, 1)}), flush=True)


if __name__ == "__main__":
    main()
