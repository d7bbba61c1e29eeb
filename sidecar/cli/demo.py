"""`sidecar demo`: a real RL loop, end to end, with nothing downloaded.

A sidecar subprocess serves the model (--model: the embedded tiny model, a Qwen2-0.5B shape with
random weights, or an HF directory; see sidecar.demo.task); this process is the trainer
(sidecar/demo/loop.py, imported only when the demo runs: torch and httpx stay out of --help): a
plain-torch copy of the same weights trained with a GRPO-style REINFORCE on a reward over token ids
(the fraction of completion tokens in a target set).

Backends (--backend auto): gloo on CPU, ipc (one shared GPU) with --device cuda. Both ends use the
checkpoint's dtype. The sidecar is stopped in every case (SIGTERM, then kill); its log (a temporary
file) is removed unless the run failed and the log has something to say, in which case its path is
printed. The last stdout line is one JSON object with the figures (medians for pasting); exit 0 when
every step's audit passed, 1 on a failure, 2 on bad arguments. `--plot PATH` also draws the run (reward,
sync, audit, sleep and wake per step; sidecar/demo/plot.py): a PNG with matplotlib (the `plot` extra),
else an SVG written by hand.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from inference.core import InvalidRequestError, SidecarError
from inference.transfer.backends import check_backend, default_backend, gpu_sharing_backends
from sidecar.child_process import stdout_lines
from sidecar.cli.common import check_device
from sidecar.demo.task import MODELS, REWARDS, DemoSetup, kv_cache_bytes, make_reward, resolve_model


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", metavar="{" + ",".join((*MODELS, "PATH")) + "}",
                   help="tiny: the embedded model (random weights: its text is gibberish); qwen2-0.5b: "
                        "Qwen2-0.5B's shape with random bf16 weights, built once into the model cache; or an "
                        "HF model directory")
    p.add_argument("--steps", type=int, default=8, help="training steps")
    p.add_argument("--device", choices=("cpu", "cuda", "auto"), default="auto", help="auto: cuda when available")
    p.add_argument("--backend", choices=("auto", *gpu_sharing_backends()), default="auto",
                   help=f"weight wire (auto: {default_backend('cuda', shared_gpu=True)} on cuda, "
                        f"{default_backend('cpu', shared_gpu=True)} on cpu)")
    p.add_argument("--sleep-level", type=int, choices=(1, 2), default=1,
                   help="1: the sidecar keeps its weights in host memory while asleep; 2: drops them (the "
                        "next sync refills them)")
    p.add_argument("--quantization", choices=("none", "fp8"), default="none",
                   help="the sidecar's linear weights: fp8 rolls out in FP8 while the trainer trains in its dtype "
                        "(the logprob gap below shows the difference; docs/fp8.md)")
    p.add_argument("--batch", type=int, default=8, help="prompts per step")
    p.add_argument("--samples", type=int, default=8, help="completions per prompt, the GRPO group")
    p.add_argument("--max-tokens", type=int, default=8, help="completion length")
    p.add_argument("--reward", choices=REWARDS, default="auto",
                   help="digits: fraction of digit tokens (auto on tiny); ids: fraction of ids divisible by 16 "
                        "(auto on every other model; needs no tokenizer)")
    p.add_argument("--lr", type=float, default=None,
                   help="Adam learning rate (default 1e-2 on tiny; 1e-3 on other models, whose wider hidden "
                        "size moves logits more per step)")
    p.add_argument("--seed", type=int, default=0, help="seeds the prompts, the trainer and the sidecar's sampling")
    p.add_argument("--start-timeout", type=float, default=180.0, help="seconds to wait for the sidecar to serve")
    p.add_argument("--plot", default=None, metavar="PATH",
                   help="also write a picture of the run (reward, sync, audit, sleep and wake per step): PATH.png "
                        "with matplotlib (pip install 'sidecar[plot]'), else an SVG (PATH.svg, no dependency); "
                        "a PATH without extension gets .png appended")


def run(args: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    try:
        _check_counts(args)
        _check_plot_path(args.plot)
        # before anything slow (torch's import, the sidecar's start, its warm-up): what runs, and that the
        # progress bar takes a while to show anything
        print(f"sidecar demo: {args.steps} RL step(s) on the {args.model} model: starting a sidecar (device "
              f"{args.device}) and a trainer that syncs to it; the first step comes in 10-20 s", file=sys.stderr,
              flush=True)
        setup = _setup(args)
    except InvalidRequestError as e:
        print(f"sidecar demo: error: {e}", file=sys.stderr)
        return 2
    from sidecar.demo.loop import PROMPT_LEN, train  # torch, httpx and the hooks: only when the demo runs

    kv_bytes = kv_cache_bytes(setup.model, setup.device, args.batch * args.samples, PROMPT_LEN + args.max_tokens)
    try:
        proc = SidecarProcess.start(setup, kv_bytes=kv_bytes, seed=args.seed, timeout=args.start_timeout)
    except SidecarError as e:
        print(f"sidecar demo: error: {e}", file=sys.stderr)
        return 1
    code = 1
    try:
        code = train(args, setup, proc.url, proc.log_path, t_start)
    except SidecarError as e:
        print(f"sidecar demo: error: {e}", file=sys.stderr)
    finally:
        proc.stop(keep_log=code != 0)
    return code


def _setup(args: argparse.Namespace) -> DemoSetup:
    """Resolve model, reward, device and backend (InvalidRequestError if bad); after _check_counts and
    _check_plot_path (cheap, so a typo fails before torch loads)."""
    device = check_device(args.device)
    backend = args.backend if args.backend != "auto" else default_backend(device, shared_gpu=True)
    if check_backend(backend).cuda and device != "cuda":
        raise InvalidRequestError("backend", f"--backend {backend} moves the weights through GPU memory: it needs "
                                  "--device cuda")
    model = resolve_model(args.model)
    lr = args.lr if args.lr is not None else (1e-2 if model.name == "tiny" else 1e-3)
    return DemoSetup(model, make_reward(args.reward, model), device, backend, lr, args.quantization)


def _check_counts(args: argparse.Namespace) -> None:
    if min(args.steps, args.batch, args.samples, args.max_tokens) < 1 or args.samples < 2:
        raise InvalidRequestError("steps", "--steps, --batch, --max-tokens must be >= 1 and --samples >= 2")


def _check_plot_path(plot: str | None) -> None:
    """--plot: a .png or .svg file in a directory that exists, checked before a minute of training."""
    if plot is None:
        return
    path = Path(plot)
    if path.suffix and path.suffix.lower() not in (".png", ".svg"):
        raise InvalidRequestError("plot", f"--plot {plot}: the picture is a .png or an .svg file (or give no "
                                  "extension: .png is appended)")
    if not path.parent.is_dir():
        raise InvalidRequestError("plot", f"--plot {plot}: the directory {path.parent} does not exist")


@dataclass
class SidecarProcess:
    """A `sidecar launch` subprocess on a free port; stderr goes to `log_path` (the hook quotes its tail),
    a temporary file that `stop` removes unless asked to keep it."""

    proc: subprocess.Popen
    url: str
    log_path: Path

    @classmethod
    def start(cls, setup: DemoSetup, *, kv_bytes: int, seed: int, timeout: float) -> SidecarProcess:
        cmd = [sys.executable, "-m", "sidecar.cli.main", "launch", "--port", "0", "--device", setup.device,
               "--model", str(setup.model.path), "--dtype", setup.model.dtype, "--transfer", setup.backend,
               "--kv-cache-bytes", str(kv_bytes), "--seed", str(seed), "--log-level", "warning",
               "--quantization", setup.quantization]
        root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        fd, name = tempfile.mkstemp(prefix="sidecar-demo-", suffix=".log")
        log_path = Path(name)
        with os.fdopen(fd, "w") as err:
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
        lines = stdout_lines(proc)
        deadline = time.monotonic() + timeout
        try:
            while True:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
                if line is None:
                    tail = log_path.read_text(errors="replace")[-4000:]
                    log_path.unlink(missing_ok=True)  # its tail is in the message
                    raise SidecarError(f"the sidecar exited with {proc.wait(10)} before serving:\n{tail}")
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
            log_path.unlink(missing_ok=True)
            raise

    def stop(self, timeout: float = 60.0, keep_log: bool = False) -> None:
        """SIGTERM, then SIGKILL if it does not exit in time: never leaves the process behind. Then the
        log is removed, unless keep_log and it holds something (its path is then printed on stderr)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        with contextlib.suppress(FileNotFoundError):
            if keep_log and self.log_path.stat().st_size > 0:
                print(f"sidecar demo: the sidecar's log is kept at {self.log_path}", file=sys.stderr)
                return
            self.log_path.unlink()
