"""What a `Fleet` (trainer_hooks/fleet.py) knows of each replica, its errors, and its pure rules.

- Naming: replica i of a fleet is "dp{i}" (its position in the fleet's URL list), and its ranks are
  "dp{i}:pp{j}:tp{k}" in every report, whatever key the replica gives them itself: a sidecar launched
  without --dp-rank calls them "dp0:...", so the fleet re-keys them (with --dp-rank the keys already agree).
- Routing (`pick_replicas`): every prompt, with all of its n samples (they share its prefix blocks),
  goes to the replica with the fewest outstanding sequences, counting what this call placed before it.
- Admission (`admissible`): at first contact a replica is in rotation when it is healthy, not torn
  and serves the newest target version among the replicas that are; afterwards only a good sync
  admits it (Fleet.sync_weights).

Imports neither torch nor httpx (`sidecar status` builds a Fleet).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from inference.core import SidecarError
from trainer_hooks.client_errors import SidecarConnectionError

_DP = re.compile(r"^dp(\d+)(?=:)")


class FleetError(SidecarError):
    """A fleet-level failure; the message names every replica involved (dp{i} and its URL)."""


class FleetGoneError(FleetError, SidecarConnectionError):
    """No replica can serve: every one is unreachable or out of rotation (each named with its reason).
    A SidecarConnectionError, so the hook reports it as SidecarGoneError, as it does for one sidecar."""


class FleetSyncError(FleetError):
    """A sync failed on the wire or at start for reasons that are not a replica going away; `errors`
    maps each failing replica's name to the error its sidecar answered (naming the rank)."""

    def __init__(self, message: str, errors: Mapping[str, BaseException]) -> None:
        super().__init__(message + "".join(f"\n  {name}: {e}" for name, e in errors.items()))
        self.errors = dict(errors)


@dataclass
class Replica:
    """One replica: its client and the fleet's state of it (changed under the fleet's lock).

    Invariant: `in_rotation` is False exactly when `reason` says why; a replica in rotation serves the
    fleet's weight version (a good sync made it live there, or first contact found it there).
    """

    index: int
    client: Any  # a SidecarClient, or anything with its API that raises its errors
    in_rotation: bool = True
    reason: str | None = None
    outstanding: int = 0  # sequences this fleet sent to it and has not received back
    rank_keys: tuple[str, ...] = ()  # as the replica names its ranks (its /state), in rank order
    pids: tuple[int, ...] = ()  # its rank processes: new pids mean a restarted replica
    version: int | None = None  # the target version its last good sync made live
    # counters since the fleet was built (trainer_hooks/fleet_metrics.py exports them)
    times_out: int = 0  # times it left rotation
    retried: int = 0  # prompts moved from it to other replicas (it died or answered another version)
    served: int = 0  # sequences it returned to this fleet's generate calls

    @property
    def name(self) -> str:
        return f"dp{self.index}"

    @property
    def url(self) -> str:
        return str(getattr(self.client, "url", "?"))

    @property
    def label(self) -> str:
        return f"{self.name} ({self.url})"

    def take_out(self, reason: str) -> None:
        if self.in_rotation:
            self.times_out += 1
        self.in_rotation, self.reason = False, reason

    def admit(self, version: int | None) -> None:
        self.in_rotation, self.reason, self.version = True, None, version

    def fleet_keys(self) -> list[str]:
        return [fleet_rank_key(self.index, k) for k in self.rank_keys]


def fleet_rank_key(index: int, key: str) -> str:
    """"dp0:pp0:tp1" of replica 2 -> "dp2:pp0:tp1" (a key without a dp part is prefixed)."""
    return _DP.sub(f"dp{index}", key) if _DP.match(key) else f"dp{index}:{key}"


def reported_dp(key: str) -> int | None:
    match = _DP.match(key)
    return int(match.group(1)) if match else None


def check_dp_ranks(replica: Replica) -> None:
    """A replica launched with --dp-rank names its ranks dp<I>; at position i of the fleet I must be i
    (0 is what a replica reports when its launch did not give one). Raises FleetError otherwise: URLs
    listed out of order would make every report name the wrong replica."""
    for key in replica.rank_keys:
        dp = reported_dp(key)
        if dp not in (None, 0, replica.index):
            raise FleetError(f"{replica.label} names its rank {key}, so it was launched with --dp-rank {dp}, "
                             f"but it is replica {replica.index} of this fleet: list the URLs in dp order")


def sequences_of(params: Any) -> int:
    """The sequences one prompt becomes: its n (SamplingParams or a dict), 1 without params."""
    if params is None:
        return 1
    n = params.get("n", 1) if isinstance(params, Mapping) else getattr(params, "n", 1)
    return n if isinstance(n, int) and n > 0 else 1


def pick_replicas(loads: Mapping[int, int], costs: Sequence[int],
                  excluded: Sequence[set[int]]) -> list[int | None]:
    """For each prompt in order, the replica (index) with the fewest outstanding sequences, counting
    the prompts placed before it; ties go to the lowest index. `excluded[j]`: replicas prompt j may not
    use (those it already failed on). None where no replica is left for it."""
    load = dict(loads)
    picks: list[int | None] = []
    for cost, skip in zip(costs, excluded):
        choices = [i for i in sorted(load) if i not in skip]
        if not choices:
            picks.append(None)
            continue
        best = min(choices, key=lambda i: load[i])
        load[best] += cost
        picks.append(best)
    return picks


def admissible(states: Mapping[int, dict[str, Any]]) -> tuple[int | None, dict[int, str]]:
    """First contact: (the newest target version among healthy, untorn replicas, {index: why it is not
    admitted}) from each reachable replica's /state."""
    def servable(s: dict[str, Any]) -> bool:
        return bool(s.get("healthy")) and not s.get("torn", {}).get("target", False)

    versions = {i: int(s.get("weight_versions", {}).get("target", 0)) for i, s in states.items() if servable(s)}
    newest = max(versions.values(), default=None)
    out: dict[int, str] = {}
    for i, s in states.items():
        if not s.get("healthy"):
            out[i] = f"unhealthy: {s.get('failure')}"
        elif i not in versions:
            out[i] = "its target weights are torn (a sync failed); the next good sync re-admits it"
        elif versions[i] != newest:
            out[i] = f"serves version {versions[i]}, the fleet's newest is {newest}; the next good sync re-admits it"
    return newest, out


@dataclass
class SyncOutcome:
    """One sync of the fleet, per replica: passed (its audit), failed (why) or missed (why)."""

    model: str
    version: int
    passed: dict[int, dict[str, Any]] = field(default_factory=dict)
    failed: dict[int, str] = field(default_factory=dict)
    missed: dict[int, str] = field(default_factory=dict)


def sync_report(outcome: SyncOutcome, replicas: Sequence[Replica]) -> dict[str, Any]:
    """The fleet's audit: "ok" when at least one replica holds the version (the fleet serves it);
    "ranks" every passing rank as dp{i}:pp{j}:tp{k}; per replica its verdict; "out_of_rotation" every
    replica out after this sync with its reason; "table" one line per replica that is not serving."""
    rows, ranks, table = [], [], []
    checked = installed = 0  # installed: FP8 tensors the ranks checked against the sender's rule before going live
    for r in replicas:
        if r.index in outcome.passed:
            audit = outcome.passed[r.index]
            keys = [fleet_rank_key(r.index, k) for k in audit.get("ranks", [])]
            installed += int(audit.get("installed_checked", 0))
            ranks += keys
            checked += int(audit.get("tensors_checked", 0))
            rows.append({"replica": r.name, "url": r.url, "ok": True, "ranks": keys, "summary": audit.get("summary")})
            continue
        why = outcome.failed.get(r.index) or outcome.missed.get(r.index)
        if why is None:
            continue  # not asked (a draft sync skips replicas a target sync took out)
        kind = "audit failed" if r.index in outcome.failed else "missed the sync"
        rows.append({"replica": r.name, "url": r.url, "ok": False, "ranks": r.fleet_keys(),
                     "summary": f"{kind}: {why}"})
        table.append(f"{r.label}  {kind}: {why}")
    algorithm = next((a.get("algorithm") for a in outcome.passed.values()), None)
    out = {r.name: str(r.reason) for r in replicas if not r.in_rotation}
    summary = (f"{len(outcome.passed)} of {len(rows)} replica(s) hold {outcome.model} version {outcome.version}"
               + (f"; out of rotation: {', '.join(out)}" if out else ""))
    return {"ok": bool(outcome.passed), "model": outcome.model, "version": outcome.version, "algorithm": algorithm,
            "ranks": ranks, "tensors_checked": checked, "replicas": rows, "out_of_rotation": out,
            "summary": summary, "table": "\n".join(table), "installed_checked": installed}
