"""Time one weight sync of a fleet of replicas against one replica's, and (optionally) their rollouts.

    python scripts/bench/fleet_sync.py [--replicas 3] [--tp 1] [--hidden-size 512] [--layers 4] [--iters 5]
    python scripts/bench/fleet_sync.py --device cuda --backend ipc --shape qwen2-0.5b --replicas 4 \
        --rollout-batch 128 --warmup 1 --iters 3          # the H200 run: four replicas on GPU 0

`sidecar fleet` starts --replicas replicas of a random model: --shape tiny (the default: the tiny family,
written to a temporary directory at --hidden-size and --layers, so that the bytes, not the HTTP calls,
dominate) or qwen2-0.5b (Qwen2-0.5B's exact shape in bf16, the model cache's directory that `sidecar
demo` and scripts/bench/client_sync.py use). This process is the trainer: it holds the checkpoint's tensors on
--device (cuda:0 for ipc, which maps the trainer's memory into every replica, so all replicas share GPU
0: --gpus 0,0,...) and rewrites them in place before each sync (trainer_step). The same processes are measured
twice: as a Fleet of the first replica alone, then as a Fleet of all of them, each after --warmup syncs
(the first joins the group and sends the layout). A fleet sync puts every rank of every replica in ONE
transfer group, so the bytes go out in one broadcast; the acceptance asks for a fleet sync under 1.5x
one replica's on the CPU and at most 2x on the H200 ("target_ratio"). Each timed sync is
Fleet.sync_weights (a /state per replica, start, then update carrying finish beside send, which delivers
the sender's digests to every rank: each update's answer is that replica's per-rank audit).
For comparison it also times the same replicas synced one after the other, each by a SidecarClient
and a sender of its own (what one hook per replica would do: "separate_syncs_ms").

--rollout-batch N (0: off) also times rollouts: N seeded prompts of --rollout-prompt-len random ids,
--rollout-tokens new tokens each (ignore_eos, so every completion has exactly that length), sent
through Fleet.generate (least-outstanding routing) to the fleet, then to ONE replica with the same
total memory, started after the fleet stopped: its KV cache is the --kv-cache-bytes of all replicas
together (or, with --gpu-memory-utilization, its share is their sum). Each after --warmup rollouts of
the same batch; "rollout" reports tok/s of both and their ratio. On CUDA every launch gets
--max-num-seqs (the batch, divided over the replicas) and --max-model-len (prompt plus completion),
which also bound the CUDA-graph ladder each replica captures at startup.

Prints one JSON line: the medians (ms), the ratios to one replica, the model's bytes, the setup and the
rollout figures (with the URLs that served each rollout). --dry-run prints the two launch commands of the
setup ("fleet_sync_launches") and starts nothing. A script, not a test: on a shared machine a timed
assertion would fail for reasons of load; on the CPU the receivers' unpacking and digests compete for the
same cores, so a CPU run overstates what a fleet costs where each replica has its own. Every process it
starts is stopped on exit, on an error and on SIGTERM (and dies with this one: PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

from inference.core import SamplingParams
from inference.models.tiny import TinyModelSpec, write_model_dir
from inference.transfer.sender import WeightSender
from sidecar.demo.task import QWEN2_05B, resolve_model
from trainer_hooks.client import SidecarClient
from trainer_hooks.fleet import Fleet

SHAPES = ("tiny", "qwen2-0.5b")
TARGET_RATIO = {"cpu": 1.5, "cuda": 2.0}  # the acceptance: under 1.5x on the CPU machine, at most 2x on the H200
KV_BYTES = {"cpu": 16 << 20, "cuda": 4 << 30}  # per fleet replica, unless --kv-cache-bytes
FIRST_PROMPT_ID = 4  # ids 0-3 are the tiny tokenizer's special tokens
# `sidecar fleet` dies with this process: a fresh interpreter asks for PR_SET_PDEATHSIG (execve keeps it), then
# execs the command. A preexec_fn would run in a fork of this process, whose threads (torch, CUDA) make that unsafe.
_DIE_WITH = ("import os, sys; from sidecar.child_process import die_with_parent; "
             "die_with_parent(int(sys.argv[1])); os.execv(sys.argv[2], sys.argv[2:])")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=3, help="replicas in the fleet (default: 3)")
    p.add_argument("--tp", default="1", help="tensor-parallel size of each replica, or one per replica (default: 1)")
    p.add_argument("--shape", default="tiny", choices=SHAPES, help="the model (default: tiny)")
    p.add_argument("--hidden-size", type=int, default=512, help="tiny model width (default: 512)")
    p.add_argument("--layers", type=int, default=4, help="tiny model decoder layers (default: 4)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="every replica's and the trainer's")
    p.add_argument("--backend", default="gloo", choices=("gloo", "ipc"), help="transfer backend (ipc: cuda only)")
    p.add_argument("--gpus", default=None, help="`sidecar fleet --gpus` on cuda (default: every rank on GPU 0)")
    p.add_argument("--kv-cache-bytes", type=int, default=None,
                   help="KV bytes of each fleet replica; the one-replica launch gets their sum "
                        "(default: 16 MiB on cpu, 4 GiB on cuda)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="instead of --kv-cache-bytes: each fleet replica's share of the GPU; the one-replica "
                        "launch gets their sum. A replica counts every process's memory on the GPU as used, "
                        "so replicas that start together may race for it (prefer --kv-cache-bytes)")
    p.add_argument("--iters", type=int, default=5, help="timed syncs per configuration (default: 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed syncs (and rollouts) before each timing (default: 1)")
    p.add_argument("--rollout-batch", type=int, default=0, help="prompts of the rollout comparison (0: none)")
    p.add_argument("--rollout-prompt-len", type=int, default=128, help="tokens per rollout prompt (default: 128)")
    p.add_argument("--rollout-tokens", type=int, default=128, help="new tokens per rollout prompt (default: 128)")
    p.add_argument("--timeout-s", type=float, default=300.0, help="startup and transfer timeout (default: 300)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the two `sidecar fleet` commands this setup launches (model dir <model>) and stop")
    args = p.parse_args(argv)
    if args.backend == "ipc" and args.device != "cuda":
        p.error("--backend ipc needs --device cuda (the replicas map the trainer's GPU memory)")
    if args.replicas < 1 or args.iters < 1 or args.warmup < 1 or args.rollout_batch < 0:
        p.error("--replicas, --iters and --warmup must be >= 1, --rollout-batch >= 0")
    if args.gpu_memory_utilization is not None and not 0 < args.gpu_memory_utilization * args.replicas <= 1:
        p.error(f"--gpu-memory-utilization x {args.replicas} replicas must be in (0, 1]")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        print(json.dumps({"bench": "fleet_sync_launches", "fleet": launch_command(args, Path("<model>"), one=False),
                          "one_replica": launch_command(args, Path("<model>"), one=True)}), flush=True)
        return 0
    old = signal.signal(signal.SIGTERM, _exit_on_sigterm)  # so that every `finally` stops what it started
    try:
        if args.device == "cuda":
            torch.cuda.set_device(0)
        device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
        with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
            model_dir, vocab = model_for(args, Path(tmp))
            row = run(args, model_dir, trainer_weights(model_dir, device), vocab)
    finally:
        signal.signal(signal.SIGTERM, old)
    print(json.dumps(row), flush=True)
    return 0


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def model_for(args: argparse.Namespace, tmp: Path) -> tuple[Path, int]:
    """The model directory the replicas serve and its vocabulary size."""
    if args.shape == "qwen2-0.5b":
        return resolve_model("qwen2-0.5b").path, QWEN2_05B.resolved_vocab_size
    spec = TinyModelSpec(seed=1, hidden_size=args.hidden_size, num_layers=args.layers,
                         intermediate_size=args.hidden_size * 11 // 4, num_heads=8, num_kv_heads=4)
    return write_model_dir(spec, tmp / "model"), spec.resolved_vocab_size


def trainer_weights(model_dir: Path, device: torch.device) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors, contiguous on `device` (ipc's direct mode needs them on the sender's GPU)."""
    from safetensors.torch import load_file

    return {k: v.to(device).contiguous() for k, v in load_file(str(model_dir / "model.safetensors")).items()}


def trainer_step(weights: dict[str, torch.Tensor]) -> None:
    """New bytes in the SAME storages, as an optimizer step writes them: each tensor rolled by one along
    dim 0 (on the device, at once). A trainer's parameters keep their storages, so ipc opens its handles
    once per group; two alternating sets of tensors would reopen every handle at every sync."""
    with torch.no_grad():
        for t in weights.values():
            t.copy_(torch.roll(t, 1, 0))
    if next(iter(weights.values())).is_cuda:
        torch.cuda.synchronize()


def run(args: argparse.Namespace, model_dir: Path, weights: dict[str, torch.Tensor], vocab: int) -> dict[str, Any]:
    """Syncs (and rollouts) of the fleet, then the one-replica rollouts; the JSON row."""
    device = next(iter(weights.values())).device
    make = functools.partial(WeightSender, args.backend, timeout_s=args.timeout_s, device=device)
    with fleet_process(args, model_dir) as urls:
        one_ms, fleet_ms, apart_ms = measure_syncs(urls, make, weights, args)
        fleet_rollout = time_rollout(urls, args, vocab) if args.rollout_batch else None
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    row: dict[str, Any] = {
        "bench": "fleet_sync", "backend": args.backend, "device": args.device, "replicas": args.replicas,
        "tp": args.tp, "shape": args.shape, "model_bytes": nbytes, "iters": args.iters, "warmup": args.warmup,
        "one_replica_ms": one_ms, "fleet_ms": fleet_ms, "ratio": round(fleet_ms["median"] / one_ms["median"], 3),
        "target_ratio": TARGET_RATIO[args.device], "separate_syncs_ms": apart_ms,
        "separate_ratio": round(apart_ms["median"] / one_ms["median"], 3),
        "replica_memory": memory(args, one=False), "one_replica_memory": memory(args, one=True),
    }
    if fleet_rollout is not None:
        with fleet_process(args, model_dir, one=True) as one_url:  # the fleet is stopped: its memory is free
            alone = time_rollout(one_url, args, vocab)
        row["rollout"] = {"batch": args.rollout_batch, "prompt_tokens": args.rollout_prompt_len,
                          "new_tokens": args.rollout_tokens, "fleet": fleet_rollout, "one_replica": alone,
                          "ratio": round(fleet_rollout["tok_s"] / alone["tok_s"], 3)}
    return row


def measure_syncs(urls: list[str], make: Callable[..., WeightSender], weights: dict[str, torch.Tensor],
                  args: argparse.Namespace) -> tuple[dict[str, float], ...]:
    """The sync timings of: a Fleet of replica 0 alone, a Fleet of every replica (one group), and every
    replica synced in turn by a SidecarClient and a sender of its own (one group each, as one
    WeightSyncHook per replica would do). Each owner is closed before the next one joins its group; the
    versions only grow."""
    rounds = args.warmup + args.iters
    with Fleet(urls[:1], timeout=args.timeout_s) as fleet:
        one = time_syncs([fleet_sync(fleet, make, weights)], weights, args, first_version=1)
    with Fleet(urls, timeout=args.timeout_s) as fleet:
        every = time_syncs([fleet_sync(fleet, make, weights)], weights, args, first_version=1 + rounds)
    with ExitStack() as stack:
        syncs = []
        for url in urls:
            client = stack.enter_context(SidecarClient(url, timeout=args.timeout_s))  # its own group, any dp rank
            sender = make(num_receivers=len(client.state()["ranks"]))
            stack.callback(sender.close)
            syncs.append(client_sync(client, sender, weights))
        apart = time_syncs(syncs, weights, args, first_version=1 + 2 * rounds)
    return one, every, apart


def fleet_sync(fleet: Fleet, make: Callable[..., WeightSender],
               weights: dict[str, torch.Tensor]) -> Callable[[int], None]:
    def sync(version: int) -> None:
        report = fleet.sync_weights(lambda n: make(num_receivers=n), weights, version)
        if not report["ok"] or report["out_of_rotation"]:
            raise SystemExit(f"fleet sync {version} failed: {report['summary']}\n{report['table']}")
    return sync


def client_sync(client: SidecarClient, sender: WeightSender,
                weights: dict[str, torch.Tensor]) -> Callable[[int], None]:
    def sync(version: int) -> None:
        audit = client.sync_weights(sender, weights, version)
        if not audit.get("ok"):
            raise SystemExit(f"sync {version} of {client.url} failed:\n{audit.get('table')}")
    return sync


def time_syncs(syncs: list[Callable[[int], None]], weights: dict[str, torch.Tensor], args: argparse.Namespace,
               first_version: int) -> dict[str, float]:
    """Median and min (ms) of --iters rounds after --warmup rounds (the first joins the group and sends
    the layout); a round is an untimed trainer_step, then every sync in turn."""
    times = []
    for k in range(args.warmup + args.iters):
        trainer_step(weights)
        t0 = time.perf_counter()
        for sync in syncs:
            sync(first_version + k)
        if k >= args.warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return {"median": round(statistics.median(times), 2), "min": round(min(times), 2)}


def rollout_requests(args: argparse.Namespace, vocab: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """--rollout-batch prompts of random ids (a fixed seed) and their sampling: temperature 1, one seed per
    prompt, exactly --rollout-tokens new tokens (ignore_eos), so both launches do the same work."""
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(FIRST_PROMPT_ID, vocab, (args.rollout_batch, args.rollout_prompt_len), generator=gen)
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=args.rollout_tokens, ignore_eos=True)
              for i in range(args.rollout_batch)]
    return prompts.tolist(), params


def time_rollout(urls: list[str], args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    """One Fleet.generate of the whole batch over `urls`, after --warmup of the same: tok/s (new tokens
    over the call's wall time), and how many prompts each replica served."""
    prompts, params = rollout_requests(args, vocab)
    with Fleet(urls, timeout=args.timeout_s) as fleet:
        for _ in range(args.warmup):
            fleet.generate(prompts, params)
        t0 = time.perf_counter()
        outs = fleet.generate(prompts, params)
        wall = time.perf_counter() - t0
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    if tokens != args.rollout_batch * args.rollout_tokens:
        raise SystemExit(f"the rollout generated {tokens} tokens, not {args.rollout_batch} x {args.rollout_tokens}")
    served = Counter(int(o.metrics["replica"]) for o in outs)
    return {"tok_s": round(tokens / wall, 1), "wall_s": round(wall, 3), "generated_tokens": tokens,
            "prompts_per_replica": [served[i] for i in range(len(urls))], "urls": urls}


def memory(args: argparse.Namespace, one: bool) -> dict[str, float]:
    """The memory flag of a fleet replica (one share), or of the one-replica comparison (every share)."""
    shares = args.replicas if one else 1
    if args.gpu_memory_utilization is not None:
        return {"gpu-memory-utilization": round(args.gpu_memory_utilization * shares, 4)}
    return {"kv-cache-bytes": shares * (args.kv_cache_bytes or KV_BYTES[args.device])}


def launch_command(args: argparse.Namespace, model_dir: Path, one: bool) -> list[str]:
    """`sidecar fleet` of the --replicas, or (`one`) of replica 0 alone with every replica's memory, on
    free ports. On cuda the GPUs are --gpus, else every rank on GPU 0 (ipc reads the trainer's cuda:0)."""
    sizes = [int(x) for x in args.tp.split(",")]
    sizes = sizes * args.replicas if len(sizes) == 1 else sizes
    gpus = args.gpus.split(",") if args.gpus else ["0"] * sum(sizes)
    if one:
        sizes, gpus = sizes[:1], gpus[:sizes[0]]
    cmd = [sys.executable, "-m", "sidecar.cli.main", "fleet", "--replicas", str(len(sizes)),
           "--tp", ",".join(map(str, sizes)), "--port", "0", "--device", args.device,
           "--startup-timeout-s", str(args.timeout_s)]
    if args.device == "cuda":
        cmd += ["--gpus", ",".join(gpus)]
    cmd += ["--", "--model", str(model_dir), "--log-level", "warning"]
    for flag, value in memory(args, one).items():
        cmd += [f"--{flag}", str(value)]
    if args.device == "cuda" or args.rollout_batch:
        # what the rollout needs and no more, which also bounds the CUDA graphs captured at startup
        cmd += ["--max-num-seqs", str(max(1, math.ceil(args.rollout_batch / len(sizes)))),
                "--max-model-len", str(args.rollout_prompt_len + args.rollout_tokens)]
    return cmd


@contextmanager
def fleet_process(args: argparse.Namespace, model_dir: Path, one: bool = False) -> Iterator[list[str]]:
    """`sidecar fleet` (launch_command); its URLs. On exit, even on an error: SIGTERM (it stops every
    replica, SIGKILL after its own 60 s), then SIGKILL if it is still there after 90 s."""
    proc = subprocess.Popen([sys.executable, "-c", _DIE_WITH, str(os.getpid()), *launch_command(args, model_dir, one)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            match = re.match(r"Sidecar fleet serving on (.+)", line)
            if match:
                yield match.group(1).split()
                break
        else:
            raise SystemExit(f"sidecar fleet exited with {proc.wait()} before serving")
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


if __name__ == "__main__":
    sys.exit(main())
