"""Speculative decoding throughput: tokens/s with and without the draft, at batch 1 and 16 (H200).

Target: the Qwen2-0.5B shape with random bf16 weights. Draft: a truncated copy of the target (its
first N layers plus its embedding, final norm and head). Random layers make a truncated copy a poor
guesser, so the target's layers beyond N are damped (their o_proj and down_proj scaled by
--tail-scale): they still cost their full compute, and the pair agrees often, as a trained target and
its small draft do. Greedy decoding; the script also checks that both runs emit identical tokens.
One JSON line per batch size: tokens/s of each run, the speedup and the acceptance rate.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from inference.core import SamplingParams
from inference.llm import LLM
from scripts.bench_generate import SHAPES


def checkpoint_dirs(shape: str, draft_layers: int, max_len: int) -> tuple[Path, Path]:
    """config.json of the target and of its truncated draft (the weights are set after loading)."""
    import transformers

    dirs = []
    for layers in (SHAPES[shape]["num_hidden_layers"], draft_layers):
        cfg = transformers.Qwen2Config(**{**SHAPES[shape], "num_hidden_layers": layers},
                                       max_position_embeddings=max_len, rms_norm_eps=1e-6)
        cfg.rope_parameters = {"rope_type": "default", "rope_theta": 1000000.0}
        d = Path(tempfile.mkdtemp(prefix=f"bench-spec-{layers}l-"))
        cfg.save_pretrained(d)
        dirs.append(d)
    return dirs[0], dirs[1]


def target_weights(llm: LLM, draft_layers: int, tail_scale: float) -> dict[str, torch.Tensor]:
    """The target's (seeded dummy) weights with the layers beyond the draft damped, in HF names."""
    state = {}
    for name, p in llm.worker.models["target"].named_parameters():
        t = p.detach().clone()
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else -1
        if layer >= draft_layers and name.endswith(("o_proj.weight", "down_proj.weight")):
            t *= tail_scale
        state[name] = t
    return state


def build(target: Path, draft: Path | None, args: argparse.Namespace, state: dict | None) -> LLM:
    extra = {"draft_model": str(draft), "num_speculative_tokens": args.k} if draft is not None else {}
    llm = LLM(target, device=args.device, dtype=args.dtype, load_format="dummy", max_num_seqs=max(args.batches),
              max_model_len=args.max_len, kv_cache_bytes=args.kv_gib << 30, **extra)
    if state is not None:
        load_our_names(llm.worker.models["target"], state)
        if draft is not None:
            load_our_names(llm.worker.models["draft"], state)  # the draft's names are a subset
        llm.block_manager.reset_prefix_cache()
    return llm


@torch.no_grad()
def load_our_names(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy engine-named tensors (fused qkv / gate_up names) into a model's parameters of the same name."""
    for name, p in model.named_parameters():
        p.copy_(state[name])


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def warm(llm: LLM, prompts: list[list[int]]) -> None:
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))


def run(llm: LLM, prompts: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    sync()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    sync()
    return time.perf_counter() - t0, [o.outputs[0].token_ids for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen2-0.5b", choices=sorted(SHAPES))
    ap.add_argument("--draft-layers", type=int, default=4)
    ap.add_argument("--tail-scale", type=float, default=0.05)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--kv-gib", type=int, default=4)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    target_dir, draft_dir = checkpoint_dirs(args.shape, args.draft_layers, args.max_len)
    base = build(target_dir, None, args, None)
    state = target_weights(base, args.draft_layers, args.tail_scale)
    load_our_names(base.worker.models["target"], state)
    vocab = base.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompt_sets = {b: torch.randint(0, vocab, (b, args.prompt_len), generator=gen).tolist() for b in args.batches}
    baseline = {}
    for b in args.batches:
        warm(base, prompt_sets[b])
        baseline[b] = run(base, prompt_sets[b], args.new)
    base.worker.shutdown()
    del base
    spec = build(target_dir, draft_dir, args, state)
    for b in args.batches:
        warm(spec, prompt_sets[b])
        before = (spec.spec_stats.proposed, spec.spec_stats.accepted)
        seconds, tokens = run(spec, prompt_sets[b], args.new)
        proposed = spec.spec_stats.proposed - before[0]
        accepted = spec.spec_stats.accepted - before[1]
        base_s, base_tokens = baseline[b]
        n = b * args.new
        print(json.dumps({
            "bench": "spec_decode", "shape": args.shape, "draft_layers": args.draft_layers, "k": args.k,
            "batch": b, "new_tokens": args.new, "tail_scale": args.tail_scale,
            "tokens_per_s_spec": round(n / seconds, 1), "tokens_per_s_target_only": round(n / base_s, 1),
            "speedup": round(base_s / seconds, 3),
            "acceptance_rate": round(accepted / proposed, 4) if proposed else None,
            "identical_greedy": tokens == base_tokens,
            "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device}))


if __name__ == "__main__":
    main()
