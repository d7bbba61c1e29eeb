"""Benchmark two parts of a decode step: the decode attention kernel and the sampler. One JSON line per case.

Attention (Qwen2-0.5B heads by default: 14 q / 2 kv heads, head_dim 64, bf16, block 16): the same decode
step under several tilings, each as a CUDA graph of `--layers` forwards (one step's layers; each stores
the new k/v and attends) with block tables as wide as max_model_len, as the engine captures them:
  split1     splits of >= 1 KV tile merged by the last split to finish
  split4     the same with splits of >= 4 tiles (single pass up to 256 keys at 64-key tiles)
  rows1      the default with the multi-row owner check compiled out (decode_max_rows 1)
  auto       the default tiles (decode_split_tiles 2: single pass up to 128 keys)
With --verify-rows R each sequence is R consecutive verify rows (positions context - R .. context - 1, as
spec decoding's verify launches hold k + 1), and the row also times the same sequences' plain decode step
(`plain_us_per_layer`: one row each, the default tiles), the floor a verify launch is measured against.
Sampler ([B, vocab] bf16 logits): `sample` against `sample_reference` (full fp32 log_softmax, the
previous sampler), both eager (what the runner does), and the greedy path also as a graph (GPU time only).

    python3 scripts/bench/decode_parts.py                       # H200: batches 1 and 128
    python3 scripts/bench/decode_parts.py --contexts 256 --max-model-len 272 4096
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

from inference.batch import AttentionMetadata
from inference.core import SamplingParams
from inference.layers.attention import ReferenceAttention
from inference.sample.sampler import SamplingBatch, sample, sample_reference
from scripts.bench.attention import decode_case, graph_replay, timer

VARIANTS = {"split1": {"decode_split_tiles": 1},
            "split4": {"decode_split_tiles": 4},
            "rows1": {"decode_max_rows": 1},  # the multi-row owner check compiled out
            "auto": {},
            # the rollout's sweep: more programs per SM (more splits), longer tiles, deeper pipelines, more warps
            "sm4": {"decode_programs_per_sm": 4},
            "sm8": {"decode_programs_per_sm": 8},
            "sm8_t1": {"decode_programs_per_sm": 8, "decode_split_tiles": 1},
            "sm16": {"decode_programs_per_sm": 16},
            "n128": {"decode_block_n": 128},
            "n128_sm8": {"decode_block_n": 128, "decode_programs_per_sm": 8, "decode_split_tiles": 1},
            "st3": {"num_stages": 3},
            "st3_sm8": {"num_stages": 3, "decode_programs_per_sm": 8},
            "w8": {"num_warps": 8},
            "n32_sm8": {"decode_block_n": 32, "decode_programs_per_sm": 8},
            # next: occupancy at large batches (two stages of 128-key K and V tiles leave one program a SM)
            "n128_st1": {"decode_block_n": 128, "num_stages": 1},
            "n64_st1": {"num_stages": 1},
            "n256": {"decode_block_n": 256, "decode_split_tiles": 1},
            # more KV splits at few rows and long contexts, the multi-row check compiled out
            "rows1_sm4": {"decode_max_rows": 1, "decode_programs_per_sm": 4},
            "rows1_sm8": {"decode_max_rows": 1, "decode_programs_per_sm": 8}}
VARIANT_NAMES = list(VARIANTS)


def widen(meta: AttentionMetadata, width: int) -> AttentionMetadata:
    """The same step with block tables padded to `width` blocks (a graph captured for max_model_len)."""
    tables = meta.block_tables
    if tables.shape[1] >= width:
        return meta
    pad = torch.zeros(tables.shape[0], width - tables.shape[1], dtype=tables.dtype, device=tables.device)
    return AttentionMetadata(
        query_lens=meta.query_lens, context_lens_host=meta.context_lens_host, cu_query_lens=meta.cu_query_lens,
        context_lens=meta.context_lens, slot_mapping=meta.slot_mapping, block_tables=torch.cat([tables, pad], 1),
        block_size=meta.block_size, max_query_len=meta.max_query_len, max_context_len=width * meta.block_size,
        is_decode=True, rows_per_seq=meta.rows_per_seq)


def verify_case(meta: AttentionMetadata, tensors: list[torch.Tensor], rows: int
                ) -> tuple[AttentionMetadata, list[torch.Tensor]]:
    """The decode step's sequences as `rows` verify rows each (positions context - rows .. context - 1,
    consecutive in the launch, one table per sequence), rows_per_seq = rows as a verify graph has it."""
    bs, device = meta.block_size, meta.block_tables.device
    tables = meta.block_tables.tolist()
    contexts, slots, row_tables = [], [], []
    for table, ctx in zip(tables, meta.context_lens_host):
        for p in range(ctx - rows, ctx):
            contexts.append(p + 1)
            slots.append(table[p // bs] * bs + p % bs)
            row_tables.append(table)
    expanded = AttentionMetadata.build([1] * len(contexts), contexts, slots, row_tables, bs, device)
    q, k, v, kc, vc = tensors
    pick = torch.arange(len(tables), device=device).repeat_interleave(rows)
    return dataclasses.replace(expanded, rows_per_seq=rows), [q[pick], k[pick], v[pick], kc, vc]


def layer_stack(backend: object, tensors: list[torch.Tensor], meta: AttentionMetadata, scale: float,
                layers: int) -> Callable[[], list[torch.Tensor]]:
    """One decode step's attention calls: `layers` launches over the same tensors."""
    q, k, v, kc, vc = tensors
    return lambda: [backend.forward(q, k, v, kc, vc, meta, scale, None) for _ in range(layers)]


def sampler_calls(logits: torch.Tensor, sb: SamplingBatch, seed: int) -> tuple[Callable[[], object], ...]:
    """(ours, reference), each drawing from its own generator."""
    g1, g2 = (torch.Generator(logits.device).manual_seed(seed) for _ in range(2))
    return lambda: sample(logits, sb, g1), lambda: sample_reference(logits, sb, g2)


def attention_rows(args: argparse.Namespace) -> list[dict]:
    import inference.layers.triton_attention as ta

    heads, kv_heads, head_dim = (int(x) for x in args.shape.split(","))
    measure = timer("cuda")
    rows = []
    for max_len in args.max_model_len:
        for batch in args.batches:
            for context in [c for c in args.contexts if c <= max_len]:
                meta, tensors = decode_case(batch, context, heads, kv_heads, head_dim, args.block_size,
                                            torch.bfloat16, "cuda")
                width = -(-max_len // args.block_size)
                scale = head_dim ** -0.5
                plain = None
                if args.verify_rows > 1:
                    plain_step = layer_stack(ta.TritonAttention(), tensors, widen(meta, width), scale, args.layers)
                    plain = round(measure(graph_replay(plain_step)) * 1e3 / args.layers, 2)
                    meta, tensors = verify_case(meta, tensors, args.verify_rows)
                meta = widen(meta, width)
                q, k, v, kc, vc = tensors
                want = ReferenceAttention().forward(q, k, v, kc.clone(), vc.clone(), meta, scale, None).float()
                row: dict = {"bench": "decode_attention", "shape": args.shape, "batch": batch, "context": context,
                             "max_model_len": max_len, "layers": args.layers, "verify_rows": args.verify_rows,
                             **({"plain_us_per_layer": plain} if plain is not None else {})}
                for name in args.variants:
                    overrides = VARIANTS[name]
                    backend = ta.TritonAttention(ta.TritonAttentionTiles(**overrides))
                    step = layer_stack(backend, [q, k, v, kc, vc], meta, scale, args.layers)
                    row[f"{name}_err"] = (step()[0].float() - want).abs().max().item()
                    row[f"{name}_us_per_layer"] = round(measure(graph_replay(step)) * 1e3 / args.layers, 2)
                    row[f"{name}_splits"] = backend.plan(q, kc, meta).splits
                rows.append(row)
    return rows


def sampler_rows(args: argparse.Namespace) -> list[dict]:
    measure = timer("cuda")
    device = torch.device("cuda")
    cases = {"greedy": SamplingParams(temperature=0.0), "greedy_top5": SamplingParams(temperature=0.0, logprobs=5),
             "temp0.8": SamplingParams(temperature=0.8), "temp0.8_topk50": SamplingParams(temperature=0.8, top_k=50)}
    rows = []
    for batch in args.batches:
        logits = (4 * torch.randn(batch, args.vocab, device=device)).to(torch.bfloat16)
        for name, params in cases.items():
            sb = SamplingBatch.build([params] * batch, [None] * batch, [0] * batch, args.vocab, device)
            ours, ref = sampler_calls(logits, sb, 0)
            got, want = sample(logits, sb), sample_reference(logits, sb)
            row: dict = {"bench": "sampler", "case": name, "batch": batch, "vocab": args.vocab,
                         "greedy_tokens_equal": bool(torch.equal(got.token_ids, want.token_ids)) if params.greedy
                         else None,
                         "max_abs_logprob_err": (got.logprobs - want.logprobs).abs().max().item() if params.greedy
                         else None,
                         "ours_eager_us": round(measure(ours) * 1e3, 2),
                         "reference_eager_us": round(measure(ref) * 1e3, 2)}
            if params.greedy:
                row["ours_graph_us"] = round(measure(graph_replay(ours)) * 1e3, 2)
                row["reference_graph_us"] = round(measure(graph_replay(ref)) * 1e3, 2)
            row["speedup_eager"] = round(row["reference_eager_us"] / row["ours_eager_us"], 2)
            rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="14,2,64", help="heads,kv_heads,head_dim")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 128])
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 256, 1024, 4096])
    ap.add_argument("--max-model-len", type=int, nargs="+", default=[272, 4096],
                    help="graph table widths (272: generate.py's 128 + 128 + 16)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--variants", nargs="+", default=["split1", "split4", "rows1", "auto"],
                    choices=VARIANT_NAMES)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--verify-rows", type=int, default=0,
                    help="R > 1: every sequence as R verify rows (spec decoding's k + 1); plain_us_per_layer beside")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--parts", nargs="+", default=["attention", "sampler"], choices=["attention", "sampler"])
    args = ap.parse_args()
    device = torch.cuda.get_device_name()
    for part, rows in (("attention", attention_rows), ("sampler", sampler_rows)):
        if part in args.parts:
            for row in rows(args):
                print(json.dumps({**row, "device": device}), flush=True)


if __name__ == "__main__":
    main()
