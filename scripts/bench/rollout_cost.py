"""What scripts/bench/rollout.py measures a run against: the device's rates, the roofline of the schedule the
engine ran (per StepRecord: weights (of an MoE model's experts those the step touched) + context KV bytes
over the HBM rate, FLOPs over the matmul peak), the schedule's tail and batch statistics, the wall time by
running batch, and --profile's kernel tables."""

from __future__ import annotations

import gc
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from inference.engine.llm import LLM
from inference.engine.step_stats import StepRecord


class StepProbe:
    """torch.profiler over windows of `length` steps starting at the given step indices (--profile):
    writes each window's GPU kernel table (per step) to DIR/<name>_step<start>.txt. A diagnostic: the
    profiled steps run slower, so a row taken with it says "profiled"."""

    def __init__(self, out_dir: str, name: str, starts: list[int], length: int = 16) -> None:
        self.out_dir, self.name, self.starts, self.length = out_dir, name, set(starts), length
        self.prof: torch.profiler.profile | None = None
        self.start = 0

    def at(self, step: int) -> None:
        if self.prof is not None and step == self.start + self.length:
            self.close()
        if self.prof is None and step in self.starts:
            self.start = step
            acts = [torch.profiler.ProfilerActivity.CUDA if torch.cuda.is_available()
                    else torch.profiler.ProfilerActivity.CPU]
            self.prof = torch.profiler.profile(activities=acts)
            self.prof.__enter__()

    def close(self) -> None:
        if self.prof is None:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.prof.__exit__(None, None, None)
        averages = self.prof.key_averages()
        keys = ["self_cuda_time_total"] if torch.cuda.is_available() else []
        tables = [averages.table(sort_by=key, row_limit=40, max_name_column_width=70)
                  for key in [*keys, "self_cpu_time_total"]]  # the device's kernels, then the host's calls
        os.makedirs(self.out_dir, exist_ok=True)
        with open(os.path.join(self.out_dir, f"{self.name}_step{self.start}.txt"), "w") as f:
            f.write(f"{self.length} steps from step {self.start}\n" + "\n".join(tables) + "\n")
        self.prof = None


class GCPauses:
    """The Python garbage collector's pauses while it is entered (gc.callbacks): a long run keeps
    hundreds of sequences' token lists alive, and a full collection stalls the host's step work."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float]] = []  # (generation, seconds)
        self._t0 = 0.0

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.pauses.append((info["generation"], time.perf_counter() - self._t0))

    def __enter__(self) -> GCPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def summary(self) -> dict[str, float]:
        """{count, total_ms, max_ms, gen2: full collections}."""
        times = [t for _, t in self.pauses]
        return {"count": len(times), "total_ms": round(1e3 * sum(times), 3),
                "max_ms": round(1e3 * max(times, default=0.0), 3), "gen2": sum(g == 2 for g, _ in self.pauses)}


_EDGES = (1, 9, 33, 129, 513, 1 << 30)


def batch_range(rows: int) -> str:
    """The by_batch key of a step of `rows` rows: "1-8", "9-32", "33-128", "129-512" or "513+"."""
    lo = max(e for e in _EDGES if e <= rows)
    hi = _EDGES[_EDGES.index(lo) + 1] - 1
    return f"{lo}-{hi}" if hi < 1 << 29 else f"{lo}+"


def steps_by_range(counts: dict[int, int]) -> dict[str, int]:
    """{rows: steps} summed per by_batch range."""
    out: dict[str, int] = {}
    for rows, n in sorted(counts.items()):
        out[batch_range(rows)] = out.get(batch_range(rows), 0) + n
    return out


def by_batch(records: list[StepRecord], cost: ModelCost, rates: tuple[float, float], t0: float,
             touched: Sequence[int] | None = None) -> dict[str, list[float]]:
    """Where the wall time goes by running batch: {"lo-hi": [steps, ms per step, roofline ms per step]};
    a step's time is the gap between its commit and the previous one's (the throughput period, which
    async scheduling overlaps)."""
    out: dict[str, list[float]] = {}
    prev = t0
    for i, r in enumerate(records):
        key = batch_range(r.num_seqs)
        nbytes, flops = cost.step_bytes_flops(r, int(touched[i]) if touched is not None else 0)
        cell = out.setdefault(key, [0, 0.0, 0.0])
        cell[0] += 1
        cell[1] += r.end_s - prev
        cell[2] += max(nbytes / rates[0], flops / rates[1])
        prev = r.end_s
    return {k: [n, round(1e3 * w / n, 3), round(1e3 * roof / n, 3)] for k, (n, w, roof) in out.items()}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_seconds(fn: object, device: torch.device, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def copy_rate(device: torch.device) -> float:
    """Bytes/s of a large device-to-device copy, counting read and write (best of 5, after one)."""
    x = torch.empty((1 << 31) if device.type == "cuda" else (64 << 20), dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    return 2 * x.numel() / best_seconds(lambda: y.copy_(x), device, 5)


def matmul_rate(device: torch.device) -> float:
    """FLOP/s of an 8192^3 bf16 GEMM (512^3 float32 on CPU), best of 10 after one."""
    n, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (512, torch.float32)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    a @ b
    return 2 * n**3 / best_seconds(lambda: a @ b, device, 10)


def measure_rates(device: torch.device) -> tuple[float, float]:
    """(HBM bytes/s, matmul FLOP/s) of this device, before any engine holds memory."""
    rates = copy_rate(device), matmul_rate(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rates


@dataclass(frozen=True)
class ModelCost:
    """What one step of the target reads and computes, per unit of the StepRecord counts (TP 1). An MoE
    model's experts are charged per step by the (MoE layer, expert) pairs the step touched
    (scripts/bench/experts_touched.py), each read once; a dense model has no experts (both fields 0)."""

    weight_bytes: int  # read once per step (an untied embedding is gathered by row: not counted; nor experts)
    kv_bytes_per_token: int  # K and V of one position across layers
    matmul_params: int  # 2-D weights of the decoder layers (each query token multiplies them once)
    head_params: int  # LM head (once per sampled row)
    attn_flops_per_pair: int  # 4 x heads x head_dim x layers: QK^T and PV for one (query, key) pair
    expert_bytes: int = 0  # one expert of one MoE layer (gate, up and down), read once by a step that touches it
    expert_params_per_token: int = 0  # the routed experts' weights one token multiplies (k of them per MoE layer)
    experts_per_token: int = 0  # the (MoE layer, expert) pairs one token reaches: k x MoE layers

    @property
    def one_token_bytes(self) -> int:
        """The weight bytes a step of one token reads: the batch-1 floor."""
        return self.weight_bytes + self.expert_bytes * self.experts_per_token

    @classmethod
    def of(cls, llm: LLM) -> ModelCost:
        model, mc = llm.worker.models["target"], llm.model_config
        params = dict(model.named_parameters())
        total = sum(p.numel() * p.element_size() for p in params.values())
        # FP8 linears (docs/fp8.md) also read their fp32 row scales
        total += sum(b.numel() * b.element_size() for n, b in model.named_buffers() if n.endswith("weight_scale"))
        embed = params["model.embed_tokens.weight"]
        gathered = 0 if mc.tie_word_embeddings else embed.numel() * embed.element_size()
        layers = sum(p.numel() for name, p in params.items() if name.startswith("model.layers.") and p.dim() == 2)
        experts = [p for name, p in params.items() if ".experts." in name]  # [E, ...] per layer and projection
        expert_total = sum(p.numel() * p.element_size() for p in experts)
        pairs = mc.num_experts * mc.num_moe_layers  # (layer, expert) pairs
        assert expert_total % max(1, pairs) == 0, "every MoE layer's experts have one size"
        assert llm.worker.runner is not None
        return cls(total - gathered - expert_total, llm.worker.runner.kv_bytes_per_block(1), layers,
                   mc.vocab_size * mc.hidden_size, 4 * mc.num_heads * mc.head_dim * mc.num_layers,
                   expert_total // pairs if pairs else 0,
                   mc.num_experts_per_tok * sum(p.numel() for p in experts) // mc.num_experts if pairs else 0,
                   mc.num_experts_per_tok * mc.num_moe_layers)

    def step_bytes_flops(self, r: StepRecord, experts_touched: int = 0) -> tuple[int, int]:
        """(bytes, FLOPs) of a step; experts_touched: the (MoE layer, expert) pairs it read."""
        assert experts_touched or not self.expert_bytes or not (r.decode_tokens + r.prefill_tokens), \
            "an MoE step's roofline needs the experts it touched"
        bytes_read = (self.weight_bytes + self.expert_bytes * experts_touched
                      + self.kv_bytes_per_token * r.context_tokens)
        flops = (2 * (self.matmul_params + self.expert_params_per_token) * (r.decode_tokens + r.prefill_tokens)
                 + 2 * self.head_params * r.num_sampled + self.attn_flops_per_pair * r.attended_pairs)
        return bytes_read, flops


def roofline(records: list[StepRecord], cost: ModelCost, hbm: float, peak: float,
             touched: Sequence[int] | None = None) -> dict[str, float]:
    """Seconds of the schedule at the rates: per step the slower of its bytes and its FLOPs (touched[i]:
    the expert pairs step i read, for an MoE model)."""
    total = bytes_bound = flops_bound = 0.0
    for i, r in enumerate(records):
        nbytes, flops = cost.step_bytes_flops(r, int(touched[i]) if touched is not None else 0)
        t_bytes, t_flops = nbytes / hbm, flops / peak
        total += max(t_bytes, t_flops)
        bytes_bound += t_bytes
        flops_bound += t_flops
    return {"roofline_s": total, "roofline_bytes_s": bytes_bound, "roofline_flops_s": flops_bound}


def schedule_stats(records: list[StepRecord], t0: float, t1: float, num_samples: int) -> dict[str, float]:
    """Tail share (wall time after ceil(90%) of the samples finished over the whole), the mean running
    batch (rows per step) and the mean decode batch (decode rows per step that had any)."""
    target = math.ceil(0.9 * num_samples)
    done, t90 = 0, t1
    for r in records:
        done += r.num_finished
        if done >= target:
            t90 = r.end_s
            break
    decode_steps = [r.num_decode for r in records if r.num_decode]
    return {"tail_share": (t1 - t90) / (t1 - t0),
            "mean_running_batch": sum(r.num_seqs for r in records) / max(1, len(records)),
            "mean_decode_batch": sum(decode_steps) / max(1, len(decode_steps)),
            "prefill_steps": sum(1 for r in records if r.prefill_tokens)}
