"""Generation throughput: our engine against Hugging Face transformers on the same weights and prompts.

One JSON line per case (shape, batch): our tokens/s, transformers `generate` with a static cache
(torch.compile), plain `generate` (its dynamic cache, eager), `generate_batch` where present, the ratios
(`ratio_vs_best_hf`: against the fastest of those that ran; a peer that fails gets `hf_<peer>_error`),
and our decode step against its roofline: the bytes the step reads (every weight but an untied embedding,
which is gathered by row; of an MoE model's experts only those the step touched, counted from the routing
the engine records) over the device-to-device copy rate measured in the same run. The step is one replay
of the batch's decode graph (padding rows included: their experts are read too); without graphs (CPU,
--enforce-eager) the median wall time of a decode step. Greedy, ignore_eos, random bf16 weights (the HF
model's own random init, copied into ours). `--layers` cuts a shape (a 48-layer Qwen3-30B-A3B is 61 GB in
bf16: ours and transformers' copies fit one GPU at 16 layers; the roofline counts the layers built).
`--quantization bf16,fp8`: our engine also in FP8 (docs/fp8.md; the same weights quantized as they load),
one row per quantization with its own roofline (FP8: the linears' bytes halved, plus their scales), the
FP8 row's `fp8_over_bf16` tok/s and the share of prompts whose first 8 greedy tokens equal bf16's.
`--batch-invariant` / `--no-batch-invariant`: our engine in the batch-invariant mode or not (unset: the
engine's default); every row says which (`batch_invariant`).

    python3 -m scripts.bench.generate --batch 1 128
    python3 -m scripts.bench.generate --shape qwen3-30b-a3b --layers 16 --batch 1 64 --peers plain
    python3 -m scripts.bench.generate --shape qwen3-moe-tiny --device cpu --batch 1 4 --peers plain   # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a file from a checkout too

from inference.core import SamplingParams
from inference.engine.llm import LLM
from inference.engine.step_stats import StepLog
from inference.models.loader import load_named_tensors
from scripts.bench.experts_touched import touched_per_layer
from scripts.bench.rollout_cost import ModelCost, copy_rate, sync

if TYPE_CHECKING:
    from transformers import PretrainedConfig

SHAPES: dict[str, dict] = {
    "qwen2-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                       intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False),
    # Qwen3-30B-A3B: 128 experts of 768, 8 per token (docs/moe.md); --layers cuts it to fit ours and
    # transformers' copies on one GPU (48 layers are 61 GB each in bf16).
    "qwen3-30b-a3b": dict(config="Qwen3MoeConfig", hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, intermediate_size=6144, moe_intermediate_size=768,
                          num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, vocab_size=151936,
                          tie_word_embeddings=False),
    # the A3B's structure at a size the CPU runs in seconds: the MoE benchmarks' smoke tests
    "qwen3-moe-tiny": dict(config="Qwen3MoeConfig", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, intermediate_size=128, moe_intermediate_size=32,
                           num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, vocab_size=512,
                           tie_word_embeddings=False),
}


def hf_config(shape: str, layers: int | None, max_len: int) -> PretrainedConfig:
    """The transformers config of a shape (Qwen2Config unless the shape names another), cut to `layers`
    decoder layers when given."""
    import transformers

    kw = dict(SHAPES[shape])
    config_class = getattr(transformers, kw.pop("config", "Qwen2Config"))
    if layers:
        kw["num_hidden_layers"] = layers
    cfg = config_class(**kw, max_position_embeddings=max_len, rms_norm_eps=1e-6)
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": 1000000.0}
    return cfg


def hf_model(shape: str, max_len: int, layers: int | None = None, device: str = "cuda",
             experts: str = "") -> torch.nn.Module:
    """The transformers model of a shape with its own random init, on `device`; `experts`: its experts
    implementation (an MoE shape; "": transformers' default)."""
    import transformers

    cfg = hf_config(shape, layers, max_len)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    if experts:
        model.set_experts_implementation(experts)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


QUANTIZATIONS = {"bf16": "none", "fp8": "fp8"}  # --quantization label -> EngineConfig.quantization
PEERS = ("static", "plain", "batch")  # transformers' modes (--peers)


def our_llm(hf: torch.nn.Module, max_batch: int, max_len: int, enforce_eager: bool, device: str = "cuda",
            **engine: object) -> LLM:
    with tempfile.TemporaryDirectory(prefix="bench-gen-") as d:
        hf.config.save_pretrained(d)  # config.json only (read at construction): the weights come from hf itself
        llm = LLM(d, device=device, dtype="bfloat16", load_format="dummy", max_num_seqs=max_batch,
                  max_model_len=max_len, enforce_eager=enforce_eager, gpu_memory_utilization=0.6, **engine)
    load_named_tensors(llm.worker.models["target"], hf.state_dict().items())
    return llm


def timed(fn: Callable[[], object], device: torch.device, repeats: int = 1) -> float:
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def ours(llm: LLM, prompts: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
    outs: list = []
    seconds = timed(lambda: outs.append(llm.generate(prompts, params)), llm.worker.device, repeats=2)
    return seconds, [o.outputs[0].token_ids for o in outs[-1]]


def decode_step(llm: LLM, prompts: list[list[int]]) -> tuple[float, int, str]:
    """(ms, rows, how) of one decode step of len(prompts) rows: the GPU time of one replay of the graph
    that holds the batch (rows: the graph's, padding included; how "graph"), or, without graphs, the
    median wall time of the decode steps of a short generate (rows: the batch; how "step_wall"). Either
    way the last forward was that step, so the routing buffer holds its rows."""
    batch = len(prompts)
    graphs = llm.worker.runner.graphs if llm.worker.runner is not None else None
    if graphs is None:
        llm.step_log = StepLog()
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        records, llm.step_log = llm.step_log.records, None
        walls = [r.end_s - r.start_s for r in records if r.num_decode == r.num_seqs == batch and not r.prefill_tokens]
        return 1e3 * statistics.median(walls), batch, "step_wall"
    bs = next(b for b in graphs.sizes if b >= batch)
    for _ in range(3):
        graphs.graphs[bs].replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(50):
        graphs.graphs[bs].replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 50, bs, "graph"


def last_step_experts(llm: LLM, rows: int) -> list[int] | None:
    """Per MoE layer, the experts the last forward's first `rows` rows went to (None: a dense model)."""
    capture = llm.worker.runner.routing if llm.worker.runner is not None else None
    if capture is None:
        return None
    sync(llm.worker.device)
    return touched_per_layer(capture.buffer[:rows].cpu().numpy(), llm.model_config.num_experts).tolist()


def hf_generate(model: torch.nn.Module, prompts: list[list[int]], new: int, static: bool,
                ours: list[list[int]]) -> tuple[float, float]:
    """Seconds, and the fraction of prompts whose first 8 greedy tokens equal ours (bf16 drifts later)."""
    ids = torch.tensor(prompts, device=model.device)
    kw = dict(max_new_tokens=new, do_sample=False, attention_mask=torch.ones_like(ids))
    if static:
        kw["cache_implementation"] = "static"
        for _ in range(2):  # compile and warm up
            model.generate(ids, **kw)
    out: list = []
    seconds = timed(lambda: out.append(model.generate(ids, **kw)), model.device)
    theirs = out[-1][:, ids.shape[1]:].tolist()
    return seconds, sum(a[:8] == b[:8] for a, b in zip(theirs, ours)) / len(ours)


def hf_generate_batch(model: torch.nn.Module, prompts: list[list[int]], new: int) -> float | None:
    if not hasattr(model, "generate_batch"):
        return None
    from transformers import GenerationConfig

    cfg = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
    return timed(lambda: model.generate_batch(inputs=prompts, generation_config=cfg), model.device)


def run_peer(model: torch.nn.Module, peer: str, prompts: list[list[int]], new: int,
             tokens: list[list[int]]) -> tuple[float | None, float | None, str | None]:
    """(seconds, greedy prefix match, error) of one transformers mode; a mode that fails (a cache setting
    the model's experts do not support, say) is reported, not fatal: the other modes still run."""
    try:
        if peer == "batch":
            return hf_generate_batch(model, prompts, new), None, None
        return (*hf_generate(model, prompts, new, peer == "static", tokens), None)
    except Exception as e:  # the row names the failure; the run goes on
        if model.device.type == "cuda":
            torch.cuda.empty_cache()
        return None, None, f"{type(e).__name__}: {str(e)[:300]}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen2-0.5b", choices=sorted(SHAPES))
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 128])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--peers", nargs="*", default=list(PEERS),
                    help="transformers modes to run (static: static cache + torch.compile; plain: its default "
                         "dynamic cache, eager; batch: generate_batch)")
    ap.add_argument("--hf-experts", default="", help="transformers' experts implementation for an MoE shape "
                                                     "(eager, grouped_mm, batched_mm; default: transformers' own)")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--quantization", default="bf16", help="comma list of bf16 and fp8 (our engine's weights)")
    ap.add_argument("--layers", type=int, default=None, help="fewer decoder layers than the shape has")
    ap.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
                    help="the batch-invariant mode on or off (docs/invariance.md); unset: the engine's default")
    ap.add_argument("--device", default="auto", help="cuda (auto when there is one) or cpu (the smoke test)")
    args = ap.parse_args()
    mode = {} if args.batch_invariant is None else {"batch_invariant": args.batch_invariant}
    quantizations = [q for q in args.quantization.split(",") if q]
    if any(q not in QUANTIZATIONS for q in quantizations):
        ap.error(f"--quantization: a comma list of {', '.join(QUANTIZATIONS)}")
    if any(p not in PEERS for p in args.peers):
        ap.error(f"--peers: any of {', '.join(PEERS)} (none: ours alone)")
    if args.hf_experts and "config" not in SHAPES[args.shape]:
        ap.error(f"--hf-experts: {args.shape} is a dense shape")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    max_len = args.prompt_len + args.new_tokens + 16
    hf = hf_model(args.shape, max(max_len, 512), args.layers, args.device, args.hf_experts)
    bw = copy_rate(torch.device(args.device)) / 1e9
    g = torch.Generator().manual_seed(0)
    prompts = {b: torch.randint(0, SHAPES[args.shape]["vocab_size"], (b, args.prompt_len), generator=g).tolist()
               for b in args.batch}
    peers: dict[tuple[int, str], tuple] = {}  # (batch, peer) -> (seconds, match, error)
    base: dict[int, tuple[float, list[list[int]]]] = {}  # batch -> the first quantization's (tok/s, tokens)
    for quant in quantizations:
        llm = our_llm(hf, max(args.batch), max_len, args.enforce_eager, args.device,
                      quantization=QUANTIZATIONS[quant], **mode)
        cost = ModelCost.of(llm)
        for batch in args.batch:
            row = run_batch(llm, hf, args, batch, prompts[batch], cost, bw, peers)
            row.update(quantization=quant, batch_invariant=llm.config.batch_invariant,
                       self_draft=llm.worker.spec is not None and llm.worker.spec.shares_kv)
            if quant == quantizations[0]:
                base[batch] = (row["ours_tok_s"], row.pop("_tokens"))
            else:
                tokens = row.pop("_tokens")
                row[f"{quant}_over_{quantizations[0]}"] = round(row["ours_tok_s"] / base[batch][0], 3)
                row[f"greedy_prefix_match_vs_{quantizations[0]}"] = round(
                    sum(a[:8] == b[:8] for a, b in zip(tokens, base[batch][1])) / batch, 3)
            print(json.dumps(row), flush=True)
        llm.worker.shutdown()
        del llm
        if args.device == "cuda":
            torch.cuda.empty_cache()


def run_batch(llm: LLM, hf: torch.nn.Module, args: argparse.Namespace, batch: int, prompts: list[list[int]],
              cost: ModelCost, bw: float, peers: dict) -> dict:
    """One row: ours, the decode step against its roofline, the transformers peers (run once per batch and
    reused by every quantization's row)."""
    seconds, tokens = ours(llm, prompts, args.new_tokens)
    total = batch * args.new_tokens
    mc = llm.model_config
    row: dict = {"bench": "generate", "shape": args.shape, "layers": mc.num_layers, "batch": batch,
                 "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                 "ours_tok_s": round(total / seconds, 1), "_tokens": tokens}
    step_ms, rows, how = decode_step(llm, prompts)
    experts = last_step_experts(llm, rows)
    # the bytes the step reads at the copy rate: dense weights once, each touched (layer, expert) once
    step_bytes = cost.weight_bytes + cost.expert_bytes * sum(experts or [])
    roofline_ms = step_bytes / (bw * 1e9) * 1e3
    row.update(decode_step_ms=round(step_ms, 4), decode_step_how=how, decode_step_rows=rows,
               roofline_ms=round(roofline_ms, 4), step_over_roofline=round(step_ms / roofline_ms, 3),
               hbm_gbps=round(bw, 1), step_bytes=step_bytes)
    if experts is not None:
        row.update(experts_touched=round(sum(experts) / len(experts), 2), num_experts=mc.num_experts,
                   hf_experts=getattr(hf.config, "_experts_implementation", None))
    best: tuple[float, str] | None = None
    for peer in args.peers:
        if (batch, peer) not in peers:
            peers[batch, peer] = run_peer(hf, peer, prompts, args.new_tokens, tokens)
        s, match, error = peers[batch, peer]
        if error is not None:
            row[f"hf_{peer}_error"] = error
        if match is not None:
            row[f"hf_{peer}_greedy_prefix_match"] = round(match, 3)
        if s is not None:
            row[f"hf_{peer}_tok_s"] = round(total / s, 1)
            row[f"ratio_vs_{peer}"] = round(s / seconds, 2)
            best = min(best or (s, peer), (s, peer))
    if best is not None:
        row.update(best_hf=best[1], ratio_vs_best_hf=round(best[0] / seconds, 2))
    row["device"] = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    return row


if __name__ == "__main__":
    main()
