"""Benchmark one weight sync: ours, the raw ceiling, and two peer styles, measured in the same run.

Two processes: this one is the receiver (a real DecoderForCausalLM built with build_model, TP=1,
bf16, behind the engine's WeightUpdater), a spawned child is the trainer (WeightSender holding HF-named
bf16 tensors). Timed on the receiver, after a warm-up, median of --iters:
- sync_ms: start_weight_update + update_weights + a device synchronize, without digests: the new
  weights are in the parameters (update_weights returns after the final ack); the session is then
  aborted, outside the timing (abort_ms), since a sync without digests cannot pass an audit;
- sync_audit_ms: the same with the sender's digests and finish_weight_update's audit (which must pass);
  the receiver digests what it received while the sender digests its copy (it always does, so sync_ms
  includes the receiver's digest of the landed bytes too).
  Measured for each digest rule in the same run: first the one the sender picks for its tensors (the
  device rule "xxh3_64_seg64k", one kernel launch per end, for CUDA tensors; the host rule on CPU), then
  the other (`by_algorithm`); the top-level audit figures are the picked rule's;
- sync_audit_delivered_ms: the picked rule's audited sync with the sender's digests delivered in the sync
  (WeightSender.send(deliver_digests=True), update_weights(digests_follow=True) returns them to finish):
  the engine's side of the client's one-request sync; into an FP8 rank it carries the rank's expected
  installed digests too (check_installed, the default: on receive the trainer quantizes the linears once
  more for them, beside the wire), which the rank checks before going live;
  sync_audit_delivered_unchecked_ms the same with check_installed=False, and installed_section_ms the
  sender's computation of those digests alone (median; it runs on a side thread while the bytes move);
- ceiling_ms: ipc: one device copy of the same bytes; gloo/nccl: a plain bucket-by-bucket broadcast;
- peer_per_param_ms: one CUDA IPC handle per parameter opened every sync (OpenRLHF/TRL style), or
  one broadcast per parameter for gloo/nccl; both load tensor by tensor;
- peer_bucket_ms: one reused 2 GiB bucket (IPC or broadcast), packed and unpacked tensor by tensor,
  without overlap (verl style).
Prints one JSON line per (shape, backend), with the receiver's median per phase (start, update,
finish) of the audited syncs of each rule, and finer timers of them (`LAPS`, as audit_<lap>_ms).
Smoke test: --shape tiny --backend gloo --device cpu.
--quantization bf16,fp8,fp8-send: the receiver also as an FP8 rank (docs/fp8.md: each tensor quantized on
the device as it lands, and the installed FP8 bytes audited beside the received ones), and as an FP8 rank
whose trainer quantizes on send (WeightSender(send_fp8=True): the linears' FP8 values and row scales on the
wire, the sender's quantization inside its send()), one line per quantization with its `wire_bytes`;
the FP8 lines skip the peers (they copy bf16 into the parameters) and give `fp8_over_bf16` (and
`fp8_send_over_fp8`) for the audited sync of the same run.
--profile DIR writes cProfile stats of the audited syncs of the picked rule: DIR/receiver-<shape>.prof
(this process) and DIR/sender-<shape>.prof (the trainer's manifest() and send() calls); read them with
pstats.
--trace DIR writes torch.profiler chrome traces (host and CUDA kernels) of the last 3 audited syncs of the
picked rule: DIR/receiver-<shape>.json and DIR/sender-<shape>.json (each process sees its own kernels).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import itertools
import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

from checksum import ALGORITHM, DEVICE_ALGORITHM, can_hash_on
from inference.config import ModelConfig
from inference.models import build_model
from inference.models.hf_config import model_config_from_hf
from inference.models.naming import expected_hf_tensors
from inference.models.tiny import TinyModelSpec, hf_config
from inference.parallel import TPInfo
from inference.transfer.fp8_payload import payload_specs
from inference.transfer.plan import TensorSpec
from inference.transfer.sender import WeightSender
from inference.weights.updater import WeightUpdater
from scripts.bench.sync_peers import (
    bucket_recv,
    bucket_send,
    ceiling_recv,
    ceiling_send,
    per_param_recv,
    per_param_send,
    reset_peers,
    sync_device,
)

SHAPES = {
    "tiny": dict(family="qwen2", hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                 intermediate_size=384, vocab_size=4096, tie_word_embeddings=True),
    # the 0.5B layout (24 layers, 290 tensors) at tiny sizes: what per-tensor overhead costs
    "layout-0.5b": dict(family="qwen2", hidden_size=64, num_layers=24, num_heads=4, num_kv_heads=2,
                        intermediate_size=128, vocab_size=1024, tie_word_embeddings=True),
    "qwen2-0.5b": dict(family="qwen2", hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2,
                       head_dim=64, intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-7b": dict(family="qwen2", hidden_size=3584, num_layers=28, num_heads=28, num_kv_heads=4,
                       head_dim=128, intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False),
}
# Finer timers of each audited sync, ms (the sender's measured in the trainer, sent with its digests):
# receive: the receiver's transfer (agreement, copy, status step) inside update; held_launch: starting the
# receiver's digest (host time); sender_send: the trainer's whole send() (from before the receiver's
# start: it waits there); sender_digest_launch and
# sender_digest_wait: see _clock_digests; sender_digests_get: finish's wait for the trainer's digests
# (from update's end); held_wait: collecting the receiver's digest in finish; compare: the rest of
# finish (building the manifests, comparing). held_launch runs inside receive when the backend calls
# the sink's landed() before its status step (ipc direct, gloo, nccl).
QUANTIZATIONS = ("bf16", "fp8", "fp8-send")
LAPS = ("receive", "held_launch", "sender_send", "sender_digest_launch", "sender_digest_wait",
        "sender_digests_get", "held_wait", "compare")


def rules(args: argparse.Namespace) -> list[str]:
    """The digest rules to measure, the one the sender picks for its tensors first."""
    picked = DEVICE_ALGORITHM if can_hash_on(torch.device(args.sender_device)) else ALGORITHM
    return [picked, ALGORITHM if picked == DEVICE_ALGORITHM else DEVICE_ALGORITHM]


def model_config(shape: str) -> ModelConfig:
    return model_config_from_hf(hf_config(TinyModelSpec(dtype="bfloat16", **SHAPES[shape])))


def trainer_tensors(config: ModelConfig, device: torch.device) -> dict[str, torch.Tensor]:
    gen_device = device if device.type == "cuda" else "cpu"
    return {name: torch.empty(shape, dtype=torch.bfloat16, device=gen_device).normal_(std=0.02)
            for name, shape in expected_hf_tensors(config).items()}


class BenchReceiver:
    """The worker's weight-update half around one model (no KV cache, no runner, no arenas): the host
    a WeightUpdater reads (inference/weights/state.py WeightHost)."""

    rank_key = "dp0:pp0:tp0"

    def __init__(self, config: ModelConfig, device: torch.device, quantization: str = "none") -> None:
        self.models = {"target": build_model(config, TPInfo(), torch.bfloat16, device, quantization=quantization)}
        self.model_configs = {"target": config}
        self.device, self.tp, self.dp_rank, self.memory = device, TPInfo(), 0, None
        self.weights = WeightUpdater(self)


def setup_device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda":
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        torch.cuda.set_device(device)
    else:  # two processes on the CPU: OpenMP threads spinning in one would starve the other's gloo threads
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    return device


# ---- the trainer (child process) ---------------------------------------------------------------
def trainer(args: argparse.Namespace, to_parent: Any, from_parent: Any, digests_out: Any) -> None:
    device = setup_device(args.sender_device)
    config = model_config(args.shape)
    named = trainer_tensors(config, device)
    sender = WeightSender(args.backend, bucket_bytes=args.bucket_mb << 20, timeout_s=300, device=device,
                          send_fp8=args.quantization == "fp8-send")
    to_parent.put(sender.init_info())
    sender.connect()
    group = sender._group  # the peers below reuse our group's control and data planes
    profiler = cProfile.Profile() if args.profile else None
    rounds = [None] * (args.iters + 1) + [rule for rule in rules(args) for _ in range(args.iters + 1)]
    laps: dict[str, float] = {}
    _clock_digests(sender, laps)
    tracer = _Tracer(args.trace, f"sender-{args.shape}.json")
    version = 0  # versions only grow: each sync sends the next, as the receiver starts it (run)
    for rule in rounds:  # None: a sync without digests
        sender.digest_algorithm = rule
        picked = rule == rules(args)[0]
        version += 1
        with _profiling(profiler if picked else None):
            sender.manifest(named, version)
        to_parent.put("ready")
        laps.clear()
        with _profiling(profiler if picked else None), tracer.window(picked, args.iters + 1):
            t0 = time.perf_counter()
            records = sender.send(named, digest=rule is not None)
            laps["sender_send"] = (time.perf_counter() - t0) * 1e3
        if rule is not None:  # digests in manifest order, and the sender's laps for the report
            digests_out.send({"algorithm": rule, "digests": [r.digest for r in records], "laps": dict(laps)})
    sender.digest_algorithm = rules(args)[0]
    section: dict[str, float] = {}
    _clock(sender._expected, "_section", section, "ms")
    section_ms = []
    for check in (True, False):  # the digests delivered in the sync (the client's one-request path)
        sender.check_installed = check
        for _ in range(args.iters + 1):
            version += 1
            sender.manifest(named, version)
            to_parent.put("ready")
            section.clear()
            sender.send(named, deliver_digests=True)
            section_ms.append(section.get("ms", 0.0))
    digests_out.send({"installed_section_ms": statistics.median(section_ms[1 : args.iters + 1])})
    if profiler is not None:
        profiler.dump_stats(Path(args.profile) / f"sender-{args.shape}.prof")
    for peer in (ceiling_send, per_param_send, bucket_send) if args.quantization == "bf16" else ():
        for _ in range(args.iters + 1):
            group.all_max([0], "barrier")
            peer(args, group, named, device)
    from_parent.get()
    sender.close()


def _clock(obj: Any, attr: str, laps: dict[str, float], key: str, then: Callable[[Any], None] | None = None) -> None:
    """Replace obj.attr (a method) on this instance by one that adds its milliseconds to laps[key];
    `then` sees each result (to clock what it returns)."""
    inner = getattr(obj, attr)

    def timed_call(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            out = inner(*args, **kwargs)
        finally:
            laps[key] = laps.get(key, 0.0) + (time.perf_counter() - t0) * 1e3
        if then is not None:
            then(out)
        return out

    setattr(obj, attr, timed_call)


def _clock_digests(sender: WeightSender, laps: dict[str, float]) -> None:
    """sender_digest_launch: the host time of starting the sender's digest (inside send(), after the
    agreement); sender_digest_wait: collecting it after the status step (the kernel's tail and the
    host combine of the segment digests)."""
    _clock(sender, "_start_digests", laps, "sender_digest_launch",
           then=lambda pending: _clock(pending, "result", laps, "sender_digest_wait"))


@contextlib.contextmanager
def _profiling(profiler: cProfile.Profile | None) -> Any:
    if profiler is None:
        yield
        return
    profiler.enable()
    try:
        yield
    finally:
        profiler.disable()


class _Tracer:
    """torch.profiler over the last `count` audited syncs of the picked rule (`--trace`), one trace file."""

    def __init__(self, directory: str | None, path: str, count: int = 3) -> None:
        self.path, self.count, self.seen = (Path(directory) / path if directory else None), count, 0
        self.prof: Any = None

    @contextlib.contextmanager
    def window(self, active: bool, total: int) -> Any:
        """Trace this sync when it is one of the last `count` of `total` traced candidates."""
        if self.path is None or not active:
            yield
            return
        self.seen += 1
        if self.seen == total - self.count + 1:
            from torch.profiler import ProfilerActivity, profile
            self.prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            self.prof.__enter__()
        yield
        if self.seen == total and self.prof is not None:
            self.prof.__exit__(None, None, None)
            self.prof.export_chrome_trace(str(self.path))
            self.prof = None


# ---- the receiver (this process) ---------------------------------------------------------------
def timed(fn: Callable[[], Any], iters: int, device: torch.device, before: Callable[[], Any]) -> float:
    """Median milliseconds of fn over iters runs, after one warm-up run; `before` runs untimed."""
    times = []
    for i in range(iters + 1):
        before()
        sync_device(device)
        t0 = time.perf_counter()
        fn()
        sync_device(device)
        if i:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = setup_device(args.device)
    # The no-digest iterations are aborted on purpose (their model is "torn"); keep stderr quiet.
    logging.getLogger("inference.weights.updater").setLevel(logging.CRITICAL)
    ctx = mp.get_context("spawn")
    from_child, to_child = ctx.Queue(), ctx.Queue()
    # The sender's digests come over a pipe: a Queue's feeder thread would wait for the trainer's GIL
    # while its main thread goes on to the next sync's manifest.
    digests_in, digests_out = ctx.Pipe(duplex=False)
    child = ctx.Process(target=trainer, args=(args, from_child, to_child, digests_out))
    child.start()
    config = model_config(args.shape)
    fp8 = args.quantization != "bf16"
    receiver = BenchReceiver(config, device, "fp8" if fp8 else "none")
    receiver.weights.init_transfer(from_child.get(timeout=600))
    specs = [TensorSpec(n, "bfloat16", tuple(s)) for n, s in expected_hf_tensors(config).items()]
    total = sum(s.nbytes for s in specs)
    if args.quantization == "fp8-send":  # what the trainer's manifest() names: the FP8 payload
        specs = payload_specs(specs)
    manifest = {"version": 1, "tensors": [s.to_dict() for s in specs]}

    profiler = cProfile.Profile() if args.profile else None
    phases: dict[str, dict[str, list[float]]] = {rule: {"start": [], "update": [], "finish": []}
                                                 for rule in rules(args)}  # ms per audited sync
    laps: dict[str, float] = {}  # this sync's finer timers (see LAPS)
    tracer = _Tracer(args.trace, f"receiver-{args.shape}.json")
    _clock(receiver.weights.receiver, "receive", laps, "receive")
    _clock(receiver.weights._digests, "launch", laps, "held_launch")

    versions = itertools.count(1)  # the trainer counts the same (versions only grow)

    def one_sync(rule: str | None) -> float:
        audit = rule is not None
        v = next(versions)
        from_child.get(timeout=600)  # the trainer is about to wait inside send()
        time.sleep(0.05)
        laps.clear()
        sender_laps: dict[str, float] = {}
        picked = rule == rules(args)[0]
        with _profiling(profiler if picked else None), tracer.window(picked, args.iters + 1):
            t0 = time.perf_counter()
            receiver.weights.start("target", v, {**manifest, "version": v, "algorithm": rule or ALGORITHM})
            t1 = time.perf_counter()
            receiver.weights.update()
            session = receiver.weights._session
            if audit and session is not None and session.held_digests is not None:
                _clock(session.held_digests, "result", laps, "held_wait")
            sync_device(device)
            t2 = time.perf_counter()
            if audit:
                if not digests_in.poll(600):
                    raise TimeoutError("the trainer sent no digests within 600 s")
                sender_digests = digests_in.recv()
                laps["sender_digests_get"] = (time.perf_counter() - t2) * 1e3
                # the sender's lap timers ride beside its digests: taken off before finish, which otherwise
                # sees a body of another form than the client sends and takes the full compare
                sender_laps = sender_digests.pop("laps", {})
                assert receiver.weights.finish(sender_digests, held_manifest=False).report.ok
            else:
                receiver.weights.abort("benchmark iteration without digests")
            sync_device(device)
            t3 = time.perf_counter()
        if rule is not None:
            laps.update(sender_laps)
            laps["compare"] = (t3 - t2) * 1e3 - laps["sender_digests_get"] - laps.get("held_wait", 0.0)
            for phase, dt in zip(("start", "update", "finish"), (t1 - t0, t2 - t1, t3 - t2)):
                phases[rule][phase].append(dt * 1e3)
            for key in LAPS:
                phases[rule].setdefault(key, []).append(laps.get(key, 0.0))
            return (t3 - t0) * 1e3
        aborts.append((t3 - t2) * 1e3)
        return (t2 - t0) * 1e3  # the weights are in place; the abort only ends the benchmark's session

    def delivered_sync(rule: str, checked: bool) -> float:
        v = next(versions)
        from_child.get(timeout=600)
        time.sleep(0.05)
        t0 = time.perf_counter()
        receiver.weights.start("target", v, {**manifest, "version": v, "algorithm": rule})
        digests = receiver.weights.update(digests_follow=True)
        result = receiver.weights.finish(digests, held_manifest=False)
        sync_device(device)
        assert result.report.ok and bool(result.installed_checked) == (fp8 and checked), result.installed_checked
        return (time.perf_counter() - t0) * 1e3

    results: dict[str | None, float] = {}
    aborts: list[float] = []
    for rule in (None, *rules(args)):
        times = [one_sync(rule) for _ in range(args.iters + 1)]
        results[rule] = statistics.median(times[1:])
    delivered, unchecked = (statistics.median([delivered_sync(rules(args)[0], checked)
                                               for _ in range(args.iters + 1)][1:]) for checked in (True, False))
    if not digests_in.poll(600):
        raise TimeoutError("the trainer sent no installed-section timing within 600 s")
    section_ms = digests_in.recv()["installed_section_ms"]
    if profiler is not None:
        profiler.dump_stats(Path(args.profile) / f"receiver-{args.shape}.prof")
    group = receiver.weights.receiver.group  # peers reuse our group, as the trainer does
    params = dict(receiver.models["target"].named_parameters())
    peers = {}
    for name, peer in (("ceiling", ceiling_recv), ("per_param", per_param_recv), ("bucket", bucket_recv)):
        def once(peer: Callable = peer) -> None:
            peer(args, group, config, params, manifest, total, device)
        peers[name] = float("nan") if fp8 else timed(once, args.iters, device,
                                                     before=lambda: group.all_max([0], "barrier"))
    to_child.put("done")
    child.join(timeout=600)
    reset_peers()  # the next shape has its own sizes and its own trainer
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    picked = rules(args)[0]
    by_rule = {rule: {"sync_audit_ms": round(results[rule], 3),
                      **{f"audit_{k}_ms": round(statistics.median(v[1:]), 3) for k, v in phases[rule].items()}}
               for rule in rules(args)}
    return {"bench": "sync", "shape": args.shape, "backend": args.backend, "bytes": total,
            "quantization": args.quantization, "wire_bytes": sum(s.nbytes for s in specs),
            "sync_ms": round(results[None], 3), "algorithm": picked, **by_rule[picked],
            "sync_audit_delivered_ms": round(delivered, 3),
            "sync_audit_delivered_unchecked_ms": round(unchecked, 3), "installed_section_ms": round(section_ms, 3),
            "gbps": round(total / results[None] / 1e6, 2), "ceiling_ms": round(peers["ceiling"], 3),
            "ratio_to_ceiling": round(results[None] / peers["ceiling"], 3),
            "peer_per_param_ms": round(peers["per_param"], 3), "peer_bucket_ms": round(peers["bucket"], 3),
            "speedup_vs_bucket": round(peers["bucket"] / results[None], 2),
            "abort_ms": round(statistics.median(aborts[1:]), 3),
            "by_algorithm": by_rule,
            "device": device_name}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=[*SHAPES, "all"], default="all")
    parser.add_argument("--backend", choices=["ipc", "gloo", "nccl"], default="ipc")
    parser.add_argument("--device", default="cuda", help="the receiver's device (the sender's for ipc/gloo)")
    parser.add_argument("--sender-device", default=None, help="default: --device; nccl needs another GPU")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--bucket-mb", type=int, default=512)
    parser.add_argument("--profile", default=None, metavar="DIR", help="write cProfile stats of both ends here")
    parser.add_argument("--trace", default=None, metavar="DIR", help="write torch.profiler traces of both ends here")
    parser.add_argument("--quantization", default="bf16",
                        help="comma list of bf16, fp8 (the rank quantizes on receive) and fp8-send (the trainer "
                             "quantizes on send)")
    args = parser.parse_args()
    quantizations = [q for q in args.quantization.split(",") if q]
    if any(q not in QUANTIZATIONS for q in quantizations):
        parser.error(f"--quantization: a comma list of {', '.join(QUANTIZATIONS)}")
    for directory in (args.profile, args.trace):
        if directory:
            Path(directory).mkdir(parents=True, exist_ok=True)
    if args.sender_device is None:
        args.sender_device = "cuda:1" if args.backend == "nccl" else args.device
    for shape in SHAPES if args.shape == "all" else [args.shape]:
        if args.shape == "all" and shape in ("tiny", "layout-0.5b"):
            continue
        rows: dict[str, dict[str, Any]] = {}
        for quant in quantizations:
            row = run(argparse.Namespace(**{**vars(args), "shape": shape, "quantization": quant}))
            if quant != "bf16" and "bf16" in rows:
                row["fp8_over_bf16"] = round(row["sync_audit_ms"] / rows["bf16"]["sync_audit_ms"], 3)
            if quant == "fp8-send" and "fp8" in rows:
                row["fp8_send_over_fp8"] = round(row["sync_audit_ms"] / rows["fp8"]["sync_audit_ms"], 3)
            rows[quant] = row
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
