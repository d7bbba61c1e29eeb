"""Fault and load: one `sidecar launch` of the tiny model on CPU, hammered for --seconds.

All on loopback (the sidecar binds 127.0.0.1, the gloo stores too), bounded in time (--seconds, then
every loop stops and the sidecar is stopped) and in count (--max-requests over all clients). At once:
- --clients asyncio clients (httpx) generating short completions with wait=true, back to back;
- an abuser sending oversized bodies, over-long prompts, malformed JSON, bad field values, lone
  surrogates and too many sequences, each of which must get its documented 4xx naming its field;
- a trainer thread that every --sync-every seconds runs the next step of a cycle: a sync (WeightSender
  over gloo + SidecarClient.sync_weights, audited), sleep 1 + wake, a sync, a sender process SIGKILLed
  mid-send (its update must answer 502) healed by a new sender's sync, sleep 2 + wake + sync.
The sidecar runs with --hold-while-asleep, so clients wait through sleeps as an RL rollout would.

Prints one JSON line: requests served, expected and unexpected errors by class, p50/p99 latency of the
served requests, syncs audited ok, kills healed, sleep cycles, and launcher/rank RSS at start, after
warm-up (a quarter of the run) and at the end. Exit status 1 if any error was unexpected.
Run: python scripts/tools/fault_load.py --seconds 300
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

MIB = 1 << 20
LIMITS = {"max_body_mb": 1, "max_prompt_chars": 20_000, "max_request_sequences": 16}
# Each abuse and the statuses it may get (all name their field; see sidecar/server_common.error_response).
ABUSES: dict[str, tuple[int, ...]] = {
    "oversized_body": (413,), "long_prompt": (400,), "malformed_json": (400,), "bad_value": (400, 422),
    "lone_surrogate": (400,), "too_many_sequences": (400, 429)}


@dataclass(frozen=True)
class LoadConfig:
    seconds: float
    clients: int
    sync_every: float
    max_requests: int
    kv_cache_bytes: int
    max_tokens: int


@dataclass
class Tally:
    """What every loop reports into; one lock, since the trainer and sampler threads write too."""

    served: int = 0
    sent: int = 0
    latencies_ms: list[float] = field(default_factory=list)
    expected: Counter = field(default_factory=Counter)
    unexpected: Counter = field(default_factory=Counter)
    events: Counter = field(default_factory=Counter)
    rss: list[tuple[float, int, int]] = field(default_factory=list)  # (t, launcher bytes, ranks bytes)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, counter: str, key: str) -> None:
        with self.lock:
            getattr(self, counter)[key] += 1


# ---- the sidecar and its memory ---------------------------------------------------------------------


def launch(cfg: LoadConfig) -> tuple[subprocess.Popen, str]:
    """`sidecar launch` on 127.0.0.1, port 0; returns once it prints its 'serving on' line."""
    cmd = [sys.executable, "-m", "sidecar.cli.main", "launch", "--host", "127.0.0.1", "--port", "0", "--device", "cpu",
           "--kv-cache-bytes", str(cfg.kv_cache_bytes), "--log-level", "warning", "--hold-while-asleep",
           "--max-model-len", "256", *(f"--{k.replace('_', '-')}={v}" for k, v in LIMITS.items())]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2])
    assert proc.stdout is not None
    for line in proc.stdout:
        match = re.search(r"Sidecar serving on (http://\S+)", line)
        if match:
            threading.Thread(target=proc.stdout.read, daemon=True).start()  # drain, never block the sidecar
            return proc, match.group(1)
    raise RuntimeError(f"sidecar exited with {proc.wait()} before serving")


def rss_bytes(pid: int) -> int:
    try:
        import psutil

        return int(psutil.Process(pid).memory_info().rss)
    except ImportError:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0


def children(pid: int) -> list[int]:
    """The launcher's child processes (its ranks; multiprocessing's resource tracker is tiny)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    return found


def sample_rss(pid: int, tally: Tally, t0: float) -> None:
    ranks = sum(rss_bytes(p) for p in children(pid))
    with tally.lock:
        tally.rss.append((time.monotonic() - t0, rss_bytes(pid), ranks))


# ---- clients and the abuser -------------------------------------------------------------------------


async def client_loop(http: Any, tally: Tally, cfg: LoadConfig, i: int, deadline: float) -> None:
    import httpx

    n = 0
    while time.monotonic() < deadline:
        with tally.lock:
            if tally.sent >= cfg.max_requests:
                return
            tally.sent += 1
        n += 1
        body = {"prompts": [f"client {i} asks question {n}"],
                "sampling_params": {"temperature": 0.0 if n % 2 else 0.8, "max_tokens": cfg.max_tokens}}
        t = time.perf_counter()
        try:
            resp = await http.post("/generate", json=body)
        except httpx.HTTPError as e:
            tally.add("unexpected", f"generate {type(e).__name__}")
            continue
        if resp.status_code == 200:
            with tally.lock:
                tally.served += 1
                tally.latencies_ms.append((time.perf_counter() - t) * 1000)
        else:
            tally.add("unexpected", f"generate {resp.status_code} {_error(resp).get('type')}")


def _error(resp: Any) -> dict[str, Any]:
    try:
        return dict(resp.json().get("error") or {})
    except (ValueError, AttributeError):
        return {}


def abuse_body(kind: str) -> tuple[bytes, dict[str, str]]:
    """One hostile request body of this kind (JSON content type unless the kind is about JSON itself)."""
    sampling = {"max_tokens": 2}
    bodies: dict[str, Any] = {
        "oversized_body": {"prompts": ["x" * (LIMITS["max_body_mb"] * MIB + 1)]},
        "long_prompt": {"prompts": ["y" * (LIMITS["max_prompt_chars"] + 1)], "sampling_params": sampling},
        "bad_value": {"prompts": ["ok"], "sampling_params": {"temperature": -1.0, "max_tokens": 2}},
        "too_many_sequences": {"prompts": ["ok"], "sampling_params": {"n": LIMITS["max_request_sequences"] + 1}},
    }
    headers = {"content-type": "application/json"}
    if kind == "malformed_json":
        return b'{"prompts": ["unterminated', headers
    if kind == "lone_surrogate":
        return b'{"prompts": ["\\ud800 alone"], "sampling_params": {"max_tokens": 2}}', headers
    return json.dumps(bodies[kind]).encode(), headers


async def abuse_loop(http: Any, tally: Tally, deadline: float, every_s: float = 0.25) -> None:
    import httpx

    kinds = list(ABUSES)
    n = 0
    while time.monotonic() < deadline:
        kind = kinds[n % len(kinds)]
        n += 1
        content, headers = abuse_body(kind)
        try:
            resp = await http.post("/generate", content=content, headers=headers)
        except (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError) as e:
            # A body over the limit is refused before it is read: the server answers 413 and closes the
            # connection, and a client still uploading may see the close instead of the answer.
            early_close = kind == "oversized_body"
            tally.add("expected" if early_close else "unexpected", f"abuse {kind} {type(e).__name__}")
            continue
        except httpx.HTTPError as e:
            tally.add("unexpected", f"abuse {kind} {type(e).__name__}")
            continue
        named = bool(_error(resp).get("field"))
        ok = resp.status_code in ABUSES[kind] and named
        tally.add("expected" if ok else "unexpected", f"abuse {kind} {resp.status_code}{'' if named else ' no field'}")
        await asyncio.sleep(every_s)


async def drive_http(url: str, tally: Tally, cfg: LoadConfig, deadline: float) -> None:
    import httpx

    limits = httpx.Limits(max_connections=cfg.clients + 8, max_keepalive_connections=cfg.clients + 8)
    async with httpx.AsyncClient(base_url=url, timeout=180, limits=limits) as http:
        loops = [client_loop(http, tally, cfg, i, deadline) for i in range(cfg.clients)]
        await asyncio.gather(*loops, abuse_loop(http, tally, deadline))


# ---- the trainer: syncs, a sender killed mid-send, sleep/wake ---------------------------------------


def dying_sender(out: Any, version: int, bucket_bytes: int, timeout_s: float) -> None:
    """Spawned: join the sidecar as a sender, send other weights, and stall after two bucket messages
    until the parent SIGKILLs this process."""
    from inference.models.tiny import TinyModelSpec, random_weights
    from inference.transfer.sender import WeightSender

    sender = WeightSender("gloo", bucket_bytes=bucket_bytes, timeout_s=timeout_s)
    out.put(sender.init_info())
    sender.connect()
    named = random_weights(TinyModelSpec(seed=99))
    out.put(sender.manifest(named, version))
    group, calls = sender._group, [0]
    real = group.exchange

    def exchange(*args: Any, **kwargs: Any) -> Any:  # gloo's buckets go point to point (backends/chain.py)
        calls[0] += 1
        if calls[0] == 3:
            out.put("mid-send")
            time.sleep(600)
        return real(*args, **kwargs)

    group.exchange = exchange
    sender.send(named, deliver_digests=True)


class Trainer:
    """The control loop's state: one client, the live sender, the next version, two weight sets."""

    def __init__(self, url: str, tally: Tally) -> None:
        from inference.models.tiny import DEFAULT_TINY, TinyModelSpec, random_weights
        from sidecar.client import SidecarClient

        self.client = SidecarClient(url, timeout=180)
        self.tally, self.sender, self.version = tally, None, 0
        self.weights = [random_weights(DEFAULT_TINY), random_weights(TinyModelSpec(seed=1))]

    def sync(self) -> None:
        from inference.transfer.sender import WeightSender

        if self.sender is None:
            self.sender = WeightSender("gloo", num_receivers=1, timeout_s=60)
            self.client.connect_sender(self.sender)
        self.version += 1
        result = self.client.sync_weights(self.sender, self.weights[self.version % 2], version=self.version)
        self.tally.add("events", "syncs_audited_ok" if result["ok"] else "syncs_audit_failed")
        if not result["ok"]:
            self.tally.add("unexpected", "sync audit mismatch")

    def sleep_wake(self, level: int) -> None:
        self.client.sleep(level=level)
        self.client.wake_up()
        self.tally.add("events", f"sleep_wake_level{level}")
        if level == 2:
            self.sync()  # level 2 dropped the weights: the next sync refills them

    def kill_mid_send(self) -> None:
        from sidecar.client import SidecarTransferError

        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        self.version += 1
        proc = ctx.Process(target=dying_sender, args=(out, self.version, 256 * 1024, 10.0), daemon=True)
        proc.start()
        try:
            self.client.init_weights(out.get(timeout=120))
            update = self.client.weights.update({"model": "target", "version": self.version,
                                                 "manifest": out.get(timeout=120)})
            killer = threading.Thread(target=lambda: out.get(timeout=120) and os.kill(proc.pid, signal.SIGKILL))
            killer.start()
            try:
                update.result()
                self.tally.add("unexpected", "update after a killed sender did not fail")
            except SidecarTransferError as e:
                self.tally.add("expected" if e.status == 502 else "unexpected", f"killed sender update {e.status}")
            killer.join(60)
        finally:
            proc.kill()
            proc.join(30)
        if self.sender is not None:
            self.sender.close()
            self.sender = None  # the sidecar's group is the dead one's now: join a new sender
        self.tally.add("events", "senders_killed_mid_send")
        self.sync()
        self.tally.add("events", "kills_healed")

    def run(self, deadline: float, every_s: float) -> None:
        steps = [self.sync, lambda: self.sleep_wake(1), self.sync, self.kill_mid_send, lambda: self.sleep_wake(2)]
        n = 0
        try:
            while time.monotonic() + every_s < deadline:
                time.sleep(every_s)
                try:
                    steps[n % len(steps)]()
                except Exception as e:  # counted, never swallowed silently: it fails the run
                    self.tally.add("unexpected", f"trainer {type(e).__name__}: {str(e)[:120]}")
                n += 1
        finally:
            if self.sender is not None:
                self.sender.close()
            self.client.close()


# ---- main -------------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1)


def report(tally: Tally, cfg: LoadConfig, wall_s: float, exit_code: int | None) -> dict[str, Any]:
    def mb(i: int, k: int) -> float:
        return round(tally.rss[i][k] / MIB, 1)

    warm = min(range(len(tally.rss)), key=lambda i: abs(tally.rss[i][0] - wall_s / 4))
    return {
        "bench": "fault_load", "seconds": round(wall_s, 1), "clients": cfg.clients,
        "requests_served": tally.served, "requests_per_s": round(tally.served / max(wall_s, 1e-9), 1),
        "latency_ms": {"p50": percentile(tally.latencies_ms, 0.5), "p99": percentile(tally.latencies_ms, 0.99),
                       "mean": round(statistics.fmean(tally.latencies_ms), 1) if tally.latencies_ms else None},
        "expected_errors": dict(tally.expected), "unexpected_errors": dict(tally.unexpected),
        **dict(tally.events),
        "rss_mb": {name: {"start": mb(0, k), "warm": mb(warm, k), "end": mb(-1, k),
                          "max": round(max(s[k] for s in tally.rss) / MIB, 1)}
                   for name, k in (("launcher", 1), ("ranks", 2))},
        "sidecar_exit_code": exit_code,
    }


def run(cfg: LoadConfig) -> dict[str, Any]:
    proc, url = launch(cfg)
    tally, t0 = Tally(), time.monotonic()
    deadline = t0 + cfg.seconds
    done = threading.Event()

    def sampler() -> None:
        while not done.wait(2.0):
            sample_rss(proc.pid, tally, t0)

    sample_rss(proc.pid, tally, t0)
    threading.Thread(target=sampler, daemon=True).start()
    trainer = threading.Thread(target=Trainer(url, tally).run, args=(deadline, cfg.sync_every), name="trainer")
    try:
        trainer.start()
        asyncio.run(drive_http(url, tally, cfg, deadline))
        trainer.join()
        done.set()
        sample_rss(proc.pid, tally, t0)
        if proc.poll() is not None:
            tally.add("unexpected", f"sidecar exited early with {proc.returncode}")
    finally:
        wall = time.monotonic() - t0
        proc.send_signal(signal.SIGTERM)
        try:
            code: int | None = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait(10)
    if code != 0:
        tally.add("unexpected", f"sidecar exit code {code}")
    return report(tally, cfg, wall, code)


def parse_args(argv: list[str] | None = None) -> LoadConfig:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=120.0, help="how long to run (then everything stops)")
    p.add_argument("--clients", type=int, default=128, help="concurrent generating clients")
    p.add_argument("--sync-every", type=float, default=3.0, help="seconds between trainer steps")
    p.add_argument("--max-requests", type=int, default=1_000_000, help="generation requests, all clients")
    p.add_argument("--kv-cache-bytes", type=int, default=16_000_000, help="the sidecar's KV cache")
    p.add_argument("--max-tokens", type=int, default=8, help="new tokens per completion")
    a = p.parse_args(argv)
    return LoadConfig(a.seconds, a.clients, a.sync_every, a.max_requests, a.kv_cache_bytes, a.max_tokens)


def main(argv: list[str] | None = None) -> int:
    out = run(parse_args(argv))
    print(json.dumps(out), flush=True)
    return 1 if out["unexpected_errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
