"""RL steps against a real `sidecar launch`: the synchronous loop against partial rollouts and syncs in flight,
every mode in one run on one sidecar (docs/dev/benchmark-log.md, "RL step", defines each figure).

This process is the trainer: a WeightSyncHook over a plain-torch policy of the shape (the tiny checkpoint, or
random bf16 Qwen weights on both ends), synced with the audit over ipc (CUDA) or gloo (CPU). A step = the
rollouts of --prompts groups (G) of --samples samples + a train phase (--train-s, default half the sync mode's
first timed rollout, plus noise added in place to --perturb tensors) + a sync. Modes, each in its own pool:
sync (sleep, train, wake, sync; G groups, all waited for); partial_keep / partial_recompute (G x --oversample
in flight, a step takes the first G finished, the rest are held across the sleep and the sync with that
on_sync; the sleep drops the KV, so colocated keep goes on as recompute does); disagg_keep (no sleep: the
sidecar generates through the train phase, the sync lands mid-generation, keep). Each sample generates its
own lognormal draw, as in scripts/bench/rollout.py (`sample_max_tokens`: one max_tokens per sample of a
group; --group-len max gives every sample its group's longest draw instead). One JSON line per mode;
--dry-run: the plan.

    python3 -m scripts.bench.rl_step --shape qwen2-0.5b --steps 4      # CUDA, ipc
    python3 -m scripts.bench.rl_step --shape tiny --steps 3 --prompts 8 --samples 2 --prompt-min 8 \
        --prompt-max 24 --len-median 12 --len-cap 48                   # the CPU smoke (tests/test_bench_rl_step.py)
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a file from a checkout too

from inference.core import SamplingParams
from trainer_hooks.rollout_pool import staleness

MODES = ("sync", "partial_keep", "partial_recompute", "disagg_keep")
ON_SYNC = {"sync": None, "partial_keep": "keep", "partial_recompute": "recompute", "disagg_keep": "keep"}
SHAPE_NAMES = ("tiny", "qwen2-0.5b", "qwen2.5-7b")
_T0 = time.perf_counter()


def progress(what: str) -> None:
    """One stderr line per phase, with the seconds since start: a run cut by its time limit still says where
    its time went (building the policy, the sidecar's start and warm-up, the first sync, each step)."""
    print(f"[rl_step +{time.perf_counter() - _T0:.1f} s] {what}", file=sys.stderr, flush=True)


@dataclass
class Workload:
    """An endless, seeded stream of groups: (prompt ids, length of each of its samples)."""

    args: argparse.Namespace
    vocab: int
    rng: random.Random = field(init=False)
    drawn: int = 0
    lengths: dict[tuple[int, ...], list[int]] = field(default_factory=dict)  # prompt -> its samples' lengths

    def __post_init__(self) -> None:
        self.rng = random.Random(self.args.seed)

    def draw(self) -> tuple[list[int], list[int]]:
        """A prompt and its samples' lengths (each its own draw; all the longest with --group-len max)."""
        a, rng = self.args, self.rng
        mu = math.log(a.len_median)
        lens = [min(a.len_cap, max(1, round(rng.lognormvariate(mu, a.len_sigma)))) for _ in range(a.samples)]
        prompt = [rng.randrange(4, self.vocab) for _ in range(rng.randint(a.prompt_min, a.prompt_max))]
        self.drawn += 1
        if a.group_len == "max":
            lens = [max(lens)] * len(lens)
        self.lengths[tuple(prompt)] = lens
        return prompt, lens

    def groups(self, count: int) -> tuple[list[list[int]], list[SamplingParams]]:
        prompts, params = [], []
        for _ in range(count):
            prompt, lens = self.draw()
            prompts.append(prompt)
            params.append(SamplingParams(n=self.args.samples, temperature=1.0, max_tokens=max(lens), ignore_eos=True,
                                         seed=1000 + self.drawn,
                                         sample_max_tokens=lens if self.args.group_len == "draw" else ()))
        return prompts, params


class FinishPoller:
    """Polls a pool's finished count while a step's rollouts run: when it first reached `need` groups."""

    def __init__(self, url: str, pool: str, need: int, poll_s: float) -> None:
        from trainer_hooks.client import SidecarClient

        self.client, self.pool, self.need, self.poll_s = SidecarClient(url, timeout=60), pool, need, poll_s
        self.reached: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            finished = self.client.rollout_counts(self.pool).get("finished", 0)
            if finished >= self.need:
                self.reached = time.perf_counter()
                return
            self._stop.wait(self.poll_s)

    def stop(self) -> float | None:
        self._stop.set()
        self._thread.join()
        self.client.close()
        return self.reached


def build_policy(shape: str, device: str) -> tuple[torch.nn.Module, str, list[str]]:
    """The trainer's model, the directory the sidecar serves and its extra launch flags: the tiny checkpoint
    itself, or a Qwen shape's config.json with random bf16 weights on both ends (the first sync makes the
    sidecar's the trainer's)."""
    from trainer_hooks.toy_policy import ToyPolicy

    if shape == "tiny":
        from inference.models.tiny import default_model_dir

        model_dir = default_model_dir()
        return ToyPolicy.from_dir(model_dir, device), str(model_dir), []
    from scripts.bench.spec import config_dir

    model_dir = config_dir(shape, _layers(shape), 4096)
    cfg = json.loads((model_dir / "config.json").read_text())
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device), torch.no_grad():
            policy = ToyPolicy(cfg)
            for name, p in policy.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.normal_(std=0.02)
    finally:
        torch.set_default_dtype(torch.float32)
    return policy, str(model_dir), ["--load-format", "dummy", "--dtype", "bfloat16"]


def _layers(shape: str) -> int:
    from scripts.bench.generate import SHAPES

    return int(SHAPES[shape]["num_hidden_layers"])


@torch.no_grad()
def perturb(policy: torch.nn.Module, step: int, count: int, std: float) -> None:
    """The optimizer's footprint on the bytes: noise added in place to `count` tensors, others each step."""
    params = [p for _, p in policy.named_parameters()]
    for i in range(count):
        p = params[(step * count + i) % len(params)]
        p.add_(torch.randn_like(p), alpha=std)


@dataclass
class ModeRun:
    """What one mode's steps measured (timed steps only, except the counts, which cover every step)."""

    mode: str
    submitted: int = 0
    consumed: int = 0
    failed: int = 0
    duplicates: int = 0
    short_samples: int = 0  # samples that generated another length than their own draw
    restarts: int = 0
    carried: int = 0
    tokens: int = 0
    groups: int = 0
    step_s: list[float] = field(default_factory=list)
    rollout_s: list[float] = field(default_factory=list)
    tail_s: list[float] = field(default_factory=list)
    sync_ms: list[float] = field(default_factory=list)
    sleep_ms: list[float] = field(default_factory=list)
    wake_ms: list[float] = field(default_factory=list)
    stale_samples: Counter[int] = field(default_factory=Counter)
    stale_tokens: Counter[int] = field(default_factory=Counter)
    spread: Counter[int] = field(default_factory=Counter)
    seen: set[str] = field(default_factory=set)


class Loop:
    """One sidecar, one hook, one policy; `run(mode)` runs a mode's steps in its own pool."""

    def __init__(self, args: argparse.Namespace, url: str, policy: torch.nn.Module, vocab: int) -> None:
        from trainer_hooks.client import SidecarClient
        from trainer_hooks.hook import WeightSyncHook

        self.args, self.url, self.policy, self.vocab = args, url, policy, vocab
        self.client = SidecarClient(url, timeout=600)
        self.hook = WeightSyncHook(self.client, policy, sleep_level=args.sleep_level, transfer_timeout_s=600)
        self.train_s: float | None = args.train_s
        self.perturbed = 0

    def close(self) -> None:
        self.hook.close()
        self.client.close()

    def run(self, mode: str) -> ModeRun:
        args, hook = self.args, self.hook
        hook.rollout_pool = f"rlstep-{mode}"
        out, work, G = ModeRun(mode), Workload(args, self.vocab), args.prompts
        policy = {"on_sync": ON_SYNC[mode], "max_staleness": args.max_staleness}
        first = G if mode == "sync" else math.ceil(G * args.oversample)
        fresh = first
        if mode == "disagg_keep":
            out.submitted += self._submit(work, fresh, policy)
        for step in range(args.warmup_steps + args.steps):
            timed = step >= args.warmup_steps
            t0 = time.perf_counter()
            poller = FinishPoller(self.url, hook.rollout_pool, max(1, int(0.9 * G)), args.poll_ms / 1e3)
            if mode == "disagg_keep":
                batch = hook.rollouts([], None, min_groups=G, timeout_s=args.take_timeout_s)
            else:
                prompts, params = work.groups(fresh)
                out.submitted += len(prompts)
                batch = hook.rollouts(prompts, params, min_groups=G, timeout_s=args.take_timeout_s,
                                      **{k: v for k, v in policy.items() if v is not None})
            t1 = time.perf_counter()
            at_90 = poller.stop()
            self._note(out, work, batch, timed)
            fresh = len(batch)
            if mode == "disagg_keep":  # the replacements generate while the trainer trains
                out.submitted += self._submit(work, fresh, policy)
            if self.train_s is None and mode == "sync" and timed:
                self.train_s = args.train_frac * (t1 - t0)  # half the synchronous rollout: the default
            self._train(mode, args.train_frac * (t1 - t0) if self.train_s is None else self.train_s)
            t2 = time.perf_counter()
            progress(f"{mode} step {step + 1}/{args.warmup_steps + args.steps}{'' if timed else ' (warm-up)'}: "
                     f"rollouts {t1 - t0:.2f} s, {len(batch)} groups, step {t2 - t0:.2f} s")
            if timed:
                out.step_s.append(t2 - t0)
                out.rollout_s.append(t1 - t0)
                out.tail_s.append(0.0 if at_90 is None else max(0.0, t1 - max(t0, at_90)))
                out.sync_ms.append(hook.stats["sync_ms"])
                if mode != "disagg_keep":
                    out.sleep_ms.append(hook.stats.get("sleep_ms", 0.0))
                    out.wake_ms.append(hook.stats.get("wake_weights_ms", 0.0) + hook.stats.get("wake_kv_ms", 0.0))
        return out

    def _submit(self, work: Workload, count: int, policy: dict[str, Any]) -> int:
        prompts, params = work.groups(count)
        self.client.submit_rollouts(prompts, params, pool=self.hook.rollout_pool,
                                    on_sync=policy["on_sync"], max_staleness=policy["max_staleness"])
        return count

    def _train(self, mode: str, seconds: float) -> None:
        """The train phase: colocated modes sleep the sidecar around it; every mode syncs with the audit after."""
        def optimizer() -> None:
            deadline = time.perf_counter() + seconds
            perturb(self.policy, self.perturbed, self.args.perturb, self.args.noise)
            self.perturbed += 1
            if self.policy_device.type == "cuda":
                torch.cuda.synchronize()
            time.sleep(max(0.0, deadline - time.perf_counter()))

        if mode == "disagg_keep":
            optimizer()
            report = self.hook.sync()
        else:
            with self.hook.training():
                optimizer()
            report = None
        if report is not None and not report.get("ok"):
            raise SystemExit(f"{mode}: the audit failed:\n{report.get('table')}")

    @property
    def policy_device(self) -> torch.device:
        return next(self.policy.parameters()).device

    def _note(self, out: ModeRun, work: Workload, batch: list[Any], timed: bool) -> None:
        ids = [o.request_id for o in batch]
        out.duplicates += len(out.seen & set(ids)) + len(ids) - len(set(ids))
        out.seen.update(ids)
        out.consumed += len(batch)
        out.failed += len(self.hook.stats.get("rollout_failed", {}))
        for o in batch:
            want = work.lengths[tuple(o.prompt_token_ids)]
            out.short_samples += sum(len(c.token_ids) != want[c.index] for c in o.outputs)
            out.short_samples += max(0, self.args.samples - len(o.outputs))
            out.restarts += sum(c.restarts for c in o.outputs)
        if not timed:
            return
        out.groups += len(batch)
        out.carried += self.hook.stats.get("rollout_carried", 0)
        out.tokens += sum(len(c.token_ids) for o in batch for c in o.outputs)
        samples, tokens = staleness(batch, self.hook.version)
        out.stale_samples.update(samples)
        out.stale_tokens.update(tokens)
        # what max_staleness bounds: a sample's newest token's version minus its oldest's
        out.spread.update(max(v for _, v in c.weight_version_spans) - min(v for _, v in c.weight_version_spans)
                          for o in batch for c in o.outputs if c.weight_version_spans)

    def drain(self, mode: str) -> int:
        """Take what a mode left in its pool (untimed), so that the next mode has the engine to itself."""
        self.hook.wake()  # a colocated mode ends asleep after its last sync: its held groups wait for the wake
        counts = self.client.rollout_counts(f"rlstep-{mode}")
        left = int(counts.get("pending", 0)) + int(counts.get("finished", 0))
        if left:
            self.client.take_rollouts(left, None, pool=f"rlstep-{mode}", timeout_s=self.args.take_timeout_s)
        self.client.ack_rollouts(f"rlstep-{mode}")  # the pool leaves the sidecar empty
        return left


def share(counts: Counter[int], most: int) -> float:
    total = sum(counts.values())
    return round(sum(v for k, v in counts.items() if k <= most) / total, 4) if total else 1.0


def row(args: argparse.Namespace, run: ModeRun, left: int, train_s: float, base: float | None) -> dict[str, Any]:
    wall = sum(run.step_s)
    gps = run.groups / wall
    med = (lambda xs: round(statistics.median(xs), 2) if xs else None)
    return {
        "bench": "rl_step", "shape": args.shape, "mode": run.mode, "device": args.device_name,
        "backend": args.backend, "steps": args.steps, "warmup_steps": args.warmup_steps, "prompts": args.prompts,
        "samples": args.samples, "oversample": 1.0 if run.mode == "sync" else args.oversample,
        "on_sync": ON_SYNC[run.mode], "max_staleness": args.max_staleness,
        "submitted": run.submitted, "consumed": run.consumed, "left": left, "failed": run.failed,
        "duplicates": run.duplicates, "short_samples": run.short_samples, "restarts": run.restarts,
        "carried": run.carried, "groups_per_s": round(gps, 4), "tok_s": round(run.tokens / wall, 2),
        "ratio_to_sync": round(gps / base, 4) if base else None,
        "tail_share": round(sum(run.tail_s) / wall, 4), "step_s": round(wall / len(run.step_s), 4),
        "rollout_s": round(statistics.mean(run.rollout_s), 4), "train_s": round(train_s, 4),
        "staleness_tokens": {str(k): v for k, v in sorted(run.stale_tokens.items())},
        "staleness_samples": {str(k): v for k, v in sorted(run.stale_samples.items())},
        "version_spread": {str(k): v for k, v in sorted(run.spread.items())}, "max_spread": max(run.spread, default=0),
        "tokens_within_1": share(run.stale_tokens, 1), "max_staleness_seen": max(run.stale_samples, default=0),
        "sync_audit_ms": med(run.sync_ms), "sleep_ms": med(run.sleep_ms), "wake_ms": med(run.wake_ms),
    }


def launch_argv(args: argparse.Namespace, model_dir: str, extra: list[str]) -> list[str]:
    argv = ["--model", model_dir, "--device", args.device, "--transfer", args.backend, "--seed", "0",
            "--log-level", "warning", "--max-model-len", str(args.prompt_max + args.len_cap), *extra]
    if args.device == "cpu":
        argv += ["--threads", "1", "--kv-cache-bytes", str(args.kv_bytes or 16 << 20)]
    elif args.kv_bytes:
        argv += ["--kv-cache-bytes", str(args.kv_bytes)]
    else:
        argv += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    return argv


def plan(args: argparse.Namespace) -> dict[str, Any]:
    """What --dry-run prints: the loop and the first step's groups per mode (nothing is built or run)."""
    from scripts.bench.rollout import vocab_size

    vocab = vocab_size(args.shape)  # the prompts' draws consume the RNG by the vocabulary: the run's value
    lengths = [p.max_tokens for p in Workload(args, vocab).groups(math.ceil(args.prompts * args.oversample))[1]]
    # first_lengths: each group's longest sample (its time on the engine)
    return {"bench": "rl_step_plan", "shape": args.shape, "device": args.device, "backend": args.backend,
            "modes": args.modes, "steps": args.steps, "warmup_steps": args.warmup_steps, "prompts": args.prompts,
            "samples": args.samples, "oversample": args.oversample, "group_len": args.group_len,
            "first_lengths": lengths, "first_mean_len": round(statistics.mean(lengths), 1),
            "first_longest": max(lengths), "train_s": args.train_s if args.train_s is not None
            else f"{args.train_frac} x the sync mode's first timed rollout",
            "sleep_level": args.sleep_level, "perturb": args.perturb, "max_staleness": args.max_staleness}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen2-0.5b", choices=SHAPE_NAMES)
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma list of {MODES}; sync first gives the ratio")
    ap.add_argument("--device", default=None, choices=("cpu", "cuda"), help="default: cuda unless --shape tiny")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per mode")
    ap.add_argument("--warmup-steps", type=int, default=1, help="untimed steps first (a partial mode's pool fills)")
    ap.add_argument("--prompts", type=int, default=64, help="groups a step consumes (G)")
    ap.add_argument("--samples", type=int, default=8, help="samples per group (n)")
    ap.add_argument("--oversample", type=float, default=1.5, help="partial and disagg modes keep G x this in flight")
    ap.add_argument("--prompt-min", type=int, default=128)
    ap.add_argument("--prompt-max", type=int, default=512)
    ap.add_argument("--len-median", type=float, default=350.0, help="lognormal median of a sample's length")
    ap.add_argument("--len-sigma", type=float, default=0.757)
    ap.add_argument("--len-cap", type=int, default=2048)
    ap.add_argument("--group-len", choices=("draw", "max"), default="draw",
                    help="draw: each sample generates its own draw (as bench rollout); max: every sample of a "
                         "group its longest draw")
    ap.add_argument("--train-s", type=float, default=None, help="the train phase (default: --train-frac x the "
                                                               "sync mode's first timed rollout)")
    ap.add_argument("--train-frac", type=float, default=0.5)
    ap.add_argument("--perturb", type=int, default=4, help="tensors given noise each train phase")
    ap.add_argument("--noise", type=float, default=1e-3, help="std of that noise")
    ap.add_argument("--sleep-level", type=int, default=2, choices=(1, 2), help="colocated modes' sleep")
    ap.add_argument("--max-staleness", type=int, default=None, help="passed with every group (None: unbounded)")
    ap.add_argument("--poll-ms", type=float, default=20.0, help="how often the pool's finished count is read")
    ap.add_argument("--take-timeout-s", type=float, default=600.0)
    ap.add_argument("--kv-bytes", type=int, default=0, help="the sidecar's KV cache (0: 16 MiB cpu, else by "
                                                           "--gpu-memory-utilization)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dry-run", action="store_true", help="print the plan and stop")
    args = ap.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    for m in args.modes:
        if m not in MODES:
            ap.error(f"--modes: unknown mode {m!r}")
    if args.train_s is None and "sync" not in args.modes:
        ap.error("--train-s is needed without the sync mode (it measures the default)")
    if args.oversample < 1 or args.steps < 1 or args.prompts < 1 or not 1 <= args.prompt_min <= args.prompt_max:
        ap.error("--oversample >= 1, --steps >= 1, --prompts >= 1, 1 <= --prompt-min <= --prompt-max")
    args.modes = sorted(args.modes, key=MODES.index)  # sync first: the others' ratio and train time
    args.device = args.device or ("cpu" if args.shape == "tiny" else "cuda")
    args.backend = "ipc" if args.device == "cuda" else "gloo"
    return args


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    from scripts.bench.step_path import Sidecar

    args = parse_args(argv)
    if args.dry_run:
        line = plan(args)
        print(json.dumps(line), flush=True)
        return [line]
    device = args.device if args.device == "cpu" else "cuda:0"
    args.device_name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    progress(f"building the {args.shape} policy on {device}")
    policy, model_dir, extra = build_policy(args.shape, device)
    from scripts.bench.rollout import vocab_size

    vocab = vocab_size(args.shape)
    assert vocab == policy.lm_head.weight.shape[0], "the policy's vocabulary is the shape's"
    progress("starting the sidecar (its engine warms up before it serves)")
    sidecar = Sidecar(launch_argv(args, model_dir, extra))
    progress(f"sidecar serving at {sidecar.url}; the first sync")
    rows: list[dict[str, Any]] = []
    loop = Loop(args, sidecar.url, policy, vocab)
    try:
        loop.hook.sync()  # the trainer's weights in the sidecar (version 1), the transfer group joined
        progress("first sync done")
        base = None
        for mode in args.modes:
            run = loop.run(mode)
            left = loop.drain(mode)
            line = row(args, run, left, loop.train_s or 0.0, base)
            if mode == "sync":
                base = line["groups_per_s"]
            print(json.dumps(line), flush=True)
            rows.append(line)
    finally:
        loop.close()
        sidecar.stop()
    return rows


if __name__ == "__main__":
    main()
