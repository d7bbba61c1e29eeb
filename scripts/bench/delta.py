"""Benchmark delta syncs of full weights against full syncs, on the 0.5B shape, one JSON line per figure.

1. changed: the fraction of bf16 elements that change in one real AdamW step (fp32 master weights, as
   mixed-precision trainers keep them, sent as bf16) at each --lr, and the bytes each encoding would
   take (index only, runs only, the per-tensor smallest). Weights are drawn at random (matrices
   N(0, 0.02), norms 1, biases 0): the shape and the magnitudes decide the fraction, not the values;
   gradients are random too (AdamW's step is about lr per element whatever their scale). Run tensor by
   tensor, so the fp32 optimizer state of the whole model is never held at once.
2. wire (--backend gloo): one audited sync (start, send beside update with the digests delivered,
   finish), full then delta, into a real bf16 model behind the engine's WeightUpdater in this process
   (the sender on a thread): median ms of --iters, bytes on the wire, and the ratio delta / full. The
   delta's time includes the sender's compare and encode, the rank's apply, and the audit of the full
   tensors at both ends.
Smoke test: --shape tiny --iters 1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

from inference.models.naming import expected_hf_tensors
from inference.transfer.delta import bits, encode
from inference.transfer.plan import TensorSpec
from inference.transfer.sender import WeightSender
from scripts.bench.sync import BenchReceiver, model_config


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


def adamw_step(shape: dict[str, tuple[int, ...]], lr: float, seed: int = 0) -> tuple[dict, dict]:
    """bf16 weights before and after the second of two AdamW steps (the first warms the moments)."""
    before, after = {}, {}
    gen = torch.Generator().manual_seed(seed + 1)
    for name, w in masters(shape, seed).items():
        p = torch.nn.Parameter(w)
        opt = torch.optim.AdamW([p], lr=lr, weight_decay=0.01)
        for step in range(2):
            p.grad = torch.randn(p.shape, generator=gen)
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
        _, sizes = encode(spec, bits(t), bits(before[name]))
        total += t.numel()
        changed += sizes["changed"]
        dense += sizes["dense"]
        index += sizes["index"] if sizes["changed"] else 0
        runs += sizes["runs"] if sizes["changed"] else 0
        chosen += min(v for k, v in sizes.items() if k != "changed") if sizes["changed"] else 0
    return {"figure": "changed", "lr": lr, "elements": total, "changed_fraction": changed / total,
            "full_bytes": dense, "index_only_bytes": index, "runs_only_bytes": runs, "chosen_bytes": chosen,
            "chosen_over_full": chosen / dense}


def wire(config: Any, states: list[dict[str, torch.Tensor]], delta: bool, iters: int) -> dict[str, Any]:
    """Audited syncs of states[0], states[1], states[0], ... (the first full; timed: the rest)."""
    receiver = BenchReceiver(config, torch.device("cpu"))
    updater = receiver.weights
    sender = WeightSender("gloo", timeout_s=300, delta=delta)
    pool = ThreadPoolExecutor(1)
    try:
        info = sender.init_info()
        connecting = pool.submit(sender.connect)
        updater.init_transfer(info)
        connecting.result()
        times, modes, wire_bytes = [], [], []
        for version in range(1, iters + 2):
            state = states[version % 2]
            t0 = time.perf_counter()
            manifest = sender.manifest(state, version)
            updater.start("target", version, manifest)
            sending = pool.submit(sender.send, state, deliver_digests=True)
            delivered = updater.update(digests_follow=True)
            sending.result()
            assert updater.finish(delivered).report.ok
            if version > 1:
                times.append((time.perf_counter() - t0) * 1e3)
                modes.append(sender.last_sync["mode"])
                wire_bytes.append(sender.last_sync["wire_bytes"])
        return {"ms": statistics.median(times), "modes": sorted(set(modes)), "wire_bytes": max(wire_bytes),
                "kept_copy_bytes": sender.kept.nbytes}
    finally:
        sender.close()
        updater.close_transfer()
        pool.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen2-0.5b")
    parser.add_argument("--lr", type=float, nargs="+", default=[1e-6, 1e-5])
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--backend", default="gloo", choices=["gloo"])
    args = parser.parse_args()
    config = model_config(args.shape)
    shape = expected_hf_tensors(config)
    steps = {}
    for lr in args.lr:
        before, after = adamw_step(shape, lr)
        print(json.dumps({"shape": args.shape, **changed_figures(before, after, lr)}), flush=True)
        steps[lr] = (before, after)
        del before, after
    for lr, (before, after) in steps.items():
        full = wire(config, [before, after], False, args.iters)
        delta = wire(config, [before, after], True, args.iters)
        print(json.dumps({"shape": args.shape, "figure": "wire", "backend": args.backend, "lr": lr, "full": full,
                          "delta": delta, "bytes_ratio": delta["wire_bytes"] / full["wire_bytes"],
                          "time_ratio": delta["ms"] / full["ms"], "threads": torch.get_num_threads()}), flush=True)
        del full, delta


if __name__ == "__main__":
    main()
