"""The trainer side of `sidecar demo` (sidecar/cli/demo.py starts the sidecar and calls `train`).

A plain-torch copy of the served weights (trainer_hooks.toy_policy, independent of the engine) trained
with a GRPO-style REINFORCE on a reward over token ids. Per step: sleep the sidecar, one Adam step on
the last rollouts (group baseline over n samples per prompt, logprobs recomputed by the trainer), sync
+ audit, wake, rollouts at temperature 1 (with --plot, a picture of the run: sidecar/demo/plot.py).
The hook measures every step's training-inference logprob gap (WeightSyncHook(logprob_gap=True),
trainer_hooks/logprob_gap.py: the one owner of that figure); the table and the summary show it.
Kept apart from the CLI module because it imports torch, httpx and the trainer hooks: `sidecar demo
--help` imports none of them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from inference.core import SamplingParams
from sidecar.client import SidecarClient
from sidecar.demo.task import DemoSetup, TokenReward, make_prompts
from trainer_hooks import WeightSyncHook
from trainer_hooks.toy_policy import ToyPolicy, token_logprobs

PROMPT_LEN = 8
COLUMNS = ("step", "reward", "sync_ms", "audit", "sleep_ms", "wake_ms", "version")
GAP_KEYS = {"gap_max": "logprob_gap_max_abs", "gap_mean_abs": "logprob_gap_mean_abs",
            "gap_ratio": "logprob_gap_ratio_minus_one", "gap_tokens": "logprob_gap_tokens"}


class _TimedClient(SidecarClient):
    """A SidecarClient that adds the audit of each sync to `audit_ms`: the ranks' own time in it, as the
    sync's answer reports it (every rank compares the digests of what it holds, taken as the bytes
    landed, with the sender's, and commits), plus the time of any POST /audit made through it."""

    audit_ms = 0.0

    def sync_weights(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        report = super().sync_weights(*args, **kwargs)
        self.audit_ms += float(report.get("audit_ms", 0.0))
        return report

    def audit(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return self._timed(super().audit, *args, **kwargs)

    def _timed(self, call: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        t0 = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            self.audit_ms += _ms_since(t0)


def train(args: argparse.Namespace, setup: DemoSetup, url: str, log_path: Path, t_start: float) -> int:
    """Train against the sidecar at `url` for args.steps steps; print the table, the closing line and
    the JSON summary. Returns 0 when every step's audit passed, else 1 (SidecarError propagates)."""
    torch.manual_seed(args.seed)
    with _TimedClient(url, timeout=60.0, long_timeout=300.0) as client:
        return _train(args, setup, client, log_path, t_start)


def _train(args: argparse.Namespace, setup: DemoSetup, client: _TimedClient, log_path: Path, t_start: float) -> int:
    policy = ToyPolicy.from_dir(setup.model.path, device=setup.device)
    optimizer = torch.optim.Adam(policy.parameters(), lr=setup.lr)
    prompts = make_prompts(setup.reward, setup.model, args.batch, PROMPT_LEN, args.seed)
    startup_s = round(time.perf_counter() - t_start, 2)
    rows: list[dict[str, Any]] = []
    # the demo's own sidecar serves the checkpoint the policy was loaded from (version 0): step 0's
    # rollouts need no sync, and the hook checks that instead (sync_on_attach=False)
    with WeightSyncHook(client, policy, sender=setup.backend, sleep_level=args.sleep_level,
                        log_path=log_path, logprob_gap=True, sync_on_attach=False) as hook:
        batch = _rollouts(hook, prompts, args, step=0)
        rows.append({"step": 0, "reward": _reward(batch, setup.reward), "sync_ms": None, "audit": "-",
                     "sleep_ms": None, "wake_ms": None, "version": 0, "audit_ms": None, **_gap(hook.stats)})
        progress = _progress(args.steps)
        for step in range(1, args.steps + 1):
            hook.stats.clear()
            client.audit_ms = 0.0
            with hook.training():
                _train_step(policy, optimizer, batch, setup.reward, args.samples, setup.device)
            batch = _rollouts(hook, prompts, args, step)
            rows.append(_row(step, hook.stats, _reward(batch, setup.reward), client.audit_ms))
            progress(rows[-1])
    _print_table(rows, COLUMNS)
    _print_table(rows, ("step", *GAP_KEYS))  # the trainer-vs-rollout logprob gap of each step's rollouts
    ok = all(r["audit"] == "ok" for r in rows[1:])
    worst = max(r["gap_max"] for r in rows)
    print(f"reward: first {rows[0]['reward']} -> last {rows[-1]['reward']}; audits "
          f"{'all ok' if ok else 'FAILED'}; sidecar and trainer logprobs differ by at most {worst:.2g}")
    summary = _summary(args, setup, rows, ok, policy)
    summary.update(startup_s=startup_s, elapsed_s=round(time.perf_counter() - t_start, 2))
    if args.plot is not None:
        summary["plot"] = _plot(rows, args.plot)
    print(json.dumps(summary))
    return 0 if ok else 1


def _row(step: int, stats: dict[str, Any], reward: float, audit_ms: float) -> dict[str, Any]:
    return {"step": step, "reward": reward, "sync_ms": stats.get("sync_ms"), "audit": stats.get("audit"),
            "sleep_ms": stats.get("sleep_ms"),
            "wake_ms": round(stats.get("wake_weights_ms", 0.0) + stats.get("wake_kv_ms", 0.0), 2),
            "version": stats.get("version"), "audit_ms": round(audit_ms, 2), "algorithm": stats.get("algorithm"),
            **_gap(stats)}


def _gap(stats: dict[str, Any]) -> dict[str, Any]:
    """The hook's logprob-gap figures of this step's rollouts, under the demo's short names."""
    return {short: float(f"{stats[key]:.3g}") if isinstance(stats[key], float) else stats[key]
            for short, key in GAP_KEYS.items()}


def _summary(args: argparse.Namespace, setup: DemoSetup, rows: list[dict[str, Any]], ok: bool,
             policy: torch.nn.Module) -> dict[str, Any]:
    """The final JSON line: the run's settings, rewards, audits and median timings over the steps."""
    steps = rows[1:]

    def median(key: str) -> float:
        return round(statistics.median(r[key] for r in steps), 2)

    return {
        "ok": ok, "model": setup.model.name, "params": sum(p.numel() for p in policy.parameters()),
        "dtype": setup.model.dtype, "device": setup.device, "backend": setup.backend,
        "quantization": setup.quantization,
        "sleep_level": args.sleep_level, "steps": args.steps, "rollouts_per_step": args.batch * args.samples,
        "max_tokens": args.max_tokens, "lr": setup.lr, "reward_kind": setup.reward.kind,
        "reward_first": rows[0]["reward"], "reward_last": rows[-1]["reward"],
        "rewards": [r["reward"] for r in rows], "audits": [r["audit"] for r in steps],
        "versions": [r["version"] for r in rows], "sync_ms_median": median("sync_ms"),
        "audit_ms_median": median("audit_ms"), "audit_algorithm": steps[-1].get("algorithm"),
        "sleep_ms_median": median("sleep_ms"),
        "wake_ms_median": median("wake_ms"),
        "sync_ms_mean": round(sum(r["sync_ms"] for r in steps) / len(steps), 2),
        # the trainer-vs-rollout gap of every step's rollouts (step 0 included), hook.stats' logprob_gap_*
        "logprob_max_abs_diff": max(r["gap_max"] for r in rows),
        "logprob_gap": [{k: r[k] for k in GAP_KEYS} for r in rows]}


def _rollouts(hook: WeightSyncHook, prompts: list[list[int]], args: argparse.Namespace, step: int) -> list[Any]:
    params = SamplingParams(n=args.samples, temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True,
                            seed=args.seed * 100_003 + step)
    return hook.rollouts(prompts, params)


def _train_step(policy: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: list[Any], reward: TokenReward,
                samples: int, device: str) -> None:
    """One GRPO-style step on the rollouts (their gap to the trainer is the hook's, see _gap)."""
    seqs, rewards = [], []
    for out in batch:
        for c in out.outputs:
            seqs.append(list(out.prompt_token_ids) + list(c.token_ids))
            rewards.append(reward(c.token_ids))
    r = torch.tensor(rewards, device=device).view(len(batch), samples)
    advantage = (r - r.mean(dim=1, keepdim=True)).view(-1)  # the group baseline
    logp = token_logprobs(policy, torch.tensor(seqs, device=device), len(batch[0].prompt_token_ids))
    loss = -(advantage[:, None] * logp).mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()


def _reward(batch: list[Any], reward: TokenReward) -> float:
    values = [reward(c.token_ids) for out in batch for c in out.outputs]
    return round(sum(values) / len(values), 4)


def _plot(rows: list[dict[str, Any]], path: str) -> str:
    from sidecar.demo.plot import plot_run  # matplotlib (when installed) only when a picture is asked for

    written = plot_run(rows, path)
    if written.suffix == ".svg" and Path(path).suffix != ".svg":
        print(f"sidecar demo: matplotlib is not installed (pip install 'sidecar[plot]'): wrote an SVG, {written}",
              file=sys.stderr)
    return str(written)


def _ms_since(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000.0


def _progress(total: int) -> Any:
    """A callable(row) advancing a progress bar on stderr (tqdm: a dependency of the server extra)."""
    bar = tqdm(total=total, desc="demo", unit="step", file=sys.stderr)

    def advance(row: dict[str, Any]) -> None:
        bar.set_postfix(reward=row["reward"], audit=row["audit"], version=row["version"])
        bar.update(1)
        if row["step"] == total:
            bar.close()

    return advance


def _print_table(rows: list[dict[str, Any]], columns: tuple[str, ...]) -> None:
    cells = [[str(c) for c in columns]] + [["-" if r[c] is None else str(r[c]) for c in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    for k, row in enumerate(cells):
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths)))
        if k == 0:
            print("  ".join("-" * w for w in widths))
