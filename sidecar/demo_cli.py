"""`sidecar demo`: a real RL loop, end to end, with nothing downloaded.

A sidecar subprocess serves the model (--model: the embedded tiny model, a Qwen2-0.5B shape with
random weights, or an HF directory; see sidecar.demo_task); this process is the trainer: a
plain-torch copy of the same weights (trainer_hooks.toy_policy, independent of the engine) trained
with a GRPO-style REINFORCE on a reward over token ids (the fraction of completion tokens in a
target set). Per step: sleep the sidecar, one Adam step on the last rollouts (group baseline over n
samples per prompt, logprobs recomputed by the trainer), sync + audit, wake, rollouts at temperature 1.

Backends (--backend auto): gloo on CPU, ipc (one shared GPU) with --device cuda. Both ends use the
checkpoint's dtype. The sidecar is stopped in every case (SIGTERM, then kill). The last stdout line
is one JSON object with the figures (medians for pasting); exit 0 when every step's audit passed,
1 on a failure, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from inference.core import InvalidRequestError, SamplingParams, SidecarError
from sidecar.client import SidecarClient
from sidecar.demo_task import (
    MODELS,
    REWARDS,
    DemoModel,
    TokenReward,
    kv_cache_bytes,
    make_prompts,
    make_reward,
    resolve_model,
)
from trainer_hooks import WeightSyncHook
from trainer_hooks.toy_policy import ToyPolicy, token_logprobs

PROMPT_LEN = 8
COLUMNS = ("step", "reward", "sync_ms", "audit", "sleep_ms", "wake_ms", "version")


@dataclass(frozen=True)
class DemoSetup:
    """Everything resolved from the arguments before the sidecar starts."""

    model: DemoModel
    reward: TokenReward
    device: str
    backend: str
    lr: float


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", metavar="{" + ",".join((*MODELS, "PATH")) + "}",
                   help="tiny (default); qwen2-0.5b: Qwen2-0.5B's shape with random bf16 weights, built once "
                        "into the model cache; or an HF model directory")
    p.add_argument("--steps", type=int, default=8, help="training steps (default 8)")
    p.add_argument("--device", choices=("cpu", "cuda", "auto"), default="auto")
    p.add_argument("--backend", choices=("auto", "gloo", "ipc"), default="auto",
                   help="weight wire (default auto: ipc on cuda, gloo on cpu)")
    p.add_argument("--sleep-level", type=int, choices=(1, 2), default=1)
    p.add_argument("--batch", type=int, default=8, help="prompts per step (default 8)")
    p.add_argument("--samples", type=int, default=8, help="completions per prompt, the GRPO group (default 8)")
    p.add_argument("--max-tokens", type=int, default=8, help="completion length (default 8)")
    p.add_argument("--reward", choices=REWARDS, default="auto",
                   help="digits: fraction of digit tokens (auto on tiny); ids: fraction of ids divisible by 16 "
                        "(auto on every other model; needs no tokenizer)")
    p.add_argument("--lr", type=float, default=None,
                   help="Adam learning rate (default 1e-2 on tiny; 1e-3 on other models, whose wider hidden "
                        "size moves logits more per step)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout", type=float, default=180.0, help="seconds to wait for the sidecar")


def run(args: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    try:
        setup = _setup(args)
    except InvalidRequestError as e:
        print(f"sidecar demo: error: {e}", file=sys.stderr)
        return 2
    torch.manual_seed(args.seed)
    kv_bytes = kv_cache_bytes(setup.model, setup.device, args.batch * args.samples, PROMPT_LEN + args.max_tokens)
    try:
        proc = SidecarProcess.start(setup, kv_bytes=kv_bytes, seed=args.seed, timeout=args.start_timeout)
    except SidecarError as e:
        print(f"sidecar demo: error: {e}", file=sys.stderr)
        return 1
    try:
        with _TimedClient(proc.url, timeout=60.0, long_timeout=300.0) as client:
            return _train(args, setup, client, proc, t_start)
    except SidecarError as e:
        print(f"sidecar demo: error: {e}", file=sys.stderr)
        return 1
    finally:
        proc.stop()


def _setup(args: argparse.Namespace) -> DemoSetup:
    """Validate the arguments and resolve model, reward, device and backend (InvalidRequestError if bad)."""
    if min(args.steps, args.batch, args.samples, args.max_tokens) < 1 or args.samples < 2:
        raise InvalidRequestError("steps", "--steps, --batch, --max-tokens must be >= 1 and --samples >= 2")
    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device
    device = "cpu" if device == "auto" else device
    if device == "cuda" and not torch.cuda.is_available():
        raise InvalidRequestError("device", "--device cuda, but torch sees no CUDA device")
    backend = args.backend if args.backend != "auto" else ("ipc" if device == "cuda" else "gloo")
    if backend == "ipc" and device != "cuda":
        raise InvalidRequestError("backend", "--backend ipc shares GPU memory: it needs --device cuda")
    model = resolve_model(args.model)
    lr = args.lr if args.lr is not None else (1e-2 if model.name == "tiny" else 1e-3)
    return DemoSetup(model, make_reward(args.reward, model), device, backend, lr)


class _TimedClient(SidecarClient):
    """A SidecarClient that adds the sidecar-side audit of each sync to `audit_ms`: finish (every rank
    hashes the bytes it received and compares them with the sender's digests) plus the audit call."""

    audit_ms = 0.0

    def finish_weights(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return self._timed(super().finish_weights, *args, **kwargs)

    def audit(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return self._timed(super().audit, *args, **kwargs)

    def _timed(self, call: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        t0 = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            self.audit_ms += _ms_since(t0)


def _train(args: argparse.Namespace, setup: DemoSetup, client: _TimedClient, proc: SidecarProcess,
           t_start: float) -> int:
    policy = ToyPolicy.from_dir(setup.model.path, device=setup.device)
    optimizer = torch.optim.Adam(policy.parameters(), lr=setup.lr)
    prompts = make_prompts(setup.reward, setup.model, args.batch, PROMPT_LEN, args.seed)
    startup_s = round(time.perf_counter() - t_start, 2)
    rows: list[dict[str, Any]] = []
    diffs: list[float] = []
    with WeightSyncHook(client, policy, sender=setup.backend, sleep_level=args.sleep_level,
                        log_path=proc.log_path) as hook:
        batch = _rollouts(hook, prompts, args, step=0)
        rows.append({"step": 0, "reward": _reward(batch, setup.reward), "sync_ms": None, "audit": "-",
                     "sleep_ms": None, "wake_ms": None, "version": 0, "audit_ms": None})
        progress = _progress(args.steps)
        for step in range(1, args.steps + 1):
            hook.stats.clear()
            client.audit_ms = 0.0
            with hook.training():
                diffs.append(_train_step(policy, optimizer, batch, setup.reward, args.samples, setup.device))
            batch = _rollouts(hook, prompts, args, step)
            rows.append(_row(step, hook.stats, _reward(batch, setup.reward), client.audit_ms))
            progress(rows[-1])
    _print_table(rows)
    ok = all(r["audit"] == "ok" for r in rows[1:])
    print(f"reward: first {rows[0]['reward']} -> last {rows[-1]['reward']}; audits "
          f"{'all ok' if ok else 'FAILED'}; sidecar and trainer logprobs differ by at most {max(diffs):.2g}")
    summary = _summary(args, setup, rows, ok, policy)
    summary.update(logprob_max_abs_diff=max(diffs), startup_s=startup_s,
                   elapsed_s=round(time.perf_counter() - t_start, 2))
    print(json.dumps(summary))
    return 0 if ok else 1


def _row(step: int, stats: dict[str, Any], reward: float, audit_ms: float) -> dict[str, Any]:
    return {"step": step, "reward": reward, "sync_ms": stats.get("sync_ms"), "audit": stats.get("audit"),
            "sleep_ms": stats.get("sleep_ms"),
            "wake_ms": round(stats.get("wake_weights_ms", 0.0) + stats.get("wake_kv_ms", 0.0), 2),
            "version": stats.get("version"), "audit_ms": round(audit_ms, 2)}


def _summary(args: argparse.Namespace, setup: DemoSetup, rows: list[dict[str, Any]], ok: bool,
             policy: torch.nn.Module) -> dict[str, Any]:
    """The final JSON line: the run's settings, rewards, audits and median timings over the steps."""
    steps = rows[1:]

    def median(key: str) -> float:
        return round(statistics.median(r[key] for r in steps), 2)

    return {
        "ok": ok, "model": setup.model.name, "params": sum(p.numel() for p in policy.parameters()),
        "dtype": setup.model.dtype, "device": setup.device, "backend": setup.backend,
        "sleep_level": args.sleep_level, "steps": args.steps, "rollouts_per_step": args.batch * args.samples,
        "max_tokens": args.max_tokens, "lr": setup.lr, "reward_kind": setup.reward.kind,
        "reward_first": rows[0]["reward"], "reward_last": rows[-1]["reward"],
        "rewards": [r["reward"] for r in rows], "audits": [r["audit"] for r in steps],
        "versions": [r["version"] for r in rows], "sync_ms_median": median("sync_ms"),
        "audit_ms_median": median("audit_ms"), "sleep_ms_median": median("sleep_ms"),
        "wake_ms_median": median("wake_ms"),
        "sync_ms_mean": round(sum(r["sync_ms"] for r in steps) / len(steps), 2)}


def _rollouts(hook: WeightSyncHook, prompts: list[list[int]], args: argparse.Namespace, step: int) -> list[Any]:
    params = SamplingParams(n=args.samples, temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True,
                            seed=args.seed * 100_003 + step)
    return hook.rollouts(prompts, params)


def _train_step(policy: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: list[Any], reward: TokenReward,
                samples: int, device: str) -> float:
    """One GRPO-style step; returns max |sidecar logprob - trainer logprob| (both from the same weights)."""
    seqs, sidecar_logp, rewards = [], [], []
    for out in batch:
        for c in out.outputs:
            seqs.append(list(out.prompt_token_ids) + list(c.token_ids))
            sidecar_logp.append(list(c.logprobs))
            rewards.append(reward(c.token_ids))
    r = torch.tensor(rewards, device=device).view(len(batch), samples)
    advantage = (r - r.mean(dim=1, keepdim=True)).view(-1)  # the group baseline
    logp = token_logprobs(policy, torch.tensor(seqs, device=device), len(batch[0].prompt_token_ids))
    diff = (logp.detach().float().cpu() - torch.tensor(sidecar_logp, dtype=torch.float32)).abs().max().item()
    loss = -(advantage[:, None] * logp).mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return round(diff, 6)


def _reward(batch: list[Any], reward: TokenReward) -> float:
    values = [reward(c.token_ids) for out in batch for c in out.outputs]
    return round(sum(values) / len(values), 4)


def _ms_since(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000.0


def _progress(total: int) -> Any:
    """A callable(row) advancing a tqdm bar when tqdm is installed, else printing one line per step."""
    try:
        from tqdm import tqdm
    except ImportError:
        return lambda row: print(" ".join(f"{k}={row[k]}" for k in COLUMNS), flush=True)
    bar = tqdm(total=total, desc="demo", unit="step", file=sys.stderr)

    def advance(row: dict[str, Any]) -> None:
        bar.set_postfix(reward=row["reward"], audit=row["audit"], version=row["version"])
        bar.update(1)
        if row["step"] == total:
            bar.close()

    return advance


def _print_table(rows: list[dict[str, Any]]) -> None:
    cells = [[str(c) for c in COLUMNS]] + [["-" if r[c] is None else str(r[c]) for c in COLUMNS] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    for k, row in enumerate(cells):
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths)))
        if k == 0:
            print("  ".join("-" * w for w in widths))



@dataclass
class SidecarProcess:
    """A `sidecar launch` subprocess on a free port; stderr goes to `log_path` (the hook quotes its tail)."""

    proc: subprocess.Popen
    url: str
    log_path: Path

    @classmethod
    def start(cls, setup: DemoSetup, *, kv_bytes: int, seed: int, timeout: float) -> SidecarProcess:
        cmd = [sys.executable, "-m", "sidecar.cli", "launch", "--port", "0", "--device", setup.device,
               "--model", str(setup.model.path), "--dtype", setup.model.dtype, "--transfer", setup.backend,
               "--kv-cache-bytes", str(kv_bytes), "--seed", str(seed), "--log-level", "warning"]
        root = str(Path(__file__).resolve().parents[1])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        log_path = Path(tempfile.mkstemp(prefix="sidecar-demo-", suffix=".log")[1])
        with open(log_path, "w") as err:
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
        lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=_pump, args=(proc, lines), daemon=True).start()
        deadline = time.monotonic() + timeout
        try:
            while True:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
                if line is None:
                    raise SidecarError(f"the sidecar exited with {proc.wait(10)} before serving:\n"
                                       f"{log_path.read_text(errors='replace')[-4000:]}")
                match = re.search(r"Sidecar serving on (http://\S+)", line)
                if match:
                    return cls(proc, match.group(1), log_path)
        except queue.Empty:
            proc.kill()
            proc.wait(10)
            raise SidecarError(f"the sidecar did not serve within {timeout:.0f} s (log: {log_path})") from None
        except BaseException:
            proc.kill()
            proc.wait(10)
            raise

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM, then SIGKILL if it does not exit in time: never leaves the process behind."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def _pump(proc: subprocess.Popen, lines: queue.Queue[str | None]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.put(line)
    lines.put(None)
