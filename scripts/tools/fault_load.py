"""Fault and load: a `sidecar launch` of the tiny model on CPU per mode (--modes: "hold" with
--hold-while-asleep, "409" the default), on loopback, bounded by --seconds and --max-requests. At once:
--clients httpx clients generating back to back; an abuser cycling through ABUSES (JSON requests past
each limit, or at it) and RAW_ATTACKS (raw sockets: big headers, slow bodies, idle connections), each
with its documented status and field; a pauser that vanishes (its lease must end the pause); a /health
prober in a process of its own (its latency is the sidecar's); a trainer cycling every --sync-every s
through a sync, a sender SIGKILLed mid-send (502, torn, healed), sleep 2 + wake + sync, a rival
trainer's init (409 naming `session`, healed), sleep 1 + wake. After every sync the live bytes
(/checksums) are compared with digests computed here from the trainer's own tensors. The last 15% of
each mode (after the trainer's last step) has attacks and faults off: every request must be served.
The sidecar runs with small LIMITS so every attack, its timeouts included, fits the run.
Prints one JSON line (what docs/benchmarks.md reports: requests sent/served, latency and /health
percentiles, attacks_by_kind, syncs, kills, rivals, pauses, RSS start/warm/end/max per process and
mode); exit 1 if any error was unexpected. Run: python scripts/tools/fault_load.py --seconds 300
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
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

from scripts.tools.fault_attacks import ABUSES, LIMITS, LINGER_S, MIB, PAUSE_LEASE_S, RAW_ATTACKS, abuse_body
from scripts.tools.sidecar_proc import start_sidecar

FINAL_SHARE, FINAL_MIN_S = 0.15, 5.0  # each mode's final phase: clients and /health only, all must be served


@dataclass(frozen=True)
class LoadConfig:
    seconds: float
    clients: int
    sync_every: float
    max_requests: int
    kv_cache_bytes: int
    max_tokens: int
    modes: tuple[str, ...] = ("hold", "409")


@dataclass
class Tally:
    """What every loop reports into; one lock, since the trainer and sampler threads write too."""

    served: int = 0
    sent: int = 0
    latencies_ms: list[float] = field(default_factory=list)
    health_ms: list[float] = field(default_factory=list)
    warm_s: float | None = None  # when the trainer finished its first whole cycle
    expected: Counter = field(default_factory=Counter)
    unexpected: Counter = field(default_factory=Counter)
    events: Counter = field(default_factory=Counter)
    attacks: Counter = field(default_factory=Counter)  # attempts by kind (ABUSES and RAW_ATTACKS)
    rss: list[tuple[float, int, int]] = field(default_factory=list)  # (t, launcher bytes, ranks bytes)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, counter: str, key: str) -> None:
        with self.lock:
            getattr(self, counter)[key] += 1


# ---- the sidecar and its memory ---------------------------------------------------------------------


def launch(cfg: LoadConfig, mode: str) -> tuple[subprocess.Popen, str]:
    """`sidecar launch` on 127.0.0.1, port 0; returns once it prints its 'serving on' line. Mode "hold"
    adds --hold-while-asleep."""
    cmd = [sys.executable, "-m", "sidecar.cli.main", "launch", "--host", "127.0.0.1", "--port", "0", "--device", "cpu",
           "--kv-cache-bytes", str(cfg.kv_cache_bytes), "--log-level", "warning",
           *(["--hold-while-asleep"] if mode == "hold" else []),
           "--max-model-len", "256", *(f"--{k.replace('_', '-')}={v}" for k, v in LIMITS.items())]
    return start_sidecar(cmd)


def rss_bytes(pid: int) -> int:
    """The process's resident bytes; 0 once it is gone."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        try:
            return int(psutil.Process(pid).memory_info().rss)
        except psutil.NoSuchProcess:
            return 0
    with contextlib.suppress(OSError):
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
    """One memory sample; none once the sidecar is gone (run() reports its exit)."""
    ranks = sum(rss_bytes(p) for p in children(pid))
    rss = rss_bytes(pid)
    if rss:
        with tally.lock:
            tally.rss.append((time.monotonic() - t0, rss, ranks))


# ---- clients and the abuser -------------------------------------------------------------------------


async def client_loop(http: Any, tally: Tally, cfg: LoadConfig, i: int, deadline: float, final: bool = False) -> None:
    """Generation back to back until `deadline`. In the final phase (`final`: attacks and faults over)
    every request must be served: any other answer is unexpected."""
    import httpx

    n = 0
    while time.monotonic() < deadline:
        with tally.lock:
            if tally.sent >= cfg.max_requests:
                return
            tally.sent += 1
            if final:
                tally.events["final_sent"] += 1
        n += 1
        body = {"prompts": [f"client {i} asks question {n}"],
                "sampling_params": {"temperature": 0.0 if n % 2 else 0.8, "max_tokens": cfg.max_tokens}}
        t = time.perf_counter()
        try:
            resp = await http.post("/generate", json=body)
        except httpx.HTTPError as e:
            tally.add("unexpected", f"generate {type(e).__name__}{' after the attacks stopped' if final else ''}")
            continue
        if resp.status_code == 200:
            with tally.lock:
                tally.served += 1
                tally.latencies_ms.append((time.perf_counter() - t) * 1000)
                if final:
                    tally.events["final_served"] += 1
        elif final:
            tally.add("unexpected", f"generate {resp.status_code} {_error(resp).get('type')} after the attacks stopped")
        elif resp.status_code == 409 and _refused_for_state(resp):
            tally.add("expected", "generate 409 while asleep or torn")  # the default mode's answer: retry
            await asyncio.sleep(0.1)
        else:
            error = _error(resp)
            tally.add("unexpected", f"generate {resp.status_code} {error.get('type')} field {error.get('field')}")


def _refused_for_state(resp: Any) -> bool:
    """A 409 of the default mode: the sidecar sleeps, a model is torn or awaits its first sync."""
    error = _error(resp)
    message = str(error.get("message", ""))
    return error.get("type") == "StateError" and any(w in message for w in ("asleep", "torn", "not servable",
                                                                              "holds no valid", "sync"))


def _error(resp: Any) -> dict[str, Any]:
    try:
        return dict(resp.json().get("error") or {})
    except (ValueError, AttributeError):
        return {}


async def abuse_loop(http: Any, tally: Tally, deadline: float, every_s: float = 0.25) -> None:
    import httpx

    kinds = list(ABUSES) + list(RAW_ATTACKS)
    n = 0
    while time.monotonic() < deadline:
        kind = kinds[n % len(kinds)]
        n += 1
        tally.add("events", "abuses_sent")
        tally.add("attacks", kind)
        if kind in RAW_ATTACKS:
            try:
                outcome = await RAW_ATTACKS[kind](str(http.base_url))
            except (OSError, asyncio.TimeoutError) as e:
                outcome = f"unexpected {type(e).__name__}"
            verdict, _, what = outcome.partition(" ")
            tally.add("expected" if verdict == "expected" else "unexpected", f"attack {kind} {what}")
            await asyncio.sleep(every_s)
            continue
        content, headers = abuse_body(kind)
        path, statuses, field_name = ABUSES[kind]
        t = time.monotonic()
        try:
            resp = await http.post(path, content=content, headers=headers)
        except httpx.HTTPError as e:
            # The sidecar answers 413 before reading an oversized body and drops what still comes for
            # LINGER_S (docs/limits.md), then closes: an upload slower than that (this script's own busy
            # event loop) may see the close. Only a faster one must read the 413.
            slow = kind == "oversized_body" and time.monotonic() - t > LINGER_S
            tally.add("expected" if slow else "unexpected",
                      f"abuse {kind} {type(e).__name__}{' after a slow upload' if slow else ''}")
            continue
        error = _error(resp)
        if resp.status_code == 200 or (resp.status_code == 409 and _refused_for_state(resp)):
            ok, named = resp.status_code in statuses, True
        else:
            named = bool(error.get("field")) and field_name in (None, error.get("field"))
            ok = resp.status_code in statuses and named
        tally.add("expected" if ok else "unexpected",
                  f"abuse {kind} {resp.status_code}{'' if named else ' field ' + str(error.get('field'))}")
        await asyncio.sleep(every_s)




async def pause_and_vanish_loop(url: str, tally: Tally, deadline: float, every_s: float = 10.0) -> None:
    """Pause with a short lease and never resume: generation must resume by itself within the lease
    (plus the driver's half-second look at its clocks); polled on /state, each poll an answer."""
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        while time.monotonic() + every_s < deadline:
            await asyncio.sleep(every_s)
            resp = await http.post("/pause", json={"lease_s": PAUSE_LEASE_S})
            if resp.status_code != 200:
                tally.add("unexpected", f"pause {resp.status_code}")
                continue
            t0 = time.monotonic()
            while (await http.get("/state")).json().get("paused"):
                if time.monotonic() - t0 > PAUSE_LEASE_S + 5:
                    tally.add("unexpected", "a vanished pauser's pause outlived its lease")
                    break
                await asyncio.sleep(0.1)
            else:
                tally.add("events", "pauses_released_by_lease")


def health_prober(url: str, stop: Any, out: Any, every_s: float = 0.1) -> None:
    """Spawned: GET /health on a kept-alive connection of its own every `every_s` until `stop` is set,
    then put (latencies in ms, bad answers by kind). A process of its own, so the latency is the
    sidecar's, not this script's 128 clients' event loop or the trainer's digests; any answer but 200
    is unexpected (nothing in this run may take the ranks down)."""
    from http.client import HTTPConnection

    host, port = url.removeprefix("http://").rstrip("/").rsplit(":", 1)
    latencies: list[float] = []
    bad: Counter = Counter()
    conn = HTTPConnection(host, int(port), timeout=30)
    while not stop.wait(every_s):
        t = time.perf_counter()
        try:
            conn.request("GET", "/health")
            resp = conn.getresponse()
            resp.read()
        except (OSError, ValueError) as e:  # ValueError: http.client's own protocol errors
            bad[f"health {type(e).__name__}"] += 1
            conn.close()
            conn = HTTPConnection(host, int(port), timeout=30)
            continue
        latencies.append((time.perf_counter() - t) * 1000)
        if resp.status != 200:
            bad[f"health {resp.status}"] += 1
    conn.close()
    out.put((latencies, dict(bad)))


async def drive_http(url: str, tally: Tally, cfg: LoadConfig, deadline: float, final_s: float,
                     trainer: threading.Thread) -> None:
    """Clients, the abuser and the pauser until `deadline`; then, once the trainer's last step is over,
    the final phase: clients only, for `final_s` (/health is probed throughout by health_prober)."""
    import httpx

    limits = httpx.Limits(max_connections=cfg.clients + 8, max_keepalive_connections=cfg.clients + 8)
    async with httpx.AsyncClient(base_url=url, timeout=180, limits=limits) as http:
        loops = [client_loop(http, tally, cfg, i, deadline) for i in range(cfg.clients)]
        await asyncio.gather(*loops, abuse_loop(http, tally, deadline), pause_and_vanish_loop(url, tally, deadline))
        await asyncio.to_thread(trainer.join)  # its last step may run past the deadline
        end = time.monotonic() + final_s
        await asyncio.gather(*(client_loop(http, tally, cfg, i, end, final=True) for i in range(cfg.clients)))


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


def held_digests(named: dict[str, Any]) -> dict[str, str]:
    """What a rank must hold after a sync of `named` (engine names, the host rule), computed here from the
    trainer's own tensors: the tiny model built on the CPU and loaded with them, then digested. Compared
    with GET /checksums, it checks the live bytes whatever the sidecar's own audit said."""
    import torch

    from checksum import digest_tensors
    from inference.models import build_model
    from inference.models.hf_config import read_model_config
    from inference.models.loader import load_named_tensors
    from inference.models.tiny import default_model_dir
    from inference.parallel import TPInfo

    model = build_model(read_model_config(default_model_dir()), TPInfo(), torch.float32, "cpu")
    load_named_tensors(model, list(named.items()))
    return {r.name: r.digest for r in digest_tensors(list(model.named_parameters()))}


class Trainer:
    """The control loop's state: one client, the live sender, the next version, two weight sets and the
    digests each must leave on the rank."""

    def __init__(self, url: str, tally: Tally, t0: float) -> None:
        from inference.models.tiny import DEFAULT_TINY, TinyModelSpec, random_weights
        from sidecar.client import SidecarClient

        self.url, self.t0 = url, t0
        self.client = SidecarClient(url, timeout=180)
        self.tally, self.sender, self.version = tally, None, 0
        self.weights = [random_weights(DEFAULT_TINY), random_weights(TinyModelSpec(seed=1))]
        self.expected = [held_digests(w) for w in self.weights]

    def sync(self) -> None:
        from checksum import ALGORITHM
        from inference.transfer.sender import WeightSender

        if self.sender is None:
            self.sender = WeightSender("gloo", num_receivers=1, timeout_s=60)
            self.client.connect_sender(self.sender)
        self.version += 1
        which = self.version % 2
        result = self.client.sync_weights(self.sender, self.weights[which], version=self.version)
        self.tally.add("events", "syncs_audited_ok" if result["ok"] else "syncs_audit_failed")
        if not result["ok"]:
            self.tally.add("unexpected", "sync audit mismatch")
        (manifest,) = self.client.checksums(algorithm=ALGORITHM)
        live = {t["name"]: t["digest"] for t in manifest["tensors"]}
        if live == self.expected[which] and not manifest.get("torn"):
            self.tally.add("events", "live_bytes_checked_ok")
        else:
            wrong = sorted(n for n in self.expected[which] if live.get(n) != self.expected[which][n])
            self.tally.add("unexpected", f"live bytes differ from the trainer's own digests ({len(wrong)} tensors)")

    def rival(self) -> None:
        """A second trainer inits (replacing the group); this trainer's next update must be refused (409
        naming `session`), before any byte: then a new init of its own, and a sync, heal it."""
        from inference.transfer.sender import WeightSender
        from sidecar.client import SidecarClient, SidecarStateError

        rival = WeightSender("gloo", num_receivers=1, timeout_s=30)
        try:
            with SidecarClient(self.url, timeout=180) as other:
                other.connect_sender(rival)
            assert self.sender is not None
            start = self.client.weights.start_body(self.version + 1, self.sender.manifest(
                list(self.weights[0].items()), self.version + 1), "target", False, short=False)
            try:
                self.client.weights.update(start).result()
                self.tally.add("unexpected", "an update of a replaced session was accepted")
            except SidecarStateError as e:
                ok = e.status == 409 and e.field == "session"
                self.tally.add("expected" if ok else "unexpected", f"replaced session update {e.status} {e.field}")
        finally:
            rival.close()
            if self.sender is not None:
                self.sender.close()
                self.sender = None  # the group is the rival's (now closed): join a new sender
        self.sync()
        self.tally.add("events", "rivals_refused")

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
            # Mid-send means bytes had moved: the model is torn until the heal (a kill before any bucket
            # would leave it intact, and would not be the fault this step is about).
            torn = self.client.state()["torn"].get("target")
            self.tally.add("events" if torn else "unexpected",
                           "kills_confirmed_mid_send" if torn else "a sender kill did not land mid-send")
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
        # Every fault early in the cycle: a short run (or the second mode's share of one) still meets each.
        steps = [self.sync, self.kill_mid_send, lambda: self.sleep_wake(2), self.rival, lambda: self.sleep_wake(1),
                 self.sync]
        n = 0
        try:
            while time.monotonic() + every_s < deadline:
                time.sleep(every_s)
                try:
                    steps[n % len(steps)]()
                except Exception as e:  # counted, never swallowed silently: it fails the run
                    self.tally.add("unexpected", f"trainer {type(e).__name__}: {str(e)[:120]}")
                n += 1
                if n == len(steps):
                    with self.tally.lock:
                        self.tally.warm_s = time.monotonic() - self.t0
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


def rss_report(tally: Tally, wall_s: float) -> dict[str, dict[str, float]]:
    """Launcher and ranks RSS (MiB) at start, warm (the sample nearest the end of the trainer's first
    whole cycle, else a quarter of the run), at the end and at most."""
    def mb(i: int, k: int) -> float:
        return round(tally.rss[i][k] / MIB, 1)

    warm_at = tally.warm_s if tally.warm_s is not None else wall_s / 4
    warm = min(range(len(tally.rss)), key=lambda i: abs(tally.rss[i][0] - warm_at))
    return {name: {"start": mb(0, k), "warm": mb(warm, k), "end": mb(-1, k),
                   "max": round(max(s[k] for s in tally.rss[warm:]) / MIB, 1)}
            for name, k in (("launcher", 1), ("ranks", 2))}


def attacks_by_kind(counters: dict[str, Counter]) -> dict[str, dict[str, Any]]:
    """Per abuse or raw attack: attempts, and their outcomes (expected and unexpected, by status)."""
    out: dict[str, dict[str, Any]] = {}
    for kind, sent in sorted(counters["attacks"].items()):
        row: dict[str, Any] = {"sent": sent, "expected": {}, "unexpected": {}}
        for verdict in ("expected", "unexpected"):
            for key, n in counters[verdict].items():
                words = key.split(" ", 2)
                if words[0] in ("abuse", "attack") and len(words) > 1 and words[1] == kind:
                    row[verdict][words[2] if len(words) > 2 else ""] = n
        out[kind] = row
    return out


def report(runs: dict[str, tuple[Tally, float, int | None]], cfg: LoadConfig) -> dict[str, Any]:
    """One JSON object over every mode's run (counters summed; RSS and exit codes per mode)."""
    tallies = [t for t, _, _ in runs.values()]
    wall = sum(w for _, w, _ in runs.values())
    served, sent = sum(t.served for t in tallies), sum(t.sent for t in tallies)
    latencies = [x for t in tallies for x in t.latencies_ms]
    health = [x for t in tallies for x in t.health_ms]
    counters = {name: sum((getattr(t, name) for t in tallies), Counter())
                for name in ("expected", "unexpected", "events", "attacks")}
    return {
        "bench": "fault_load", "seconds": round(wall, 1), "clients": cfg.clients, "modes": list(runs),
        "sync_every_s": cfg.sync_every, "limits": LIMITS,
        "requests_sent": sent, "requests_served": served, "success_ratio": round(served / max(sent, 1), 4),
        "requests_per_s": round(served / max(wall, 1e-9), 1),
        "latency_ms": {"p50": percentile(latencies, 0.5), "p99": percentile(latencies, 0.99),
                       "mean": round(statistics.fmean(latencies), 1) if latencies else None},
        "health_ms": {"p50": percentile(health, 0.5), "p99": percentile(health, 0.99), "max": percentile(health, 1.0)},
        "health_ms_by_mode": {mode: {"p50": percentile(t.health_ms, 0.5), "p99": percentile(t.health_ms, 0.99),
                                     "max": percentile(t.health_ms, 1.0), "samples": len(t.health_ms)}
                              for mode, (t, _, _) in runs.items()},
        "expected_errors": dict(counters["expected"]), "unexpected_errors": dict(counters["unexpected"]),
        "attacks_by_kind": attacks_by_kind(counters),
        **{k: counters["events"].get(k, 0) for k in ("final_sent", "final_served")},
        **dict(counters["events"]),
        "served_by_mode": {mode: t.served for mode, (t, _, _) in runs.items()},
        "rss_mb_by_mode": {mode: rss_report(t, w) for mode, (t, w, _) in runs.items()},
        "rss_mb": rss_report(*next(iter(runs.values()))[:2]),  # the first mode's, the longest run
        "sidecar_exit_code": max((c if c is not None else 1 for _, _, c in runs.values()), default=None),
    }


def run(cfg: LoadConfig, mode: str, seconds: float) -> tuple[Tally, float, int | None]:
    """One sidecar in `mode` under load for `seconds`, the last FINAL_SHARE of them (at least FINAL_MIN_S)
    with attacks and faults off: its tally, wall time and exit code."""
    proc, url = launch(cfg, mode)
    tally, t0 = Tally(), time.monotonic()
    final_s = max(FINAL_MIN_S, FINAL_SHARE * seconds)
    deadline = t0 + max(seconds - final_s, 1.0)
    done = threading.Event()

    def sampler() -> None:
        while not done.wait(2.0):
            sample_rss(proc.pid, tally, t0)

    sample_rss(proc.pid, tally, t0)
    threading.Thread(target=sampler, daemon=True).start()
    ctx = mp.get_context("spawn")
    stop_health, health_out = ctx.Event(), ctx.Queue()
    prober = ctx.Process(target=health_prober, args=(url, stop_health, health_out), daemon=True)
    prober.start()
    trainer = threading.Thread(target=Trainer(url, tally, t0).run, args=(deadline, cfg.sync_every), name="trainer")
    try:
        trainer.start()
        try:
            asyncio.run(drive_http(url, tally, cfg, deadline, final_s, trainer))
        except Exception as e:  # the load failed: a dead sidecar is the finding, not this traceback
            if proc.poll() is None:
                raise
            tally.add("unexpected", f"the load stopped: {type(e).__name__}: {e}")
        trainer.join()
        done.set()
        sample_rss(proc.pid, tally, t0)
        stop_health.set()
        health_ms, bad = health_out.get(timeout=60)
        tally.health_ms.extend(health_ms)
        tally.unexpected.update(bad)
        if proc.poll() is not None:
            tally.add("unexpected", f"sidecar exited early with {proc.returncode}")
    finally:
        wall = time.monotonic() - t0
        stop_health.set()
        prober.join(30)
        if prober.is_alive():
            prober.kill()
        proc.send_signal(signal.SIGTERM)
        try:
            code: int | None = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait(10)
    if code != 0:
        tally.add("unexpected", f"sidecar exit code {code}")
    return tally, wall, code


def run_modes(cfg: LoadConfig) -> dict[str, Any]:
    """Every mode in turn; the first (the longest: the memory figures are its) gets 60% of the time when
    there are two."""
    shares = [1.0] if len(cfg.modes) == 1 else [0.6] + [0.4 / (len(cfg.modes) - 1)] * (len(cfg.modes) - 1)
    runs = {mode: run(cfg, mode, cfg.seconds * share) for mode, share in zip(cfg.modes, shares)}
    return report(runs, cfg)


def parse_args(argv: list[str] | None = None) -> LoadConfig:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=120.0, help="how long to run (then everything stops)")
    p.add_argument("--clients", type=int, default=128, help="concurrent generating clients")
    p.add_argument("--sync-every", type=float, default=3.0, help="seconds between trainer steps")
    p.add_argument("--max-requests", type=int, default=1_000_000, help="generation requests, all clients")
    p.add_argument("--kv-cache-bytes", type=int, default=16_000_000, help="the sidecar's KV cache")
    p.add_argument("--max-tokens", type=int, default=8, help="new tokens per completion")
    p.add_argument("--modes", default="hold,409", help="comma-separated, run in turn: hold (--hold-while-asleep), "
                                                       "409 (the default: 409 while asleep)")
    a = p.parse_args(argv)
    modes = tuple(m for m in a.modes.split(",") if m)
    if not modes or set(modes) - {"hold", "409"}:
        p.error(f"--modes: hold and/or 409, got {a.modes!r}")
    return LoadConfig(a.seconds, a.clients, a.sync_every, a.max_requests, a.kv_cache_bytes, a.max_tokens, modes)


def main(argv: list[str] | None = None) -> int:
    out = run_modes(parse_args(argv))
    print(json.dumps(out), flush=True)
    return 1 if out["unexpected_errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
