"""FP8 linears (docs/fp8.md) on the decode and prefill shapes: ours against bf16 and the FP8 weight roofline.

One JSON line per (model, projection, M): bf16 (the engine's product: the GEMV at one row, else cuBLAS),
FP8 through the engine's routing (fp8_linear: the FP8 GEMV up to FP8_GEMV_MAX_M rows, _scaled_mm past
them), the FP8 GEMV and _scaled_mm each where it applies, the FP8 weight roofline (weight + scale bytes
over the read bandwidth measured in the same run) and fp8 time / roofline, fp8 / bf16. Timed as
scripts/bench/gemv.py times (CUDA graphs, enough weight copies to defeat L2).

A "granularity" line per model: the weights' relative error (Frobenius norm of w - dequantized w over that
of w) with a scale per output row (ours) and per 128x128 block (FP8 checkpoints' choice), on random
weights with a few outlier columns as trained LLM weights have; the row rule reads N scales, a block rule
N*K/16384, in the GEMV's inner loop. `--m` picks the rows.

    python3 scripts/bench/fp8.py                 # 0.5B and 7B, M = 1, 4, 8, 16, 64, 512, 4096
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

from inference.layers.fp8_linear import fp8_linear, scaled_mm_linear, use_fp8_gemv, use_scaled_mm
from inference.layers.gemv import gemv, linear
from inference.quant.fp8 import FP8_MAX, dequantize_rows, quantize_rows
from scripts.bench.gemv import MODELS, Case, bandwidths

PROJECTIONS = ("qkv", "o_proj", "gate_up", "down")


def with_outliers(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Random bf16 weights with 1% of the input columns 20x larger (the activation-outlier channels)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", generator=g) * k ** -0.5
    cols = torch.randperm(k, device="cuda", generator=g)[: max(1, k // 100)]
    w[:, cols] *= 20
    return w.to(torch.bfloat16)


def block_error(w: torch.Tensor, block: int = 128) -> float:
    """Relative error of w quantized with one scale per block x block tile (amax / 448, e4m3)."""
    n, k = w.shape
    pad = torch.nn.functional.pad(w.float(), (0, -k % block, 0, -n % block))
    tiles = pad.unflatten(0, (-1, block)).unflatten(2, (-1, block))  # [N/b, b, K/b, b]
    amax = tiles.abs().amax(dim=(1, 3), keepdim=True)
    scale = torch.where(amax == 0, torch.ones_like(amax), amax / FP8_MAX)
    back = ((tiles / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale).flatten(2).flatten(0, 1)
    return float((back[:n, :k] - w.float()).norm() / w.float().norm())


def granularity(model: str) -> dict[str, object]:
    errors: dict[str, dict[str, float]] = {}
    for name, n, k in MODELS[model]:
        if name not in PROJECTIONS:
            continue
        w = with_outliers(n, k)
        row = float((dequantize_rows(*quantize_rows(w, name), torch.float32) - w.float()).norm() / w.float().norm())
        errors[name] = {"row": round(row, 5), "block128": round(block_error(w), 5)}
    return {"bench": "fp8_granularity", "model": model, "relative_error": errors,
            "device": torch.cuda.get_device_name()}


def run_case(model: str, name: str, n: int, k: int, m: int, read_bps: float) -> dict[str, object]:
    case = Case(name, m, n, k, torch.bfloat16)
    quantized = [quantize_rows(w, name) for w in case.weights]
    x, bias = case.x, case.bias
    row: dict[str, object] = {"bench": "fp8_linear", "model": model, "proj": name, "m": m, "n": n, "k": k}
    row["bf16_us"] = case.time(lambda i: linear(x, case.weights[i], bias))
    row["fp8_us"] = case.time(lambda i: fp8_linear(x, *quantized[i], bias))
    q0 = quantized[0][0]
    if use_fp8_gemv(x, q0):
        row["fp8_gemv_us"] = case.time(lambda i: gemv(x, quantized[i][0], bias, scale=quantized[i][1]))
    if use_scaled_mm(x, q0):
        row["fp8_scaled_mm_us"] = case.time(lambda i: scaled_mm_linear(x, *quantized[i], bias))
    fp8_bytes = n * k + 4 * n
    row["fp8_roofline_us"] = fp8_bytes / read_bps * 1e6
    row["bf16_roofline_us"] = 2 * n * k / read_bps * 1e6
    row["fp8_over_roofline"] = row["fp8_us"] / row["fp8_roofline_us"]  # type: ignore[operator]
    row["fp8_over_bf16"] = row["fp8_us"] / row["bf16_us"]  # type: ignore[operator]
    row["device"] = torch.cuda.get_device_name()
    return {key: round(v, 4) if isinstance(v, float) else v for key, v in row.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="0.5b,7b")
    ap.add_argument("--m", default="1,4,8,16,64,512,4096")
    args = ap.parse_args()
    _, read_bps = bandwidths()
    for model in args.models.split(","):
        print(json.dumps(granularity(model)), flush=True)
        for name, n, k in MODELS[model]:
            if name not in PROJECTIONS:
                continue
            for m in (int(v) for v in args.m.split(",")):
                print(json.dumps(run_case(model, name, n, k, m, read_bps)), flush=True)


if __name__ == "__main__":
    main()
