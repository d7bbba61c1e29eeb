"""Benchmark the checksum audit: digest GB/s of Qwen-shaped bf16 checkpoints, host path and device path.

Cases are (shape, path); each prints one JSON line. Shapes: "qwen2.5-7b" (15.2 GB, 339 tensors),
"qwen2-0.5b" (0.99 GB, tied embeddings) or "<N>gb" (Qwen2.5-7B shapes, as many layers as fit N GB).
The tensors are views into one flat buffer (256-byte aligned, like an arena). Measured in one run, on
the same tensors:
- path "host": `Digester.digest` with ALGORITHM (xxh3-128 per 64 MiB segment, segments streamed
  through pinned buffers into host threads), best of --repeats after a warm-up; its ceiling a plain
  copy of the same bytes into pinned host memory (device-to-host bandwidth); the peer SHA-256 of each
  tensor after a full `.cpu()` copy on one thread (what vLLM does), on a prefix of about --peer-gb,
  scaled by bytes. Digests of that prefix are checked against the rule written out (`rule_digest`).
- path "device": `DeviceDigester.digest` with DEVICE_ALGORITHM (xxh3-64 per 64 KiB segment on the
  GPU, one launch, 8 bytes per segment copied back, the per-tensor xxh3-128 on the host), median and
  best of --repeats after a warm-up (Triton compile, segment table); `launch_gbps` is the device time
  of the launch alone (CUDA events). Its ceiling is a plain device read of the same bytes measured in
  the same run: an int64 sum over the flat buffer (and, for reference, a device copy counted in bytes
  read). Digests of a prefix of about --verify-gb are checked against python-xxhash on `.cpu()` bytes.
  One line per --device-configs entry (BLOCK_SxWARPS).

    python scripts/bench/checksum.py                      # both shapes, host and device paths (CUDA)
    python scripts/bench/checksum.py --paths device --device-configs 32x4,16x2,8x1,64x8   # sweep
    python scripts/bench/checksum.py --device cpu --shapes 0.05gb --threads 2   # smoke test (host path)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout, installed or not
from checksum import (
    ALGORITHM,
    DEFAULT_CHUNK_BYTES,
    DEVICE_ALGORITHM,
    SEGMENT_BYTES,
    DeviceDigester,
    Digester,
    KernelConfig,
    digest_bytes,
)

# Qwen2.5-7B: hidden 3584, intermediate 18944, 28 layers, vocab 152064, 4 KV heads of 128, untied lm_head.
QWEN25_7B = {"hidden": 3584, "intermediate": 18944, "layers": 28, "vocab": 152064, "kv_heads": 4, "head_dim": 128}
# Qwen2-0.5B: hidden 896, intermediate 4864, 24 layers, vocab 151936, 2 KV heads of 64, lm_head tied.
QWEN2_05B = {"hidden": 896, "intermediate": 4864, "layers": 24, "vocab": 151936, "kv_heads": 2, "head_dim": 64}
BF16_BYTES = 2
ALIGN = 256  # the flat buffer's views start at multiples of this


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


def model_shapes(name: str) -> tuple[list[tuple[str, tuple]], str]:
    """A shape set by name: "qwen2.5-7b", "qwen2-0.5b" or "<N>gb" (see `plan`)."""
    if name.endswith("gb"):
        return plan(float(name[:-2]) * 1e9)
    if name not in ("qwen2.5-7b", "qwen2-0.5b"):
        raise SystemExit(f"scripts/bench/checksum.py: unknown shape {name!r} (qwen2.5-7b, qwen2-0.5b or <N>gb)")
    q = QWEN25_7B if name == "qwen2.5-7b" else QWEN2_05B
    shapes = qwen_shapes(q["hidden"], q["intermediate"], q["vocab"], q["kv_heads"] * q["head_dim"], q["layers"])
    if q is QWEN2_05B:
        return shapes[:-1], "Qwen2-0.5B shapes (lm_head tied to the embedding)"
    return shapes, "Qwen2.5-7B shapes, all 28 layers"


def make_tensors(shapes: list[tuple[str, tuple]], device: torch.device) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Random bf16 tensors as views into one flat byte buffer (each at a multiple of ALIGN), and the buffer."""
    sizes = [math.prod(shape) * BF16_BYTES for _, shape in shapes]
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += -(-n // ALIGN) * ALIGN
    flat = torch.zeros(total, dtype=torch.uint8, device=device)
    g = torch.Generator(device=device).manual_seed(0)
    tensors = {}
    for (name, shape), offset, n in zip(shapes, offsets, sizes):
        tensors[name] = flat[offset : offset + n].view(torch.bfloat16).view(shape).normal_(generator=g)
    return tensors, flat


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


def host_case(args: argparse.Namespace, device: torch.device, tensors: dict[str, torch.Tensor],
              layout: str) -> dict[str, object]:
    """The host path (ALGORITHM through pinned staging and host threads), its D2H ceiling and the peer."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    digester = Digester(args.threads, chunk_bytes=int(args.chunk_mb * 2**20))

    records = digester.digest(tensors)  # warm-up: pinned buffers, streams, threads
    ours = best_seconds(lambda: digester.digest(tensors), device, args.repeats)
    d2h = best_seconds(d2h_copy(tensors, device), device, args.repeats)
    names = peer_prefix(tensors, args.peer_gb * 1e9)
    peer_bytes = sum(tensors[n].numel() * tensors[n].element_size() for n in names)
    peer = best_seconds(peer_sha256(tensors, names), device, 1)
    digester.close()

    by_name = {r.name: r.digest for r in records}
    for name in names:  # our digests must follow the documented rule over the bytes the peer hashed
        expected = rule_digest(tensors[name].cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
        if by_name[name] != expected:
            raise SystemExit(f"scripts/bench/checksum.py: digest of {name} is wrong: {by_name[name]} != {expected}")

    ours_gbps, d2h_gbps = nbytes / ours / 1e9, nbytes / d2h / 1e9
    peer_gbps = peer_bytes / peer / 1e9
    ceiling = "pinned D2H" if device.type == "cuda" else "host memcpy (no device on --device cpu)"
    sizes = [t.numel() * t.element_size() for t in tensors.values()]
    segments = sum(max(1, math.ceil(n / SEGMENT_BYTES)) for n in sizes)
    rule = (f"digest {ALGORITHM}: xxh3-128 of each {SEGMENT_BYTES >> 20} MiB segment, hashed in parallel, "
            f"combined by xxh3-128 of the segment digests above {SEGMENT_BYTES >> 20} MiB "
            f"({segments} segments, largest tensor {max(sizes) / 1e9:.2f} GB)")
    return {
        "bench": "checksum",
        "path": "host",
        "bytes": nbytes,
        "ours_gbps": round(ours_gbps, 2),
        "d2h_pinned_gbps": round(d2h_gbps, 2),
        "ratio_to_d2h": round(ours_gbps / d2h_gbps, 3),
        "peer_sha256_gbps": round(peer_gbps, 3),
        "speedup_vs_peer": round(ours_gbps / peer_gbps, 1),
        "threads": args.threads,
        "tensors": len(tensors),
        "chunk_bytes": digester.chunk_bytes,
        "algorithm": ALGORITHM,
        "segment_bytes": SEGMENT_BYTES,
        "peer_bytes": peer_bytes,
        "note": f"{layout}; {rule}; ceiling: {ceiling}; peer measured on {peer_bytes / 1e9:.2f} of "
                f"{nbytes / 1e9:.2f} GB and scaled by bytes; best of {args.repeats} runs; digests verified",
    }


def timed_ms(fn: Callable[[], object], device: torch.device, repeats: int) -> list[float]:
    """Wall milliseconds of each of `repeats` runs, each synchronized on the device before and after."""
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def event_ms(fn: Callable[[], object], repeats: int) -> list[float]:
    """Device milliseconds of each run, between CUDA events on the current stream."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def device_ceilings(flat: torch.Tensor, repeats: int) -> tuple[float, float]:
    """(read, copy) medians in ms over the flat buffer: the faster of an int64 and a float32 sum (plain
    reads of every byte), and a device copy into a second buffer."""
    read = min(statistics.median(event_ms(lambda: flat.view(dtype).sum(), repeats))  # noqa: B023
               for dtype in (torch.int64, torch.float32))
    dst = torch.empty_like(flat)
    copy = statistics.median(event_ms(lambda: dst.copy_(flat), repeats))
    return read, copy


def device_cases(args: argparse.Namespace, device: torch.device, tensors: dict[str, torch.Tensor],
                 flat: torch.Tensor, layout: str) -> list[dict[str, object]]:
    """The device path (DEVICE_ALGORITHM, one launch) per kernel config, and the same-run ceiling."""
    names, views = list(tensors), list(tensors.values())
    nbytes = sum(t.numel() * t.element_size() for t in views)
    segments = sum(-(-(t.numel() * t.element_size()) // 65536) for t in views)
    read_ms, copy_ms = device_ceilings(flat, args.repeats)
    ceiling_gbps = nbytes / read_ms / 1e6
    lines = []
    for spec in args.device_configs.split(","):
        block_s, warps = (int(x) for x in spec.split("x"))
        digester = DeviceDigester(KernelConfig(block_s, warps))
        digests = digester.digest(views)  # warm-up: Triton compile, key and segment tables
        wall = timed_ms(lambda: digester.digest(views), device, args.repeats)  # noqa: B023
        launch = event_ms(lambda: digester.launch(views), args.repeats)  # noqa: B023
        verified = verify_prefix(names, views, digests, args.verify_gb * 1e9)
        median = statistics.median(wall)
        lines.append({
            "bench": "checksum",
            "path": "device",
            "bytes": nbytes,
            "device_gbps": round(nbytes / median / 1e6, 1),
            "device_best_gbps": round(nbytes / min(wall) / 1e6, 1),
            "launch_gbps": round(nbytes / statistics.median(launch) / 1e6, 1),
            "ceiling_read_gbps": round(ceiling_gbps, 1),
            "ratio_to_ceiling": round(nbytes / median / 1e6 / ceiling_gbps, 3),
            "copy_read_gbps": round(nbytes / copy_ms / 1e6, 1),
            "median_ms": round(median, 3),
            "config": spec,
            "tensors": len(views),
            "segments": segments,
            "algorithm": DEVICE_ALGORITHM,
            "verified_bytes": verified,
            "note": f"{layout}; digest {DEVICE_ALGORITHM}: xxh3-64 per 64 KiB segment in one launch, 8 bytes per "
                    f"segment to the host, xxh3-128 per tensor there; median of {args.repeats} (wall, synchronized); "
                    f"ceiling: int64 or float32 sum over the same bytes (copy: device copy, bytes read), same run",
        })
    return lines


def verify_prefix(names: list[str], views: list[torch.Tensor], digests: list[str], budget: float) -> int:
    """Check the first tensors (about `budget` bytes) against python-xxhash on their `.cpu()` bytes."""
    checked = 0
    for name, t, digest in zip(names, views, digests):
        if checked and checked >= budget:
            break
        expected = digest_bytes(t.cpu().reshape(-1).view(torch.uint8).numpy().tobytes(), DEVICE_ALGORITHM)
        if digest != expected:
            raise SystemExit(f"scripts/bench/checksum.py: device digest of {name} is wrong: {digest} != {expected}")
        checked += t.numel() * t.element_size()
    return checked


def main(argv: list[str] | None = None) -> int:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="qwen2.5-7b,qwen2-0.5b" if cuda else "0.05gb",
                        help="comma list: qwen2.5-7b, qwen2-0.5b, <N>gb")
    parser.add_argument("--gb", type=float, default=None, help="one shape of N GB (same as --shapes <N>gb)")
    parser.add_argument("--paths", default="host,device" if cuda else "host", help="comma list: host, device")
    parser.add_argument("--threads", type=int, default=16, help="hashing threads (host path)")
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument("--chunk-mb", type=float, default=DEFAULT_CHUNK_BYTES / 2**20, help="staging chunk, MiB")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per case")
    parser.add_argument("--peer-gb", type=float, default=2.0, help="bytes the slow peer is measured on")
    parser.add_argument("--device-configs", default="32x4", help="comma list of BLOCK_SxWARPS (device path)")
    parser.add_argument("--verify-gb", type=float, default=2.0, help="device digests checked on the host")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    paths = args.paths.split(",")
    if "device" in paths and device.type != "cuda":
        raise SystemExit("scripts/bench/checksum.py: the device path needs --device cuda")
    for shape in [f"{args.gb}gb"] if args.gb is not None else args.shapes.split(","):
        shapes, layout = model_shapes(shape)
        tensors, flat = make_tensors(shapes, device)
        where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        lines = [host_case(args, device, tensors, layout)] if "host" in paths else []
        lines += device_cases(args, device, tensors, flat, layout) if "device" in paths else []
        for line in lines:
            print(json.dumps({"shape": shape, "device": where, **line}), flush=True)
        del tensors, flat
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
