"""Benchmark the checksum audit: digest GB/s of a Qwen2.5-7B-shaped bf16 checkpoint on the device.

Measured in one run, on the same tensors:
- ours: `Digester.digest` (xxh3-128 per 64 MiB segment, segments streamed through pinned buffers
  into host threads, so many threads share one embedding), after one warm-up run that allocates the
  pinned buffers;
- the ceiling: a plain copy of the same bytes into pinned host memory (device-to-host bandwidth);
- the peer: SHA-256 of each tensor after a full `.cpu()` copy, on one thread (what vLLM does). It
  is slow, so it runs on a prefix of the tensors holding about --peer-gb and is scaled by bytes.
Our digests of that prefix are checked against the documented rule applied to the `.cpu()` bytes
(plain xxh3-128 up to a segment; above, xxh3-128 of the segments' 16-byte digests). Prints one JSON line.

    python scripts/bench_checksum.py                      # ~8 GB on CUDA, 16 threads
    python scripts/bench_checksum.py --device cpu --gb 0.05 --threads 2   # smoke test
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, installed or not
from checksum import ALGORITHM, DEFAULT_CHUNK_BYTES, SEGMENT_BYTES, Digester

# Qwen2.5-7B: hidden 3584, intermediate 18944, 28 layers, vocab 152064, 4 KV heads of 128, untied lm_head.
QWEN25_7B = {"hidden": 3584, "intermediate": 18944, "layers": 28, "vocab": 152064, "kv_heads": 4, "head_dim": 128}
BF16_BYTES = 2


def qwen_shapes(hidden: int, intermediate: int, vocab: int, kv_dim: int, layers: int) -> list[tuple[str, tuple]]:
    """(name, shape) of every tensor of a Qwen2-style checkpoint, in checkpoint order."""
    shapes: list[tuple[str, tuple]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [
            (p + "self_attn.q_proj.weight", (hidden, hidden)), (p + "self_attn.q_proj.bias", (hidden,)),
            (p + "self_attn.k_proj.weight", (kv_dim, hidden)), (p + "self_attn.k_proj.bias", (kv_dim,)),
            (p + "self_attn.v_proj.weight", (kv_dim, hidden)), (p + "self_attn.v_proj.bias", (kv_dim,)),
            (p + "self_attn.o_proj.weight", (hidden, hidden)),
            (p + "mlp.gate_proj.weight", (intermediate, hidden)), (p + "mlp.up_proj.weight", (intermediate, hidden)),
            (p + "mlp.down_proj.weight", (hidden, intermediate)),
            (p + "input_layernorm.weight", (hidden,)), (p + "post_attention_layernorm.weight", (hidden,)),
        ]
    return [*shapes, ("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]


def plan(target_bytes: float) -> tuple[list[tuple[str, tuple]], str]:
    """Full-size shapes with as many layers as fit the target; tiny targets scale every dimension."""
    q = QWEN25_7B
    kv_dim = q["kv_heads"] * q["head_dim"]

    def nbytes(layers: int, s: float = 1.0) -> int:
        dims = (round(q["hidden"] * s), round(q["intermediate"] * s), round(q["vocab"] * s))
        return sum(math.prod(shape) for _, shape in qwen_shapes(*dims, round(kv_dim * s), layers)) * BF16_BYTES

    per_layer = nbytes(2) - nbytes(1)
    if nbytes(1) <= target_bytes:
        layers = max(1, min(q["layers"], round((target_bytes - nbytes(0)) / per_layer)))
        shapes = qwen_shapes(q["hidden"], q["intermediate"], q["vocab"], kv_dim, layers)
        return shapes, f"Qwen2.5-7B shapes, {layers} of {q['layers']} layers"
    s = math.sqrt(target_bytes / nbytes(1))
    dims = (max(1, round(q["hidden"] * s)), max(1, round(q["intermediate"] * s)), max(1, round(q["vocab"] * s)))
    return qwen_shapes(*dims, max(1, round(kv_dim * s)), 1), f"Qwen2.5-7B shapes scaled by {s:.4f}, 1 layer"


def make_tensors(shapes: list[tuple[str, tuple]], device: torch.device) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(0)
    return {name: torch.empty(shape, dtype=torch.bfloat16, device=device).normal_(generator=g)
            for name, shape in shapes}


def best_seconds(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Fastest of `repeats` timed runs (each synchronized on the device)."""
    best = math.inf
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def d2h_copy(tensors: dict[str, torch.Tensor], device: torch.device) -> Callable[[], None]:
    """Copy every tensor's bytes into one reused host buffer (pinned on CUDA): the bandwidth ceiling."""
    largest = max(t.numel() * t.element_size() for t in tensors.values())
    dst = torch.empty(largest, dtype=torch.uint8, pin_memory=device.type == "cuda")
    flats = [t.reshape(-1).view(torch.uint8) for t in tensors.values()]

    def run() -> None:
        for flat in flats:
            dst[: flat.numel()].copy_(flat, non_blocking=True)

    return run


def peer_prefix(tensors: dict[str, torch.Tensor], budget: float) -> list[str]:
    names, total = [], 0
    for name, t in tensors.items():
        if names and total >= budget:
            break
        names.append(name)
        total += t.numel() * t.element_size()
    return names


def peer_sha256(tensors: dict[str, torch.Tensor], names: list[str]) -> Callable[[], None]:
    def run() -> None:
        for name in names:
            host = tensors[name].cpu()
            hashlib.sha256(host.reshape(-1).view(torch.uint8).numpy()).hexdigest()

    return run


def rule_digest(data: bytes) -> str:
    """docs/checksums.md's rule, written out: the pipeline's answer must equal it."""
    if len(data) <= SEGMENT_BYTES:
        return xxhash.xxh3_128(data).hexdigest()
    parts = (xxhash.xxh3_128(data[i : i + SEGMENT_BYTES]).digest() for i in range(0, len(data), SEGMENT_BYTES))
    return xxhash.xxh3_128(b"".join(parts)).hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=8.0, help="checkpoint size in GB (1e9 bytes)")
    parser.add_argument("--threads", type=int, default=16, help="hashing threads")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--chunk-mb", type=float, default=DEFAULT_CHUNK_BYTES / 2**20, help="staging chunk, MiB")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs; the best one counts")
    parser.add_argument("--peer-gb", type=float, default=2.0, help="bytes the slow peer is measured on")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    shapes, layout = plan(args.gb * 1e9)
    tensors = make_tensors(shapes, device)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    digester = Digester(args.threads, chunk_bytes=int(args.chunk_mb * 2**20))

    records = digester.digest(tensors)  # warm-up: pinned buffers, streams, threads
    ours = best_seconds(lambda: digester.digest(tensors), device, args.repeats)
    d2h = best_seconds(d2h_copy(tensors, device), device, args.repeats)
    names = peer_prefix(tensors, args.peer_gb * 1e9)
    peer_bytes = sum(tensors[n].numel() * tensors[n].element_size() for n in names)
    peer = best_seconds(peer_sha256(tensors, names), device, 1)

    by_name = {r.name: r.digest for r in records}
    for name in names:  # our digests must follow the documented rule over the bytes the peer hashed
        expected = rule_digest(tensors[name].cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
        if by_name[name] != expected:
            raise SystemExit(f"bench_checksum: digest of {name} is wrong: {by_name[name]} != {expected}")

    ours_gbps, d2h_gbps = nbytes / ours / 1e9, nbytes / d2h / 1e9
    peer_gbps = peer_bytes / peer / 1e9
    ceiling = "pinned D2H" if device.type == "cuda" else "host memcpy (no device on --device cpu)"
    sizes = [t.numel() * t.element_size() for t in tensors.values()]
    segments = sum(max(1, math.ceil(n / SEGMENT_BYTES)) for n in sizes)
    rule = (f"digest {ALGORITHM}: xxh3-128 of each {SEGMENT_BYTES >> 20} MiB segment, hashed in parallel, "
            f"combined by xxh3-128 of the segment digests above {SEGMENT_BYTES >> 20} MiB "
            f"({segments} segments, largest tensor {max(sizes) / 1e9:.2f} GB)")
    print(json.dumps({
        "bench": "checksum",
        "bytes": nbytes,
        "ours_gbps": round(ours_gbps, 2),
        "d2h_pinned_gbps": round(d2h_gbps, 2),
        "ratio_to_d2h": round(ours_gbps / d2h_gbps, 3),
        "peer_sha256_gbps": round(peer_gbps, 3),
        "speedup_vs_peer": round(ours_gbps / peer_gbps, 1),
        "threads": args.threads,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "tensors": len(tensors),
        "chunk_bytes": digester.chunk_bytes,
        "algorithm": ALGORITHM,
        "segment_bytes": SEGMENT_BYTES,
        "peer_bytes": peer_bytes,
        "note": f"{layout}; {rule}; ceiling: {ceiling}; peer measured on {peer_bytes / 1e9:.2f} of "
                f"{nbytes / 1e9:.2f} GB and scaled by bytes; best of {args.repeats} runs; digests verified",
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
