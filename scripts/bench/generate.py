"""Generation throughput: our engine against Hugging Face transformers on the same weights and prompts.

One JSON line per case (shape, batch): our tokens/s, transformers `generate` with a static cache
(torch.compile), plain `generate`, `generate_batch` where present, the ratios, and our decode step time
against the weight-bytes roofline (weight bytes over the device-to-device bandwidth measured here; for an
MoE shape the active weights: the experts a step of that batch touches under uniform routing).
Greedy, ignore_eos, random bf16 weights (the HF model's own random init, copied into ours).
`--quantization bf16,fp8`: our engine also in FP8 (docs/fp8.md; the same weights quantized as they load),
one row per quantization with its own roofline (FP8: the linears' bytes halved, plus their scales), the
FP8 row's `fp8_over_bf16` tok/s and the share of prompts whose first 8 greedy tokens equal bf16's.
`--batch-invariant` / `--no-batch-invariant`: our engine in the batch-invariant mode or not (unset: the
engine's default); every row says which (`batch_invariant`).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a file from a checkout too

from inference.core import SamplingParams
from inference.engine.llm import LLM
from inference.models.loader import load_named_tensors

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
}


def hf_model(shape: str, max_len: int, layers: int | None = None) -> torch.nn.Module:
    import transformers

    kw = dict(SHAPES[shape])
    config_class = getattr(transformers, kw.pop("config", "Qwen2Config"))
    if layers:
        kw["num_hidden_layers"] = layers
    cfg = config_class(**kw, max_position_embeddings=max_len, rms_norm_eps=1e-6)
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": 1000000.0}
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


QUANTIZATIONS = {"bf16": "none", "fp8": "fp8"}  # --quantization label -> EngineConfig.quantization


def our_llm(hf: torch.nn.Module, max_batch: int, max_len: int, enforce_eager: bool, **engine: object) -> LLM:
    d = Path(tempfile.mkdtemp(prefix="bench-gen-"))
    hf.config.save_pretrained(d)  # config.json only: the weights come from the HF model itself
    llm = LLM(d, device="cuda", dtype="bfloat16", load_format="dummy", max_num_seqs=max_batch,
              max_model_len=max_len, enforce_eager=enforce_eager, gpu_memory_utilization=0.6, **engine)
    load_named_tensors(llm.worker.models["target"], hf.state_dict().items())
    return llm


def timed(fn, repeats: int = 1) -> float:
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def ours(llm: LLM, prompts: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
    outs: list = []
    seconds = timed(lambda: outs.append(llm.generate(prompts, params)), repeats=2)
    return seconds, [o.outputs[0].token_ids for o in outs[-1]]


def decode_step_ms(llm: LLM, batch: int) -> float:
    """GPU time of one graph-replayed decode step (the forward up to the final norm)."""
    graphs = llm.worker.runner.graphs
    if graphs is None:
        return float("nan")
    bs = next(b for b in graphs.sizes if b >= batch)
    for _ in range(3):
        graphs.graphs[bs].replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(50):
        graphs.graphs[bs].replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 50


def hf_generate(model: torch.nn.Module, prompts: list[list[int]], new: int, static: bool,
                ours: list[list[int]]) -> tuple[float, float]:
    """Seconds, and the fraction of prompts whose first 8 greedy tokens equal ours (bf16 drifts later)."""
    ids = torch.tensor(prompts, device="cuda")
    kw = dict(max_new_tokens=new, do_sample=False, attention_mask=torch.ones_like(ids))
    if static:
        kw["cache_implementation"] = "static"
        for _ in range(2):  # compile and warm up
            model.generate(ids, **kw)
    out: list = []
    seconds = timed(lambda: out.append(model.generate(ids, **kw)))
    theirs = out[-1][:, ids.shape[1]:].tolist()
    return seconds, sum(a[:8] == b[:8] for a, b in zip(theirs, ours)) / len(ours)


def hf_generate_batch(model: torch.nn.Module, prompts: list[list[int]], new: int) -> float | None:
    if not hasattr(model, "generate_batch"):
        return None
    from transformers import GenerationConfig

    cfg = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
    return timed(lambda: model.generate_batch(inputs=prompts, generation_config=cfg))


def device_copy_gbps() -> float:
    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    seconds = timed(lambda: y.copy_(x), repeats=5)
    return 2 * x.numel() / seconds / 1e9  # bytes read + written


def weight_bytes_of(llm: LLM) -> int:
    """Bytes one decode step reads of the weights: parameters, plus FP8 linears' row scales."""
    model = llm.worker.models["target"]
    return (sum(p.numel() * p.element_size() for p in model.parameters())
            + sum(b.numel() * b.element_size() for n, b in model.named_buffers() if n.endswith("weight_scale")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen2-0.5b", choices=sorted(SHAPES))
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 128])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--peers", nargs="*", default=["static", "plain", "batch"], help="transformers modes to run")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--quantization", default="bf16", help="comma list of bf16 and fp8 (our engine's weights)")
    ap.add_argument("--layers", type=int, default=None, help="fewer decoder layers than the shape has")
    ap.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
                    help="the batch-invariant mode on or off (docs/invariance.md); unset: the engine's default")
    args = ap.parse_args()
    mode = {} if args.batch_invariant is None else {"batch_invariant": args.batch_invariant}
    quantizations = [q for q in args.quantization.split(",") if q]
    if any(q not in QUANTIZATIONS for q in quantizations):
        ap.error(f"--quantization: a comma list of {', '.join(QUANTIZATIONS)}")
    max_len = args.prompt_len + args.new_tokens + 16
    hf = hf_model(args.shape, max(max_len, 512), args.layers)
    bw = device_copy_gbps()
    g = torch.Generator().manual_seed(0)
    prompts = {b: torch.randint(0, SHAPES[args.shape]["vocab_size"], (b, args.prompt_len), generator=g).tolist()
               for b in args.batch}
    peers: dict[tuple[int, str], tuple[float | None, float | None]] = {}  # (batch, peer) -> (seconds, match)
    base: dict[int, tuple[float, list[list[int]]]] = {}  # batch -> the first quantization's (tok/s, tokens)
    for quant in quantizations:
        llm = our_llm(hf, max(args.batch), max_len, args.enforce_eager, quantization=QUANTIZATIONS[quant], **mode)
        weight_bytes = weight_bytes_of(llm)
        for batch in args.batch:
            row = run_batch(llm, hf, args, batch, prompts[batch], weight_bytes, bw, peers)
            row.update(quantization=quant, batch_invariant=llm.config.batch_invariant)
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
        torch.cuda.empty_cache()


def run_batch(llm: LLM, hf: torch.nn.Module, args: argparse.Namespace, batch: int, prompts: list[list[int]],
              weight_bytes: int, bw: float, peers: dict) -> dict:
    """One row: ours, the decode step against the weight roofline, the transformers peers (run once per
    batch and reused by every quantization's row)."""
    seconds, tokens = ours(llm, prompts, args.new_tokens)
    total = batch * args.new_tokens
    row: dict = {"bench": "generate", "shape": args.shape, "batch": batch, "prompt_len": args.prompt_len,
                 "new_tokens": args.new_tokens, "ours_tok_s": round(total / seconds, 1), "_tokens": tokens}
    step_ms = decode_step_ms(llm, batch)
    # Weights read once per step at the HBM bandwidth; of an MoE's experts only those the step touches
    # (uniform routing: each expert is missed by all `batch` tokens with probability (1 - k/E)^batch).
    mc = llm.model_config
    touched = 1 - (1 - mc.num_experts_per_tok / mc.num_experts) ** batch if mc.num_experts else 1.0
    expert_bytes = sum(p.numel() * p.element_size() for n, p in llm.worker.models["target"].named_parameters()
                       if ".experts." in n)
    roofline_ms = (weight_bytes - expert_bytes * (1 - touched)) / (bw * 1e9) * 1e3
    row.update(decode_step_ms=round(step_ms, 4), roofline_ms=round(roofline_ms, 4),
               step_over_roofline=round(step_ms / roofline_ms, 2), hbm_gbps=round(bw, 1), weight_bytes=weight_bytes)
    for peer in args.peers:
        if (batch, peer) not in peers:
            if peer == "batch":
                peers[batch, peer] = (hf_generate_batch(hf, prompts, args.new_tokens), None)
            else:
                peers[batch, peer] = hf_generate(hf, prompts, args.new_tokens, peer == "static", tokens)
        s, match = peers[batch, peer]
        if match is not None:
            row[f"hf_{peer}_greedy_prefix_match"] = round(match, 3)
        if s is not None:
            row[f"hf_{peer}_tok_s"] = round(total / s, 1)
            row[f"ratio_vs_{peer}"] = round(s / seconds, 2)
    row["device"] = torch.cuda.get_device_name()
    return row


if __name__ == "__main__":
    main()
