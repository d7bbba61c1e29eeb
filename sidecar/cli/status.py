"""`sidecar status [URL ...]`: a running sidecar's state as a table (URL default: `sidecar launch`'s default
address, http://127.0.0.1:8000); several URLs show them as a fleet (trainer_hooks.Fleet, in dp order).

Exit status: 0 healthy, 1 reachable but unhealthy (a rank is dead or hung), 2 unreachable or an
error response (one line on stderr). A fleet: 0 when every replica is healthy, 2 when none is
reachable, 1 otherwise.

A fleet's "in rotation" here is what a Fleet decides at first contact (trainer_hooks/fleet_replicas.py
`admissible`): healthy, not torn, at the newest version among those; the Fleet inside a trainer also
takes out replicas that failed or missed one of its syncs, which only it knows.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from inference import envs
from inference.core import SidecarError
from sidecar.config import LaunchConfig

DEFAULT_URL = f"http://{LaunchConfig.host}:{LaunchConfig.port}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", metavar="URL", nargs="?", default=DEFAULT_URL,
                   help="the sidecar's address (`sidecar launch` serves on this one unless told otherwise)")
    p.add_argument("more_urls", metavar="URL", nargs="*", default=[],
                   help="more replicas: several URLs are shown as one fleet, dp0 first (default: none)")
    p.add_argument("--api-key", default=None, help="default: $SIDECAR_API_KEY")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per request")
    p.add_argument("--json", action="store_true", help="print the raw /state JSON")


def run(args: argparse.Namespace) -> int:
    from sidecar.client import SidecarClient

    key = args.api_key or envs.API_KEY.get()
    if args.more_urls:
        return _run_fleet([args.url, *args.more_urls], key, args)
    try:
        with SidecarClient(args.url, api_key=key, timeout=args.timeout, retries=1) as client:
            state = client.state()
    except SidecarError as e:
        print(f"sidecar status: {explain_error(args.url, e)}", file=sys.stderr)
        return 2
    print(json.dumps(state, indent=2, sort_keys=True) if args.json else format_state(args.url, state))
    return 0 if state.get("healthy") else 1


def explain_error(url: str, e: SidecarError) -> str:
    """One line for an error reaching `url`: what it means and what to do, the cause last."""
    from trainer_hooks.client_errors import SidecarAuthError, SidecarConnectionError

    if isinstance(e, SidecarConnectionError):
        return (f"no sidecar answers at {url}: start one with `sidecar launch`, or name its URL "
                f"(`sidecar status URL`) ({e})")
    if isinstance(e, SidecarAuthError):
        return (f"the sidecar at {url} refused the API key: pass its key with --api-key KEY or "
                f"SIDECAR_API_KEY ({e})")
    return f"error: {e}"


def format_state(url: str, s: dict[str, Any]) -> str:
    health = "healthy" if s.get("healthy") else f"UNHEALTHY ({s.get('failure')})"
    stale = {m: why for m, why in (s.get("needs_sync") or {}).items() if why}
    if stale:  # the processes are fine, but the bytes are not the version shown: generation refuses
        health += ", NOT SERVING: " + "; ".join(f"{m} needs a sync ({why})" for m, why in stale.items())
    activity = "asleep" if s.get("sleeping") else "awake"
    if s.get("paused"):
        activity += ", paused"
    if s.get("busy"):
        activity += f", running {s['busy']}"
    model = s.get("model", {})
    versions = ", ".join(f"{m} v{v}{' TORN' if s.get('torn', {}).get(m) else ' NEEDS SYNC' if stale.get(m) else ''}"
                         for m, v in s.get("weight_versions", {}).items())
    lines = [
        f"sidecar {url}: {health}, {activity}",
        f"model      {model.get('model')} ({model.get('dtype')}, vocab {model.get('vocab_size')}, "
        f"max_model_len {model.get('max_model_len')})" + (f", draft {model['draft_model']}"
                                                          if model.get("draft_model") else ""),
        f"weights    {versions or '-'}",
        "memory     " + (", ".join(f"{t}: {st}" for t, st in s.get("tags", {}).items()) or "-"),
        f"queue      {s.get('queue_depth', 0)} prompt(s) waiting or running; tp {s.get('tp')}",
        *_engine_line(s.get("engine") or {}),
        "",
    ]
    tags = sorted({t for r in s.get("ranks", []) for t in r.get("tags", {})})
    header = ["RANK", "PID", "ALIVE", "DEVICE", "READY", *tags, "VERSIONS", "KV BLOCKS"]
    rows = [header]
    for r in s.get("ranks", []):
        rows.append([str(r.get("rank")), str(r.get("pid")), _yes(r.get("alive")), str(r.get("device")),
                     "dead" if r.get("status") == "dead" else _yes(r.get("ready")),  # not its last report
                     *(r.get("tags", {}).get(t, "-") if r.get("alive") else "-" for t in tags),
                     ",".join(f"{m}={v}" for m, v in r.get("weight_versions", {}).items()) or "-",
                     str(r.get("kv_blocks"))])
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines)


def _engine_line(e: dict[str, Any]) -> list[str]:
    """The engine's counters since start, in one line (none before the first finished request)."""
    if not e.get("generated_tokens"):
        return []
    parts = [f"{e['generated_tokens']} tokens generated", f"{e.get('prefix_cache_hit_tokens', 0)} prompt tokens "
             "from the prefix cache"]
    proposed = e.get("draft_tokens_proposed", 0)
    if proposed:
        parts.append(f"draft acceptance {e.get('draft_tokens_accepted', 0) / proposed:.1%} of {proposed} proposed")
    parts.append(f"{e.get('preemptions', 0)} preemption(s)")
    return ["engine     " + ", ".join(parts)]


def _run_fleet(urls: list[str], key: str | None, args: argparse.Namespace) -> int:
    from trainer_hooks.fleet import Fleet

    try:
        with Fleet(urls, api_key=key, timeout=args.timeout, retries=1) as fleet:
            rows = fleet.status()
            version = fleet.version
    except SidecarError as e:
        print(f"sidecar status: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(rows, indent=2, sort_keys=True) if args.json else format_fleet(rows, version))
    if not any(r["reachable"] for r in rows):
        return 2
    return 0 if all(r["healthy"] for r in rows) else 1


def format_fleet(rows: list[dict[str, Any]], version: int | None) -> str:
    """A header line, one row per replica (REPLICA URL HEALTH VERSION IN-ROTATION OUTSTANDING SLEEPING
    RANKS; OUTSTANDING: the sequences the replica has accepted and not answered), then why each replica
    out of rotation is out."""
    serving = sum(1 for r in rows if r["in_rotation"])
    at = version if version is not None else "-"
    lines = [f"fleet of {len(rows)} replicas: {serving} in rotation at version {at}"]
    table = [["REPLICA", "URL", "HEALTH", "VERSION", "IN-ROTATION", "OUTSTANDING", "SLEEPING", "RANKS"]]
    for r in rows:
        health = "healthy" if r["healthy"] else ("unhealthy" if r["reachable"] else "unreachable")
        version_text = "-" if r["version"] is None else f"{r['version']}{' TORN' if r['torn'] else ''}"
        table.append([r["replica"], r["url"], health, version_text, _yes(r["in_rotation"]),
                      str(r["queued_sequences"] if r["queued_sequences"] is not None else "-"), _yes(r["sleeping"]),
                      ",".join(r["ranks"]) or "-"])
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in table]
    lines += [f"{r['replica']} out of rotation: {r['reason']}" for r in rows if not r["in_rotation"]]
    return "\n".join(lines)


def _yes(value: Any) -> str:
    return "-" if value is None else ("yes" if value else "no")
