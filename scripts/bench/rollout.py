"""Rollout throughput on the workload RL runs: a GRPO-shaped batch through `inference.LLM`.

The default batch: 64 prompts of 128..512 random token ids, 8 samples each (512 sequences), every
sample's length drawn with a fixed RNG from a lognormal (median 350, sigma 0.757: mean ~466) capped
at 2048. A sample generates exactly its drawn length (ignore_eos, its own max_tokens), so the batch
drains the way a rollout whose samples stop at EOS does. Random bf16 weights of the Qwen2-0.5B and
Qwen2.5-7B shapes, built locally from a config.json (load_format="dummy"; nothing is downloaded);
`--shapes tiny` runs the embedded tiny model, on CPU too (the smoke test).

For every shape and every sampling mode (greedy; temperature 1 unseeded; temperature 1 with a seed
per sample), one JSON line: tok/s (generated tokens / wall time), steps, ms per step, the tail share
(the share of the wall time after 90% of the samples finished), the mean running batch, and the
roofline of the same schedule: per step of the engine's StepLog, max(bytes / HBM rate, FLOPs / matmul
peak), with bytes = the weights read once + the KV of every row's context and FLOPs = 2 x matmul
parameters x tokens computed + the LM head over the sampled rows + attention (4 x heads x head_dim x
layers per attended (query, key) pair); both rates are measured in the same run (a device-to-device
copy, counting read and write; a large bf16 matmul). time_over_roofline = wall time / roofline sum.
With a draft (--draft-layers) the roofline counts the target's work only. Per running-batch range
("1-8", "9-32", ...): `by_batch` [steps, ms per step, roofline ms per step], `eager_by_batch` the steps
that ran the eager forward beside captured decode graphs, `prefill_steps_by_batch` the steps that
computed prompt or recompute tokens (the 7B's 9-32 range ran ~2x its roofline a step: these say whether
such steps are eager or prefill ones); `gc_pauses` the garbage collector's pauses in the timed run, which
follows a freeze of the warm heap as in the sidecar's rank (`gc_frozen`; `--gc-freeze off` for the A/B),
and `gc_full_collect_ms` what one full collection of that heap took before the freeze; `model_cost` the
per-step counts the roofline uses. A run fails if any sample generated another length than it drew.
--dry-run prints each shape's workload ("rollout_workload": counts and lengths) without building anything.
`--quantization bf16,fp8` runs each shape unquantized (the model dtype) and in FP8 (docs/fp8.md: the same
seeded weights, quantized by the rule) in one run: every row carries its `quantization` and
`weight_roofline_ms` (the weight bytes of one step over the measured HBM rate: the batch-1 floor), and
per shape and mode a "rollout_fp8" line gives fp8/bf16 tok/s, both weight rooflines and, for greedy, the
gap: over each sample's prefix where both runs chose the same tokens (the same context), the mean
|logprob difference| and the share of positions whose greedy choice differs (a sample's first divergence).

--lora-rank R: each shape runs twice in the same process, merged (the plain model: merged weights cost what
the base costs) and LoRA-served (a random rank-R "all-linear" PEFT adapter, `LLM(..., lora=DIR)`), rows
tagged `lora_rank`, then one "rollout_lora" line per mode: lora_over_merged = merged tok/s / LoRA tok/s.
--batch-invariant / --no-batch-invariant: the engine in the batch-invariant mode or not (unset: the
engine's default); every row says which (`batch_invariant`). --self-draft / --no-self-draft: the mode
with or without its own draft (`self_draft` in every row).

MoE shapes (`qwen3-30b-a3b`; `qwen3-moe-tiny`, the CPU smoke): the roofline is the active-weight one, each
step charged the (MoE layer, expert) pairs its tokens went to (scripts/bench/experts_touched.py), and each
mode is timed without routing and with every request asking for it (SamplingParams.return_routing), A B
(A B B A with --routing-repeats 2), after one warm-up: a row per run (`return_routing`,
`experts_touched_mean`: per MoE layer and step) and a "rollout_routing" line, routing_over_plain = the
routing runs' wall time over the plain ones'. The experts of a plain run's steps are counted on the first
routing run's rows at the same samples and positions. `--layers N` builds a Qwen shape with N decoder
layers (48 A3B layers are 61 GB in bf16: on an 80 GB GPU the KV cache would hold a fraction of the batch);
the roofline counts the layers built.

    python3 -m scripts.bench.rollout                      # both shapes x 3 modes (H200, ~4 min)
    python3 scripts/bench/rollout.py --dry-run            # the default workload, described
    python3 -m scripts.bench.rollout --shapes tiny --prompts 4 --samples 2 --len-cap 32   # CPU smoke
    python3 -m scripts.bench.rollout --quantization bf16,fp8 --modes greedy,seeded   # the FP8 column
    python3 -m scripts.bench.rollout --shapes qwen3-30b-a3b --layers 8 --modes seeded --routing-repeats 2
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import random
import shutil
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, replace
from itertools import accumulate
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a file from a checkout too

from inference.core import CompletionOutput, SamplingParams
from inference.engine.llm import LLM
from inference.engine.step_stats import StepLog, StepRecord
from inference.memory.host_heap import freeze_startup_heap
from scripts.bench.experts_touched import SpanLog, StepSpans, touched_per_step
from scripts.bench.rollout_cost import (
    GCPauses,
    ModelCost,
    StepProbe,
    by_batch,
    measure_rates,
    roofline,
    schedule_stats,
    steps_by_range,
    sync,
)

MODES = ("greedy", "sampled", "seeded")  # temperature 0; temperature 1 unseeded; temperature 1 seeded
QWEN_SHAPES = ("qwen2-0.5b", "qwen2.5-7b")  # scripts.bench.generate.SHAPES
MOE_SHAPES = ("qwen3-30b-a3b", "qwen3-moe-tiny")  # the same; qwen3-moe-tiny: the MoE smoke (CPU too)
SHAPE_NAMES = (*QWEN_SHAPES, *MOE_SHAPES, "tiny")
QUANTIZATIONS = {"bf16": "none", "fp8": "fp8"}  # --quantization label -> EngineConfig.quantization


@dataclass(frozen=True)
class Workload:
    """prompts[i] has samples lengths[i] (one generated length per sample)."""

    prompts: list[list[int]]
    lengths: list[list[int]]

    @property
    def num_samples(self) -> int:
        return sum(map(len, self.lengths))

    @property
    def num_tokens(self) -> int:
        return sum(map(sum, self.lengths))


def draw_workload(args: argparse.Namespace, vocab: int, seed: int) -> Workload:
    """Prompt lengths uniform in [prompt_min, prompt_max], tokens uniform over the vocabulary, sample
    lengths lognormal(ln(len_median), len_sigma) rounded and clipped to [1, len_cap]. The lengths do
    not depend on the vocabulary, so every shape runs the same schedule."""
    rng = random.Random(seed)
    mu = math.log(args.len_median)
    lengths = [[min(args.len_cap, max(1, round(rng.lognormvariate(mu, args.len_sigma))))
                for _ in range(args.samples)] for _ in range(args.prompts)]
    prompt_rng = random.Random(seed + 1)
    prompts = [[prompt_rng.randrange(vocab) for _ in range(prompt_rng.randint(args.prompt_min, args.prompt_max))]
               for _ in range(args.prompts)]
    return Workload(prompts, lengths)


def sampling_params(mode: str, n: int, max_tokens: int, seed: int, routing: bool = False) -> SamplingParams:
    if mode == "greedy":
        return SamplingParams(n=n, temperature=0.0, max_tokens=max_tokens, ignore_eos=True, return_routing=routing)
    return SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, ignore_eos=True,
                          seed=seed if mode == "seeded" else None, return_routing=routing)


def submit(llm: LLM, work: Workload, mode: str, routing: bool = False) -> list[str]:
    """One request of n samples per prompt (the samples share the prompt's prefix blocks, as in GRPO);
    each sample then gets its own max_tokens: the request asks for the longest, and the bench lowers
    the others' on their sequences before the first step (standing in for EOS). Returns the request ids
    in the workload's order. `routing`: every request asks for its routing (SamplingParams.return_routing)."""
    wanted: dict[str, list[int]] = {}
    for i, (prompt, lens) in enumerate(zip(work.prompts, work.lengths)):
        rid = llm.add_request(prompt, sampling_params(mode, len(lens), max(lens), seed=1000 + i, routing=routing))
        wanted[rid] = lens
    for seq in llm.scheduler.waiting:
        if seq.request_id in wanted:
            seq.params = replace(seq.params, max_tokens=wanted[seq.request_id][seq.index])
    return list(wanted)


def run(llm: LLM, work: Workload, mode: str, probe: StepProbe | None = None,
        keep: list[CompletionOutput] | None = None, routing: bool = False) -> list[str]:
    """Generate the workload; returns the request ids in the workload's order. Every sample must generate
    exactly its drawn length (a figure over another schedule would not compare with the others). `keep`:
    filled with every sample's output, in the workload's order."""
    rids = submit(llm, work, mode, routing)
    got: dict[str, list[int]] = {}
    kept: dict[str, list] = {}
    step = 0
    while llm.has_unfinished():
        if probe is not None:
            probe.at(step)
        for out in llm.step():
            got[out.request_id] = [len(c.token_ids) for c in out.outputs]
            if keep is not None:
                kept[out.request_id] = out.outputs
        step += 1
    if keep is not None:
        keep.extend(sample for rid in rids for sample in kept[rid])
    if probe is not None:
        probe.close()
    lengths = [got.get(rid) for rid in rids]
    if lengths != work.lengths:
        raise RuntimeError(f"generated lengths {lengths} differ from the workload's {work.lengths}")
    return rids


@torch.no_grad()
def damp_tail(target: torch.nn.Module, draft_layers: int, scale: float) -> None:
    """Scale o_proj and down_proj of the target's layers beyond the draft's by `scale` (--tail-scale), so a
    draft of the first layers agrees with the target as a trained draft does (spec.py's damping): the
    damped layers still cost their full compute. 1.0 leaves random layers (a poor guesser)."""
    if scale != 1.0:
        from scripts.bench.spec import tail

        for name, p in tail(target, draft_layers).items():
            if p.dtype == torch.float8_e4m3fn:  # an FP8 weight is scaled through its row scales
                target.get_submodule(name.rpartition(".")[0]).weight_scale.mul_(scale)
            else:
                p.mul_(scale)


def write_adapter(model_dir: Path, rank: int, out: Path) -> Path:
    """A random rank-`rank` PEFT LoRA adapter on every linear of model_dir's layers (B nonzero, as after
    training), as adapter_config.json + adapter_model.safetensors."""
    from safetensors.torch import save_file

    from inference.models.hf_config import read_model_config
    from inference.models.naming import expected_hf_tensors, lora_name

    gen = torch.Generator().manual_seed(rank)
    tensors = {}
    for name, dims in expected_hf_tensors(read_model_config(model_dir)).items():
        if ".layers." in name and name.endswith(".weight") and len(dims) == 2:
            for kind, shape in (("lora_A", (rank, dims[1])), ("lora_B", (dims[0], rank))):
                tensors["base_model.model." + lora_name(name, kind)] = (
                    torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": "all-linear"}))
    return out


def shape_layers(shape: str, args: argparse.Namespace) -> int:
    """The decoder layers a Qwen shape is built with: --layers, else the shape's own."""
    from scripts.bench.generate import SHAPES

    return int(getattr(args, "layers", 0) or SHAPES[shape]["num_hidden_layers"])


def build_llm(shape: str, args: argparse.Namespace, max_len: int, quantization: str = "bf16") -> LLM:
    """The engine for a shape: the tiny model as shipped, or a Qwen shape with random bf16 weights
    (and, with --draft-layers, a draft made of the target's first layers: scripts/bench/spec.py), its
    linears in FP8 with quantization "fp8" (the draft's too)."""
    kw: dict[str, object] = {"max_num_seqs": args.max_num_seqs or None, "max_model_len": max_len,
                             "enforce_eager": args.enforce_eager, "quantization": QUANTIZATIONS[quantization]}
    if args.async_scheduling != "auto":
        kw["async_scheduling"] = args.async_scheduling == "on"
    if args.kv_gib:
        kw["kv_cache_bytes"] = int(args.kv_gib * 2**30)
    if getattr(args, "lora_dir", None):
        kw["lora"] = args.lora_dir
    if args.batch_invariant is not None:
        kw["batch_invariant"] = args.batch_invariant
    if args.self_draft is not None:  # the mode's own draft: its k and batch bound are --k and --spec-max-batch
        kw.update(self_draft=args.self_draft, num_speculative_tokens=args.k, spec_max_batch=args.spec_max_batch)
    if shape == "tiny":
        if not args.draft_layers:
            return LLM(None, device=args.device, **kw)
        # the draft cut from the checkpoint's first layers, as the Qwen shapes' (the engine loads it at once)
        from inference.models.tiny import default_model_dir, first_layers

        with tempfile.TemporaryDirectory(prefix="bench-rollout-draft-") as tmp:
            draft = first_layers(default_model_dir(), Path(tmp) / "draft", args.draft_layers)
            kw.update(draft_model=str(draft), num_speculative_tokens=args.k, spec_max_batch=args.spec_max_batch)
            llm = LLM(None, device=args.device, **kw)
        damp_tail(llm.worker.models["target"], args.draft_layers, args.tail_scale)
        return llm
    from scripts.bench.spec import config_dir, tie_draft

    dirs = [config_dir(shape, shape_layers(shape, args), max_len)]
    if args.draft_layers:
        dirs.append(config_dir(shape, args.draft_layers, max_len))
        kw.update(draft_model=str(dirs[1]), num_speculative_tokens=args.k, spec_max_batch=args.spec_max_batch)
    try:
        llm = LLM(dirs[0], device=args.device, dtype="bfloat16", load_format="dummy",
                  gpu_memory_utilization=args.gpu_memory_utilization, **kw)
    finally:  # config.json only, read at construction
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
    if args.draft_layers:
        tie_draft(llm, args.draft_layers)
        damp_tail(llm.worker.models["target"], args.draft_layers, args.tail_scale)
    return llm


@dataclass
class TimedRun:
    """One timed run of a workload: its row but the roofline, and what the roofline is computed from."""

    row: dict[str, object]
    records: list[StepRecord]
    t0: float
    spans: list[StepSpans]  # per step, the positions it computed (a SpanLog's; empty without one)
    sample_of: dict[tuple[str, int], int]  # (request id, sample index) -> the sample's place in the workload
    outputs: list[CompletionOutput]  # every sample's, in the workload's order (when kept)


def run_case(llm: LLM, mode: str, work: Workload, warm: Workload | None, probe: StepProbe | None = None,
             gc_freeze: bool = True, keep: list | None = None, routing: bool = False,
             spans: bool = False) -> TimedRun:
    """Warm up (this mode's sampling kernels compile at the batch sizes a drain passes; `warm` None: not
    again), then time the workload with a StepLog attached (a SpanLog with `spans`); no prompt block of an
    earlier run is in the prefix cache. With `gc_freeze` the heap alive after the warm-up is frozen first,
    as the sidecar's rank freezes it. `routing`: the requests ask for their routing (the warm-up's too)."""
    device = llm.worker.device
    assert device is not None
    if warm is not None:
        llm.block_manager.reset_prefix_cache()
        run(llm, warm, mode, routing=routing)
    llm.block_manager.reset_prefix_cache()
    # as the sidecar's rank does once its engine is warm (inference/memory/host_heap.py); run_shape unfreezes
    full_collect_s = freeze_startup_heap().seconds if gc_freeze else None
    preempted = llm.scheduler.preempted
    spec_before = (llm.spec_stats.proposed, llm.spec_stats.accepted, llm.spec_stats.steps)
    runner = llm.worker.runner
    eager_before = Counter(runner.eager_steps) if runner is not None else Counter()
    log = llm.step_log = SpanLog() if spans else StepLog()
    sync(device)
    t0 = time.perf_counter()
    with GCPauses() as pauses:
        rids = run(llm, work, mode, probe, keep, routing)
        sync(device)
    t1 = time.perf_counter()
    records, llm.step_log = log.records, None
    wall, steps = t1 - t0, len(records)
    proposed = llm.spec_stats.proposed - spec_before[0]
    graphs = llm.worker.runner.graphs if llm.worker.runner is not None else None
    generated = work.num_tokens
    row: dict[str, object] = {
        "sequences": work.num_samples, "prompt_tokens": sum(map(len, work.prompts)), "generated_tokens": generated,
        "mean_len": generated / work.num_samples, "longest": max(map(max, work.lengths)),
        "max_num_seqs": llm.worker.max_num_seqs, "graph_max_batch": graphs.sizes[-1] if graphs else 0,
        "wall_s": wall, "tok_s": generated / wall, "steps": steps, "ms_per_step": 1e3 * wall / max(1, steps)}
    row.update(schedule_stats(records, t0, t1, work.num_samples))
    row.update(preempted=llm.scheduler.preempted - preempted,
               spec_acceptance=(llm.spec_stats.accepted - spec_before[1]) / proposed if proposed else None,
               spec_steps=llm.spec_stats.steps - spec_before[2],  # steps that carried draft tokens
               profiled=probe is not None,
               # steps per range that ran the eager forward beside captured graphs (prefill, or past them)
               eager_by_batch=steps_by_range(runner.eager_steps - eager_before) if runner is not None else {},
               prefill_steps_by_batch=steps_by_range(Counter(r.num_seqs for r in records if r.prefill_tokens)),
               gc_pauses=pauses.summary(), gc_frozen=gc_freeze,
               # one full collection of the warm process, before the freeze: what each would cost unfrozen
               gc_full_collect_ms=None if full_collect_s is None else 1e3 * full_collect_s)
    order = {rid: i for i, rid in enumerate(rids)}
    first = [0, *accumulate(map(len, work.lengths))]
    sample_of = {(rid, j): first[order[rid]] + j for rid in rids for j in range(len(work.lengths[order[rid]]))}
    return TimedRun(row, records, t0, log.spans if isinstance(log, SpanLog) else [], sample_of, keep or [])


def finish_row(timed: TimedRun, cost: ModelCost, rates: tuple[float, float],
               touched: np.ndarray | None = None) -> dict[str, object]:
    """The timed run's row with its roofline (touched[i]: the expert pairs step i read, an MoE model's)."""
    records, row = timed.records, dict(timed.row)
    roof = roofline(records, cost, *rates, touched)
    row.update(roof)
    row.update(roofline_ms_per_step=1e3 * roof["roofline_s"] / max(1, len(records)),
               time_over_roofline=row["wall_s"] / roof["roofline_s"], hbm_gbps=rates[0] / 1e9,  # type: ignore[operator]
               weight_roofline_ms=1e3 * cost.one_token_bytes / rates[0], matmul_tflops=rates[1] / 1e12,
               by_batch=by_batch(records, cost, rates, timed.t0, touched))
    row.update(model_cost=asdict(cost))
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}


def routing_runs(llm: LLM, mode: str, work: Workload, warm: Workload, cost: ModelCost, rates: tuple[float, float],
                 args: argparse.Namespace) -> list[dict[str, object]]:
    """An MoE shape's mode: the workload timed without routing (A) and with every request asking for it
    (B, SamplingParams.return_routing), in the order A B (A B B A with --routing-repeats 2, and so on:
    alternated, so that a drift between runs cancels), after one warm-up with routing. Every run's
    roofline charges each step the experts it touched, counted on the first B run's routing (an A run's
    steps at the same samples and positions). Returns one row per run, then the "rollout_routing" line
    (without shape and device): B's wall time over A's."""
    mc = llm.model_config
    order = [i % 4 in (1, 2) for i in range(2 * args.routing_repeats)]  # False: A, True: B
    llm.block_manager.reset_prefix_cache()
    run(llm, warm, mode, routing=True)  # the warm-up: a routing request's path covers a plain one's
    timed = [run_case(llm, mode, work, None, gc_freeze=args.gc_freeze == "on", keep=[] if routing else None,
                      routing=routing, spans=True) for routing in order]
    source = [o.routing for o in timed[order.index(True)].outputs]
    rows: list[dict[str, object]] = []
    walls = {False: 0.0, True: 0.0}
    for t, routing in zip(timed, order):
        own = [o.routing for o in t.outputs] if routing else source
        touched = touched_per_step(t.spans, t.sample_of, own, mc.num_experts)
        row = finish_row(t, cost, rates, touched)
        row.update(return_routing=routing, experts_touched_mean=round(float(touched.mean()) / mc.num_moe_layers, 2))
        walls[routing] += float(row["wall_s"])  # type: ignore[arg-type]
        rows.append(row)
    tokens = work.num_tokens * args.routing_repeats
    rows.append({"bench": "rollout_routing", "mode": mode, "runs": "".join("AB"[o] for o in order),
                 "plain_wall_s": round(walls[False], 4), "routing_wall_s": round(walls[True], 4),
                 "plain_tok_s": round(tokens / walls[False], 1), "routing_tok_s": round(tokens / walls[True], 1),
                 "routing_over_plain": round(walls[True] / walls[False], 4),
                 "routing_bytes": sum(r.nbytes for r in source)})  # one run's arrays, as returned
    return rows


def run_shape(shape: str, args: argparse.Namespace, rates: tuple[float, float], quantization: str = "bf16",
              greedy: list | None = None) -> list[dict[str, object]]:
    """Every mode of one shape in one quantization; `greedy` gets the greedy mode's samples (see run).
    An MoE shape's modes run with and without routing (routing_runs)."""
    start = time.perf_counter()
    llm = build_llm(shape, args, args.prompt_max + args.len_cap, quantization)
    setup_s = time.perf_counter() - start
    rows = []
    try:
        if args.prompt_max + args.len_cap > llm.max_model_len:
            raise SystemExit(f"{shape}: max_model_len {llm.max_model_len} < --prompt-max + --len-cap")
        vocab = llm.model_config.vocab_size
        work = draw_workload(args, vocab, args.seed)
        warm = draw_workload(args, vocab, args.seed + 7)
        if args.warmup == "short":
            warm = replace(warm, lengths=[[1 + (i + j) % min(16, args.len_cap) for j in range(args.samples)]
                                          for i in range(args.prompts)])
        cost = ModelCost.of(llm)
        device = llm.worker.device
        name = torch.cuda.get_device_name(device) if device is not None and device.type == "cuda" else "cpu"
        for mode in args.modes:
            row: dict[str, object] = {"bench": "rollout", "shape": shape, "layers": llm.model_config.num_layers,
                                      "mode": mode, "prompts": args.prompts,
                                      "lora_rank": args.lora_rank if getattr(args, "lora_dir", None) else 0,
                                      "samples": args.samples, "draft_layers": args.draft_layers,
                                      "tail_scale": args.tail_scale if args.draft_layers else None,
                                      "spec_max_batch": (llm.config.scheduler.spec_max_batch if llm.worker.spec
                                                         else None),
                                      "k": llm.worker.num_speculative_tokens or None,
                                      "async_scheduling": llm._overlap is not None, "quantization": quantization,
                                      "batch_invariant": llm.config.batch_invariant,
                                      "self_draft": llm.worker.spec is not None and llm.worker.spec.shares_kv}
            if cost.expert_bytes:
                *runs, line = routing_runs(llm, mode, work, warm, cost, rates, args)
                lines = [{**row, **r} for r in runs]
                lines.append({"bench": line.pop("bench"), "shape": shape, "layers": row["layers"], **line})
                for out in lines:
                    out.update(setup_s=round(setup_s, 2), device=name)
                    print(json.dumps(out), flush=True)
                rows += lines
                continue
            probe = (StepProbe(args.profile, f"{shape}_{mode}", args.profile_steps, args.profile_length)
                     if args.profile else None)
            keep = greedy if mode == "greedy" else None
            timed = run_case(llm, mode, work, warm, probe, args.gc_freeze == "on", keep)
            row.update(finish_row(timed, cost, rates))
            row.update(setup_s=round(setup_s, 2), device=name)
            print(json.dumps(row), flush=True)
            rows.append(row)
    finally:
        gc.unfreeze()  # the engine's cycles (and the device memory they hold) must be collectable now
        llm.worker.shutdown()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def greedy_gap(base: list[CompletionOutput], other: list[CompletionOutput]) -> dict[str, float]:
    """Two greedy runs of one workload: over each sample's common prefix (same tokens, so the same context)
    the mean |logprob difference| of its tokens, and the share of positions with that context whose choice
    differs (one per sample that diverges); the share of samples identical throughout."""
    diffs: list[float] = []
    positions = diverged = identical = 0
    for a_out, b_out in zip(base, other, strict=True):
        ids_a, lps_a, ids_b, lps_b = a_out.token_ids, a_out.logprobs, b_out.token_ids, b_out.logprobs
        same = next((i for i, (a, b) in enumerate(zip(ids_a, ids_b)) if a != b), len(ids_a))
        diffs += [abs(a - b) for a, b in zip(lps_a[:same], lps_b[:same])]
        positions += same + (same < len(ids_a))
        diverged += same < len(ids_a)
        identical += same == len(ids_a)
    return {"mean_abs_logprob_gap": sum(diffs) / max(1, len(diffs)),
            "greedy_choice_differs": diverged / max(1, positions), "identical_samples": identical / max(1, len(base))}


def compare_rows(shape: str, rows: dict[str, list[dict[str, object]]], greedy: dict[str, list]) -> list[dict]:
    """The "rollout_fp8" lines of a shape run in bf16 and fp8: one per mode."""
    out = []
    for base, fp8 in zip(rows["bf16"], rows["fp8"], strict=True):
        line: dict[str, object] = {
            "bench": "rollout_fp8", "shape": shape, "mode": base["mode"], "bf16_tok_s": base["tok_s"],
            "fp8_tok_s": fp8["tok_s"], "fp8_over_bf16": round(fp8["tok_s"] / base["tok_s"], 4),  # type: ignore[operator]
            "bf16_weight_roofline_ms": base["weight_roofline_ms"], "fp8_weight_roofline_ms": fp8["weight_roofline_ms"],
            "fp8_time_over_roofline": fp8["time_over_roofline"], "device": fp8["device"]}
        if base["mode"] == "greedy":
            line.update({k: round(v, 6) for k, v in greedy_gap(greedy["bf16"], greedy["fp8"]).items()})
        out.append(line)
    return out


def vocab_size(shape: str) -> int:
    """The vocabulary a shape's prompts are drawn over (without building its engine)."""
    if shape == "tiny":
        from inference.models.tiny import DEFAULT_TINY

        return DEFAULT_TINY.resolved_vocab_size
    from scripts.bench.generate import SHAPES

    return SHAPES[shape]["vocab_size"]


def workload_line(shape: str, args: argparse.Namespace) -> dict[str, object]:
    """What --dry-run prints: the timed workload of a shape, described (nothing is built or run)."""
    work = draw_workload(args, vocab_size(shape), args.seed)
    prompt_lens = [len(p) for p in work.prompts]
    sample_lens = [n for lens in work.lengths for n in lens]
    return {"bench": "rollout_workload", "shape": shape, "prompts": len(work.prompts),
            "sequences": work.num_samples, "prompt_len_min": min(prompt_lens), "prompt_len_max": max(prompt_lens),
            "generated_tokens": work.num_tokens, "mean_len": round(work.num_tokens / work.num_samples, 4),
            "longest": max(sample_lens), "shortest": min(sample_lens)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(QWEN_SHAPES), help=f"comma list of {SHAPE_NAMES}")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma list of {MODES}")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--samples", type=int, default=8, help="samples per prompt (SamplingParams.n)")
    ap.add_argument("--prompt-min", type=int, default=128)
    ap.add_argument("--prompt-max", type=int, default=512)
    ap.add_argument("--len-median", type=float, default=350.0, help="lognormal median of a sample's length")
    ap.add_argument("--len-sigma", type=float, default=0.757, help="lognormal sigma (0.757: mean ~466)")
    ap.add_argument("--len-cap", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0, help="the workload RNG")
    ap.add_argument("--warmup", choices=["full", "short"], default="full",
                    help="full: an untimed run of a whole workload (other prompts, another draw of the lengths) before "
                         "each timed one, so first-use costs (graph uploads at a size's first replay, late "
                         "kernel specialisations) stay out of every mode's figure; short: samples of 1-16 tokens")
    ap.add_argument("--max-num-seqs", type=int, default=0, help="0: auto (chosen from the KV cache)")
    ap.add_argument("--kv-gib", type=float, default=0.0, help="0: size the KV cache from free memory")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--draft-layers", type=int, default=0, help="0: no draft; else a draft of that many layers")
    ap.add_argument("--k", type=int, default=4, help="draft tokens per step (with --draft-layers)")
    ap.add_argument("--tail-scale", type=float, default=1.0,
                    help="with --draft-layers: damp the target's later layers so the draft agrees (spec.py)")
    ap.add_argument("--spec-max-batch", type=int, default=16,
                    help="with --draft-layers: speculate only while at most this many sequences decode (0: always)")
    ap.add_argument("--async-scheduling", choices=["auto", "on", "off"], default="auto",
                    help="overlap each step's host work with the device (auto: the engine's default)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--self-draft", action=argparse.BooleanOptionalAction, default=None,
                    help="with --batch-invariant: the mode's own draft on or off (--k tokens, --spec-max-batch; "
                         "docs/invariance.md); unset: the engine's default (on for CUDA)")
    ap.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
                    help="the batch-invariant mode on or off (docs/invariance.md); unset: the engine's default")
    ap.add_argument("--gc-freeze", choices=["on", "off"], default="on",
                    help="freeze the warm heap before each timed run, as the sidecar's rank does (off: A/B)")
    ap.add_argument("--profile", default="", help="write kernel tables of a few step windows to this folder")
    ap.add_argument("--profile-steps", default="100,1200", help="with --profile: comma list of first steps")
    ap.add_argument("--profile-length", type=int, default=16, help="with --profile: steps per window")
    ap.add_argument("--dry-run", action="store_true", help="print each shape's workload line and stop")
    ap.add_argument("--quantization", default="bf16",
                    help="comma list of bf16 (unquantized: the model dtype) and fp8; both: a rollout_fp8 line too")
    ap.add_argument("--lora-rank", type=int, default=0,
                    help="also run each shape LoRA-served with a random adapter of this rank (0: not)")
    ap.add_argument("--layers", type=int, default=0,
                    help="build a Qwen shape with this many decoder layers (0: the shape's own; not tiny)")
    ap.add_argument("--routing-repeats", type=int, default=1,
                    help="an MoE shape: timed runs without and with routing per mode, alternated (1: A B; 2: A B B A)")
    args = ap.parse_args(argv)
    args.quantization = [q for q in args.quantization.split(",") if q]
    for q in args.quantization:
        if q not in QUANTIZATIONS:
            ap.error(f"--quantization: unknown {q!r} (bf16, fp8)")
    args.shapes = [s for s in args.shapes.split(",") if s]
    args.modes = [m for m in args.modes.split(",") if m]
    args.profile_steps = [int(x) for x in args.profile_steps.split(",") if x]
    for s in args.shapes:
        if s not in SHAPE_NAMES:
            ap.error(f"--shapes: unknown shape {s!r}")
    for m in args.modes:
        if m not in MODES:
            ap.error(f"--modes: unknown mode {m!r}")
    if not 1 <= args.prompt_min <= args.prompt_max:
        ap.error("--prompt-min must be in [1, --prompt-max]")
    if args.layers < 0 or args.routing_repeats < 1:
        ap.error("--layers must be >= 0 and --routing-repeats >= 1")
    if args.layers and "tiny" in args.shapes:
        ap.error("--layers: the tiny shape is the embedded checkpoint, built whole")
    moe = [s for s in args.shapes if s in MOE_SHAPES]
    if moe and (args.draft_layers or args.lora_rank or args.quantization != ["bf16"] or args.profile):
        ap.error(f"--shapes {moe[0]}: an MoE shape runs without --draft-layers, --lora-rank, --profile and "
                 "with --quantization bf16 (its rows time routing against none instead)")
    return args


def main(argv: list[str] | None = None) -> list[dict[str, object]]:
    """Run every shape x mode; print and return one row per case."""
    from inference.parallel import resolve_device

    args = parse_args(argv)
    if args.dry_run:
        lines = [workload_line(shape, args) for shape in args.shapes]
        for line in lines:
            print(json.dumps(line), flush=True)
        return lines
    rates = measure_rates(resolve_device(args.device))
    out: list[dict[str, object]] = []
    for shape in args.shapes:
        if args.lora_rank:  # merged against LoRA-served (unquantized)
            out += lora_against_merged(shape, args, rates)
            continue
        rows: dict[str, list[dict[str, object]]] = {}
        greedy: dict[str, list] = {}
        for q in args.quantization:
            greedy[q] = []
            rows[q] = run_shape(shape, args, rates, q, greedy[q])
            out += rows[q]
        if len(rows) == 2:
            for line in compare_rows(shape, rows, greedy):
                print(json.dumps(line), flush=True)
                out.append(line)
    return out


def lora_against_merged(shape: str, args: argparse.Namespace, rates: tuple[float, float]) -> list[dict[str, object]]:
    """--lora-rank: the shape merged, then LoRA-served, then one comparison line per mode."""
    from inference.models.tiny import default_model_dir

    merged = run_shape(shape, args, rates)
    with tempfile.TemporaryDirectory(prefix="bench-rollout-lora-") as tmp:
        if shape == "tiny":
            model_dir = default_model_dir()
        else:
            from scripts.bench.spec import config_dir

            model_dir = config_dir(shape, shape_layers(shape, args), args.prompt_max + args.len_cap)
        lora = run_shape(shape, replace_ns(args, lora_dir=str(write_adapter(Path(model_dir), args.lora_rank,
                                                                             Path(tmp) / "adapter"))), rates)
    rows = merged + lora
    for m, a in zip(merged, lora, strict=True):
        line = {"bench": "rollout_lora", "shape": shape, "mode": m["mode"], "lora_rank": args.lora_rank,
                "merged_tok_s": m["tok_s"], "lora_tok_s": a["tok_s"],
                "lora_over_merged": round(float(m["tok_s"]) / float(a["tok_s"]), 4), "device": a["device"]}
        print(json.dumps(line), flush=True)
        rows.append(line)
    return rows


def replace_ns(args: argparse.Namespace, **changes: object) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), **changes})


if __name__ == "__main__":
    main()
