"""Benchmark delta syncs of full weights against full syncs, on the 0.5B shape, one JSON line per figure.

1. changed: the fraction of bf16 elements that change in one real AdamW step (fp32 master weights, as
   mixed-precision trainers keep them, sent as bf16) at each --lr, and the bytes each encoding would
   take (index only, runs only, the per-tensor smallest). Weights are drawn at random (matrices
   N(0, 0.02), norms 1, biases 0): the shape and the magnitudes decide the fraction, not the values;
   gradients are random too (AdamW's step is about lr per element whatever their scale). Run tensor by
   tensor, so the fp32 optimizer state of the whole model is never held at once.
2. wire (--backend gloo on --device cpu; ipc with --device cuda): one audited sync (start, send beside
   update with the digests delivered, finish), full then delta, into a real bf16 model behind the
   engine's WeightUpdater in this process, the trainer a child process: median ms of --iters (from the
   trainer's manifest to the audit's verdict), bytes on the wire, and the ratio delta / full. The
   delta's time includes the sender's compare and encode, the rank's apply, and the audit of the full
   tensors at both ends.
3. lora (--lora-rank R): the same audited syncs of a LoRA adapter of rank R on every linear ("all-linear",
   bf16, served unmerged: the receiving model carries its LoRASlots) against the full sync in the same
   run: bytes and median ms of adapter-only syncs, and their ratios to the full sync's.
Smoke test: --shape tiny --iters 1. GPU: --device cuda --backend ipc.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

from inference.models.lora_adapter import AdapterSpec, attach_adapter
from inference.models.naming import expected_hf_tensors, lora_name
from inference.transfer.delta_codec import bits, encode
from inference.transfer.plan import TensorSpec
from inference.transfer.sender import WeightSender
from scripts.bench.sync import BenchReceiver, model_config, setup_device


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"cpu x{os.cpu_count()}"


def masters(shape: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, dims in shape.items():
        if name.endswith("norm.weight"):
            out[name] = torch.ones(dims)
        elif name.endswith(".bias"):
            out[name] = torch.zeros(dims)
        else:
            out[name] = torch.randn(dims, generator=gen) * 0.02
    return out


def adamw_step(shape: dict[str, tuple[int, ...]], lr: float, seed: int = 0,
               device: torch.device | None = None) -> tuple[dict, dict]:
    """bf16 weights before and after the second of two AdamW steps (the first warms the moments)."""
    before, after = {}, {}
    gen = torch.Generator().manual_seed(seed + 1)
    for name, w in masters(shape, seed).items():
        p = torch.nn.Parameter(w.to(device or "cpu"))
        opt = torch.optim.AdamW([p], lr=lr, weight_decay=0.01)
        for step in range(2):
            p.grad = torch.randn(p.shape, generator=gen).to(device or "cpu")
            if step == 1:
                before[name] = p.detach().to(torch.bfloat16)
            opt.step()
        after[name] = p.detach().to(torch.bfloat16)
        del p, opt
    return before, after


def changed_figures(before: dict, after: dict, lr: float) -> dict[str, Any]:
    total = changed = dense = index = runs = chosen = 0
    for name, t in after.items():
        spec = TensorSpec.of(name, t)
        sizes = encode(spec, bits(t), bits(before[name])).sizes
        total += t.numel()
        changed += sizes["changed"]
        dense += sizes["dense"]
        index += sizes["index"] if sizes["changed"] else 0
        runs += sizes["runs"] if sizes["changed"] else 0
        chosen += min(v for k, v in sizes.items() if k != "changed") if sizes["changed"] else 0
    return {"figure": "changed", "lr": lr, "elements": total, "changed_fraction": changed / total,
            "full_bytes": dense, "index_only_bytes": index, "runs_only_bytes": runs, "chosen_bytes": chosen,
            "chosen_over_full": chosen / dense}


def adapter_shapes(shape: dict[str, tuple[int, ...]], rank: int) -> dict[str, tuple[int, ...]]:
    """Wire name -> shape of every tensor of a rank-`rank` "all-linear" adapter (every linear of the layers)."""
    out = {}
    for name, dims in shape.items():
        if ".layers." in name and name.endswith(".weight") and len(dims) == 2:
            out[lora_name(name, "lora_A")] = (rank, dims[1])
            out[lora_name(name, "lora_B")] = (dims[0], rank)
    return out


def adapter_states(shape: dict[str, tuple[int, ...]], rank: int, device: torch.device) -> list[dict]:
    """Two random bf16 adapters (B nonzero, as after training), synced in turn."""
    gen = torch.Generator().manual_seed(rank)
    return [{n: (torch.randn(d, generator=gen) * 0.02).to(device, torch.bfloat16)
             for n, d in adapter_shapes(shape, rank).items()} for _ in range(2)]


def trainer(args: argparse.Namespace, lr: float, delta: bool, to_parent: Any, from_parent: Any,
            lora_rank: int = 0) -> None:
    """The trainer (a child process): one AdamW step's bf16 weights, synced before, after, before, ...
    (with lora_rank, two adapters of that rank instead)."""
    device = setup_device(args.device)
    shape = expected_hf_tensors(model_config(args.shape))
    states = adapter_states(shape, lora_rank, device) if lora_rank else list(adamw_step(shape, lr, device=device))
    sender = WeightSender(args.backend, timeout_s=600, device=device if device.type == "cuda" else None,
                          delta=delta)
    to_parent.put(sender.init_info())
    sender.connect()
    for version in range(1, args.iters + 2):
        state = states[version % 2]
        to_parent.put(sender.manifest(state, version))
        sender.send(state, deliver_digests=True)
        to_parent.put(dict(sender.last_sync, kept_copy_bytes=sender.kept.nbytes))
    from_parent.get()
    sender.close()


def wire(args: argparse.Namespace, lr: float, delta: bool, lora_rank: int = 0) -> dict[str, Any]:
    """Audited syncs (the first full; timed: the rest) into a real bf16 model in this process; with
    lora_rank, adapter-only syncs into the same model serving an adapter of that rank."""
    device = setup_device(args.device)
    ctx = mp.get_context("spawn")
    from_child, to_child = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=trainer, args=(args, lr, delta, from_child, to_child, lora_rank))
    child.start()
    config = model_config(args.shape)
    receiver = BenchReceiver(config, device)
    if lora_rank:
        attach_adapter(receiver.models["target"], config, AdapterSpec(lora_rank, 2.0 * lora_rank, False, "all-linear"))
    updater = receiver.weights
    try:
        updater.init_transfer(from_child.get(timeout=1200))
        times, sent = [], []
        for version in range(1, args.iters + 2):
            manifest = from_child.get(timeout=1200)
            t0 = time.perf_counter()  # from the trainer's manifest: its send() is under way
            updater.start("target", version, manifest)
            delivered = updater.update(digests_follow=True)
            assert updater.finish(delivered).report.ok
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elapsed = (time.perf_counter() - t0) * 1e3
            last = from_child.get(timeout=1200)
            if version > 1:
                times.append(elapsed)
                sent.append(last)
        return {"ms": statistics.median(times), "modes": sorted({s["mode"] for s in sent}),
                "wire_bytes": max(s["wire_bytes"] for s in sent), "kept_copy_bytes": sent[-1]["kept_copy_bytes"]}
    finally:
        updater.close_transfer()  # ipc: the mappings of the trainer's memory go before the trainer does
        to_child.put("done")
        child.join(120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen2-0.5b")
    parser.add_argument("--lr", type=float, nargs="+", default=[1e-6, 1e-5])
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--backend", default="gloo", choices=["gloo", "ipc"])
    parser.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (ipc, or gloo from a GPU)")
    parser.add_argument("--skip-changed", action="store_true", help="only the wire figures")
    parser.add_argument("--skip-delta", action="store_true", help="no delta wire figures (with --lora-rank: "
                                                                   "the LoRA figure alone)")
    parser.add_argument("--lora-rank", type=int, default=0, help="also time adapter-only syncs of this rank "
                                                                  "against the full sync (0: not)")
    args = parser.parse_args()
    config = model_config(args.shape)
    shape = expected_hf_tensors(config)
    for lr in [] if args.skip_changed else args.lr:
        before, after = adamw_step(shape, lr, device=torch.device(args.device))
        print(json.dumps({"shape": args.shape, **changed_figures(before, after, lr)}), flush=True)
        del before, after
    for lr in [] if args.skip_delta else args.lr:
        full = wire(args, lr, False)
        delta = wire(args, lr, True)
        print(json.dumps({"shape": args.shape, "figure": "wire", "backend": args.backend, "lr": lr, "full": full,
                          "delta": delta, "bytes_ratio": delta["wire_bytes"] / full["wire_bytes"],
                          "time_ratio": delta["ms"] / full["ms"], "device": _device_name(args.device),
                          "date": time.strftime("%Y-%m-%d")}), flush=True)
        del full, delta
    if args.lora_rank:
        full, lora = wire(args, args.lr[0], False), wire(args, args.lr[0], False, args.lora_rank)
        print(json.dumps({"shape": args.shape, "figure": "lora", "backend": args.backend, "rank": args.lora_rank,
                          "full": full, "lora": lora, "bytes_ratio": lora["wire_bytes"] / full["wire_bytes"],
                          "time_ratio": lora["ms"] / full["ms"], "device": _device_name(args.device),
                          "date": time.strftime("%Y-%m-%d")}), flush=True)


if __name__ == "__main__":
    main()
