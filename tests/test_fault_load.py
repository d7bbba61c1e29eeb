"""scripts/tools/fault_load.py for about two minutes against real `sidecar launch`es (tiny model, CPU), in
both modes (--hold-while-asleep, then the default 409): 128 generating clients, an abuser, a pauser that
vanishes, a trainer syncing every 3 s, a sender SIGKILLed mid-send, a rival trainer, sleep/wake cycles.
Plus the server-side attacks (stop strings and ids, a chat past its messages, an answer-size bomb,
oversized headers, slow bodies, idle connections). Zero unexpected errors, every fault and attack
exercised with its documented status, every request served once the attacks stop, /health fast
throughout, the live bytes equal to the trainer's own digests after every sync (checked by the script,
not by the sidecar's audit), and RSS back near its warm figure after the run."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from http.client import HTTPConnection
from pathlib import Path

import pytest

from sidecar.cli.launch import KEEP_ALIVE_S
from tests.helpers_sidecar import launch

REPO = Path(__file__).resolve().parents[1]
SECONDS = 100  # over two launches (hold, then 409), plus ~15 s of launch and shutdown: about two minutes
SYNC_EVERY_S = 2.0  # the trainer's cycle (six steps) runs at least once in each mode's share
# Memory bound: growth after warm-up, in the first (longest) mode's run. "warm" is the RSS sample when the
# trainer finished its first whole cycle: by then the model and KV cache (allocated at launch), every
# client's connection, and the whole six-step cycle (both weight sets, gloo buffers, a spawned and
# killed sender, a level-2 sleep's refill, a rival's group) have been through once, so the same work
# only repeats. The ranks' RSS then wanders within one band (a 5- and a 14-minute run both peaked at
# 390 MiB, at most +19 MiB over warm; the launcher +0.7 MiB); 48 MiB is over twice that noise and is
# what leaking one tiny-model weight set (1.9 MiB) per sync for the ~25 syncs after warm-up would add.
GROWTH_MB = 48.0
GROWTH_RATIO = 1.10  # and relative: the end of the run (after the final phase) within 10% of warm
# The acceptance bound, per mode, probed from a process of its own: on the 2-core CI box under a parallel
# suite (load average 4-6) a 100 s run gave p99 10-16 ms, max 17 ms. Probed from the script's own event
# loop, beside its 128 clients and the trainer's digests, it read p99 1.4 s: that was the prober's wait.
HEALTH_P99_MS = 100.0


@pytest.fixture(scope="module")
def result() -> dict:
    cmd = [sys.executable, str(REPO / "scripts" / "tools" / "fault_load.py"), "--seconds", str(SECONDS),
           "--sync-every", str(SYNC_EVERY_S)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=SECONDS + 300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"no JSON line (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    out = json.loads(lines[-1])
    out["exit"] = proc.returncode
    return out


@pytest.mark.slow
def test_no_unexpected_errors_under_fault_and_load(result: dict) -> None:
    assert result["unexpected_errors"] == {} and result["exit"] == 0, result
    assert result["sidecar_exit_code"] == 0, result
    assert result["requests_served"] >= 1000 and result["latency_ms"]["p99"] is not None, result
    assert result["requests_sent"] >= result["requests_served"] and result["success_ratio"] > 0.5, result
    assert all(served > 0 for served in result["served_by_mode"].values()), result
    assert result["modes"] == ["hold", "409"] and result["health_ms"]["p99"] is not None, result


@pytest.mark.slow
def test_every_request_is_served_once_the_attacks_stop(result: dict) -> None:
    assert result["final_sent"] >= 100 and result["final_served"] == result["final_sent"], result


@pytest.mark.slow
def test_health_answers_fast_throughout(result: dict) -> None:
    for mode, health in result["health_ms_by_mode"].items():
        assert health["samples"] >= 200, (mode, health)
        assert health["p99"] <= HEALTH_P99_MS, f"/health p99 in mode {mode}: {health}"


@pytest.mark.slow
def test_every_fault_was_exercised(result: dict) -> None:
    assert result.get("syncs_audited_ok", 0) >= 10 and "syncs_audit_failed" not in result, result
    assert result.get("live_bytes_checked_ok") == result["syncs_audited_ok"], result  # the script's own check
    assert result.get("senders_killed_mid_send", 0) >= 1, result
    assert result.get("kills_confirmed_mid_send") == result["senders_killed_mid_send"], result
    assert result.get("kills_healed") == result["senders_killed_mid_send"], result
    assert result.get("rivals_refused", 0) >= 1, result
    assert result["expected_errors"].get("replaced session update 409 session") == result["rivals_refused"], result
    assert result.get("pauses_released_by_lease", 0) >= 1, result
    assert result["expected_errors"].get("killed sender update 502") == result["senders_killed_mid_send"], result
    assert result.get("sleep_wake_level1", 0) >= 1 and result.get("sleep_wake_level2", 0) >= 1, result
    attacks = result["attacks_by_kind"]
    assert set(attacks) == {"oversized_body", "long_prompt", "malformed_json", "bad_value", "lone_surrogate",
                            "too_many_sequences", "shape_integers", "stops_at_limit", "too_many_stops",
                            "too_many_stop_ids", "stop_chars", "too_many_messages", "answer_bomb", "big_header",
                            "slow_body", "idle_connections"}, attacks
    for kind, row in attacks.items():
        assert row["expected"] and not row["unexpected"], (kind, row)
    assert attacks["big_header"]["expected"] == {"431 field headers": attacks["big_header"]["sent"]}, attacks
    assert attacks["slow_body"]["expected"] == {"408 field body": attacks["slow_body"]["sent"]}, attacks
    assert attacks["oversized_body"]["expected"].get("413"), attacks  # read, not reset (unless uploaded slowly)


@pytest.mark.slow
def test_memory_does_not_grow_after_warm_up(result: dict) -> None:
    for name in ("launcher", "ranks"):
        rss = result["rss_mb"][name]
        bound = rss["warm"] + GROWTH_MB
        assert rss["end"] <= bound and rss["max"] <= bound, f"{name} RSS grew past {bound:.0f} MiB: {rss}"
    for mode, by_process in result["rss_mb_by_mode"].items():
        for name, rss in by_process.items():
            assert rss["end"] <= GROWTH_RATIO * rss["warm"], f"{name} RSS in mode {mode} not back near warm: {rss}"


@pytest.mark.slow
def test_an_idle_kept_alive_connection_outlives_the_clients_expiry() -> None:
    """Found by the script: at uvicorn's default 5 s keep-alive the server closed idle connections just
    as httpx (5 s expiry) reused them, and that POST failed. The server must keep a connection idle past
    the client's 5 s; the wait is the idle time under test, not synchronisation."""
    assert KEEP_ALIVE_S > 15  # httpx 5 s, aiohttp 15 s
    server = launch()
    try:
        host, port = server.url.removeprefix("http://").rsplit(":", 1)
        conn = HTTPConnection(host, int(port), timeout=30)
        conn.request("GET", "/health")
        assert conn.getresponse().read() and conn.sock is not None
        time.sleep(6.0)
        conn.request("POST", "/generate", body=b'{"prompts": ["idle"], "sampling_params": {"max_tokens": 2}}',
                     headers={"content-type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        conn.close()
    finally:
        assert server.stop() == 0, server.log
