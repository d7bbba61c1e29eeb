"""`sidecar demo`: a real RL loop on the embedded tiny model, end to end, with nothing downloaded.

A sidecar subprocess serves the tiny default model; this process is the trainer: a plain-torch
copy of the same weights (trainer_hooks.toy_policy, independent of the engine) trained with a
GRPO-style REINFORCE on a toy reward: the fraction of completion tokens that are digits. Per step:
sleep the sidecar, one Adam step on the last rollouts (group baseline over n samples per prompt,
logprobs recomputed by the trainer), sync + audit, wake, rollouts at temperature 1.

Backends: gloo on CPU, ipc (one shared GPU) with --device cuda. The sidecar is stopped in every
case (SIGTERM, then kill). The last stdout line is one JSON object with the figures; exit 0 when
every step's audit passed, 1 on a failure, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from inference.core import SamplingParams, SidecarError
from inference.tiny import default_model_dir
from sidecar.client import SidecarClient
from trainer_hooks import WeightSyncHook
from trainer_hooks.toy_policy import ToyPolicy, token_logprobs

PROMPT_LEN = 8
COLUMNS = ("step", "reward", "sync_ms", "audit", "sleep_ms", "wake_ms", "version")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=8, help="training steps (default 8)")
    p.add_argument("--device", choices=("cpu", "cuda", "auto"), default="auto")
    p.add_argument("--sleep-level", type=int, choices=(1, 2), default=1)
    p.add_argument("--batch", type=int, default=8, help="prompts per step (default 8)")
    p.add_argument("--samples", type=int, default=8, help="completions per prompt, the GRPO group (default 8)")
    p.add_argument("--max-tokens", type=int, default=8, help="completion length (default 8)")
    p.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate (default 1e-2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout", type=float, default=180.0, help="seconds to wait for the sidecar")


def run(args: argparse.Namespace) -> int:
    if min(args.steps, args.batch, args.samples, args.max_tokens) < 1 or args.samples < 2:
        print("sidecar demo: error: --steps, --batch, --max-tokens must be >= 1 and --samples >= 2",
              file=sys.stderr)
        return 2
    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device
    device = "cpu" if device == "auto" else device
    torch.manual_seed(args.seed)
    model_dir = default_model_dir()
    proc = SidecarProcess.start(model_dir, device=device, seed=args.seed, timeout=args.start_timeout)
    try:
        with SidecarClient(proc.url, timeout=60.0, long_timeout=300.0) as client:
            return _train(args, client, proc, model_dir, device)
    except SidecarError as e:
        print(f"sidecar demo: error: {e}", file=sys.stderr)
        return 1
    finally:
        proc.stop()


def _train(args: argparse.Namespace, client: SidecarClient, proc: SidecarProcess, model_dir: Path,
           device: str) -> int:
    t_start = time.perf_counter()
    policy = ToyPolicy.from_dir(model_dir, device=device)
    optimizer = torch.optim.Adam(policy.parameters(), lr=args.lr)
    backend = "ipc" if device == "cuda" else "gloo"
    digits = _digit_token_ids(model_dir)
    gen = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(len(digits) + 20, 500, (args.batch, PROMPT_LEN), generator=gen).tolist()
    rows: list[dict[str, Any]] = []
    with WeightSyncHook(client, policy, sender=backend, sleep_level=args.sleep_level, log_path=proc.log_path) as hook:
        batch = _rollouts(hook, prompts, args, step=0)
        rows.append({"step": 0, "reward": _reward(batch, digits), "sync_ms": None, "audit": "-",
                     "sleep_ms": None, "wake_ms": None, "version": 0})
        progress = _progress(args.steps)
        diffs: list[float] = []
        for step in range(1, args.steps + 1):
            hook.stats.clear()
            with hook.training():
                diffs.append(_train_step(policy, optimizer, batch, digits, args, device))
            batch = _rollouts(hook, prompts, args, step)
            s = hook.stats
            row = {"step": step, "reward": _reward(batch, digits), "sync_ms": s.get("sync_ms"),
                   "audit": s.get("audit"), "sleep_ms": s.get("sleep_ms"),
                   "wake_ms": round(s.get("wake_weights_ms", 0.0) + s.get("wake_kv_ms", 0.0), 2),
                   "version": s.get("version")}
            rows.append(row)
            progress(row)
    _print_table(rows)
    ok = all(r["audit"] == "ok" for r in rows[1:])
    synced = [r["sync_ms"] for r in rows[1:]]
    print(f"reward: first {rows[0]['reward']} -> last {rows[-1]['reward']}; audits "
          f"{'all ok' if ok else 'FAILED'}; sidecar and trainer logprobs differ by at most {max(diffs):.2g}")
    print(json.dumps({
        "ok": ok, "device": device, "backend": backend, "sleep_level": args.sleep_level, "steps": args.steps,
        "reward_first": rows[0]["reward"], "reward_last": rows[-1]["reward"],
        "rewards": [r["reward"] for r in rows], "audits": [r["audit"] for r in rows[1:]],
        "versions": [r["version"] for r in rows], "sync_ms_mean": round(sum(synced) / len(synced), 2),
        "logprob_max_abs_diff": max(diffs), "elapsed_s": round(time.perf_counter() - t_start, 2)}))
    return 0 if ok else 1


def _rollouts(hook: WeightSyncHook, prompts: list[list[int]], args: argparse.Namespace, step: int) -> list[Any]:
    params = SamplingParams(n=args.samples, temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True,
                            seed=args.seed * 100_003 + step)
    return hook.rollouts(prompts, params)


def _train_step(policy: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: list[Any], digits: set[int],
                args: argparse.Namespace, device: str) -> float:
    """One GRPO-style step; returns max |sidecar logprob - trainer logprob| (both from the same weights)."""
    seqs, sidecar_logp, rewards = [], [], []
    for out in batch:
        for c in out.outputs:
            seqs.append(list(out.prompt_token_ids) + list(c.token_ids))
            sidecar_logp.append(list(c.logprobs))
            rewards.append(_fraction(c.token_ids, digits))
    r = torch.tensor(rewards, device=device).view(len(batch), args.samples)
    advantage = (r - r.mean(dim=1, keepdim=True)).view(-1)  # the group baseline
    logp = token_logprobs(policy, torch.tensor(seqs, device=device), len(batch[0].prompt_token_ids))
    diff = (logp.detach().cpu() - torch.tensor(sidecar_logp, dtype=torch.float32)).abs().max().item()
    loss = -(advantage[:, None] * logp).mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return round(diff, 6)


def _reward(batch: list[Any], digits: set[int]) -> float:
    values = [_fraction(c.token_ids, digits) for out in batch for c in out.outputs]
    return round(sum(values) / len(values), 4)


def _fraction(token_ids: list[int], digits: set[int]) -> float:
    return sum(t in digits for t in token_ids) / max(1, len(token_ids))


def _digit_token_ids(model_dir: Path) -> set[int]:
    """Ids of the tokens made of ASCII digits only (the reward's targets)."""
    vocab = json.loads((model_dir / "tokenizer.json").read_text())["model"]["vocab"]
    ids = {i for tok, i in vocab.items() if tok and all("0" <= ch <= "9" for ch in tok)}
    assert ids, "the tiny tokenizer has digit tokens"
    return ids


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
    def start(cls, model_dir: Path, *, device: str, seed: int, timeout: float) -> SidecarProcess:
        kv_bytes = 4_000_000 if device == "cpu" else 64 * 2**20
        cmd = [sys.executable, "-m", "sidecar.cli", "launch", "--port", "0", "--device", device,
               "--model", str(model_dir), "--dtype", "float32", "--kv-cache-bytes", str(kv_bytes),
               "--seed", str(seed), "--log-level", "warning"]
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
