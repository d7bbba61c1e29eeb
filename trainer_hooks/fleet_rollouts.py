"""A fleet's partial rollouts: the rollout pools of its replicas used as one pool (docs/async-rl.md).

`FleetPools` keeps the groups its Fleet submitted and has not taken, keyed (pool, replica, group id),
with what placing one again needs. Its invariants:
- A new group goes to the replica in rotation with the fewest sequences outstanding (its generate
  calls' and its pooled groups'); the fleet's id of a group is "dp{i}/{id}".
- A take takes exactly the groups chosen, so the others stay in their sidecar: oldest first across
  replicas for rollouts() (groups this fleet did not submit first, then this fleet's order), each
  replica's completion order for a stream.
- A replica that goes away is taken out of rotation and this fleet's groups on it are submitted again
  elsewhere, each with its sync policy (their samples were never returned).
It reaches its Fleet only through `PoolHost`, so it imports no fleet module but fleet_replicas.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any, Protocol

from inference.core import RequestOutput
from trainer_hooks.fleet_replicas import FleetGoneError, Replica, pick_replicas, sequences_of
from trainer_hooks.rollout_pool import TAKE_MARGIN_S, RolloutStream, RolloutTake
from trainer_hooks.sync import GONE

FLEET_POLL_S = 2.0  # the longest a stream's long poll waits on one replica (so closing the fleet waits no longer)
_COUNTS = ("pending", "finished", "leased", "failed", "sequences")


class PoolHost(Protocol):
    """What the pools use of their Fleet (trainer_hooks/fleet.py): its replicas and their lock, its
    threads, its weight version, and how it takes a replica out of rotation."""

    replicas: list[Replica]
    version: int | None
    pool: ThreadPoolExecutor
    lock: threading.Lock

    def each(self, replicas: Sequence[Replica], fn: Callable[[Replica], Any]) -> dict[int, Any]: ...

    def take_out(self, replica: Replica, reason: str) -> None: ...

    def reasons(self, head: str, why: Mapping[int, Any]) -> str: ...


@dataclasses.dataclass(frozen=True)
class _Pooled:
    """A group this fleet submitted to a replica's pool and has not taken: what placing it again needs."""

    order: int
    prompt: Any
    params: Any
    policy: tuple[tuple[str, Any], ...] = ()  # on_sync, max_staleness as submitted


class FleetPools:
    """See the module docstring. `placed` is changed under the host's lock."""

    def __init__(self, host: PoolHost) -> None:
        self.host = host
        self.placed: dict[tuple[str, int, str], _Pooled] = {}  # (pool, replica, group id): groups not taken
        self._order = itertools.count()  # the fleet's submission order of pooled groups

    def rollouts(self, pool: str, prompts: list[Any], params: list[Any], policy: dict[str, Any], *,
                 min_groups: int, max_groups: int | None, timeout_s: float, poll_s: float) -> RolloutTake:
        """Fleet.rollouts: place the prompts, poll the replicas' counts every `poll_s` until `min_groups`
        are finished (or none is unfinished, or timeout_s passed), then take the oldest ones."""
        submitted = self.start(pool, prompts, params, policy)
        limit = max_groups if max_groups is not None else (min_groups or None)
        deadline = time.monotonic() + timeout_s
        while True:
            finished, counts, failing = self.status(pool)
            if len(finished) >= min_groups or not counts["pending"] or time.monotonic() >= deadline:
                break
            time.sleep(poll_s)
        take = self.take(pool, sorted(finished)[:limit], counts, failing)
        take.submitted = submitted
        return take

    def iter_rollouts(self, pool: str, prompts: list[Any], params: list[Any], policy: dict[str, Any], *,
                      count: int, timeout_s: float) -> RolloutStream:
        """Fleet.iter_rollouts: place the prompts, then stream the groups as they finish (_StreamRounds)."""
        submitted = self.start(pool, prompts, params, policy)
        return RolloutStream(_StreamRounds(self, pool).take, count, timeout_s, submitted)

    def start(self, pool: str, prompts: list[Any], params: list[Any], policy: dict[str, Any]) -> list[str]:
        """What a partial call does first: acknowledge the last call's groups (they are used, so they leave
        their sidecars), then place the new prompts (one params per prompt)."""
        self.ack(pool)
        return self.submit(pool, [(next(self._order), p, sp) for p, sp in zip(prompts, params)], policy)

    def ack(self, pool: str) -> int:
        """Fleet.ack_rollouts: SidecarClient.ack_rollouts on every replica this fleet took from (or never
        did: a new consumer ends that replica's leases of the pool, a dead predecessor's)."""
        polled = self.polled(pool)
        owing = [r for r in polled if r.client.tickets.held(pool) != []]
        found = self.host.each(owing, lambda r: r.client.ack_rollouts(pool))
        for got in found.values():
            if isinstance(got, BaseException) and not isinstance(got, GONE):
                raise got
        return sum(got for got in found.values() if isinstance(got, int))

    def cancel(self, pool: str, group_ids: Sequence[str] | None) -> dict[str, Any]:
        """Fleet.cancel_rollouts: by fleet ids ("dp{i}/{id}"); None: the whole pool on every replica."""
        replicas = self.host.replicas
        named: dict[int, list[str]] | None = None
        unknown: list[str] = []
        if group_ids is not None:
            named = {}
            by_name = {r.name: r.index for r in replicas}
            for gid in group_ids:
                name, _, local = gid.partition("/")
                if name in by_name and local:
                    named.setdefault(by_name[name], []).append(local)
                else:
                    unknown.append(gid)
        targets = list(replicas) if named is None else [replicas[i] for i in named]
        found = self.host.each(targets, lambda r: r.client.cancel_rollouts(
            None if named is None else named[r.index], pool=pool))
        cancelled: list[str] = []
        for i, got in found.items():
            if isinstance(got, BaseException):
                if not isinstance(got, GONE):
                    raise got
                continue
            name = replicas[i].name
            cancelled += [f"{name}/{gid}" for gid in got["cancelled"]]
            unknown += [f"{name}/{gid}" for gid in got["unknown"]]
            with self.host.lock:
                for gid in got["cancelled"]:
                    self.placed.pop((pool, i, gid), None)
        return {"cancelled": cancelled, "unknown": unknown}

    def submit(self, pool: str, entries: list[tuple[int, Any, Any]], policy: dict[str, Any] | None = None) -> list[str]:
        """Place (order, prompt, params) entries, one POST /rollouts per replica; a replica that went away
        is taken out and its entries placed again. The fleet's ids of the groups, in entry order."""
        host, ids = self.host, {}
        while entries:
            with host.lock:
                loads = {r.index: r.outstanding + self._load(r.index) for r in host.replicas if r.in_rotation}
            picks = pick_replicas(loads, [sequences_of(sp) for _, _, sp in entries], [set()] * len(entries))
            if not loads or any(p is None for p in picks):
                raise FleetGoneError(host.reasons("no replica is left in rotation for rollouts",
                                                  {r.index: r.reason for r in host.replicas}))
            placed: dict[int, list[tuple[int, Any, Any]]] = {}
            for entry, p in zip(entries, picks):
                placed.setdefault(int(p), []).append(entry)  # type: ignore[arg-type]
            found = host.each([host.replicas[i] for i in placed], lambda r, placed=placed: r.client.submit_rollouts(
                [e[1] for e in placed[r.index]], [e[2] for e in placed[r.index]], pool=pool, **(policy or {})))
            entries = []
            for i, got in found.items():
                if isinstance(got, GONE):
                    host.take_out(host.replicas[i], f"went away at a rollout submission: {got}")
                    entries += placed[i]
                    continue
                if isinstance(got, BaseException):
                    raise got
                with host.lock:
                    for (order, prompt, sp), gid in zip(placed[i], got):
                        self.placed[(pool, i, gid)] = _Pooled(order, prompt, sp, tuple(sorted((policy or {}).items())))
                        ids[order] = f"{host.replicas[i].name}/{gid}"
        return [ids[o] for o in sorted(ids)]

    def _load(self, index: int) -> int:
        return sum(sequences_of(g.params) for (_, i, _), g in self.placed.items() if i == index)

    def polled(self, pool: str) -> list[Replica]:
        """The replicas a call on `pool` asks: those in rotation, and any holding groups this fleet placed."""
        with self.host.lock:
            holding = {i for (p, i, _) in self.placed if p == pool}
            return [r for r in self.host.replicas if r.in_rotation or r.index in holding]

    def status(self, pool: str) -> tuple[list[tuple[tuple[int, int, int], int, str]], dict[str, int], set[int]]:
        """Every replica's finished groups of `pool`, as (order key, replica, group id), the summed counts
        and the replicas holding failed groups. A replica that went away is taken out and this fleet's
        groups on it placed again."""
        found = self.host.each(self.polled(pool), lambda r: r.client.rollout_counts(pool))
        finished, counts, failing = [], dict.fromkeys(_COUNTS, 0), set()
        for i, got in found.items():
            if isinstance(got, BaseException):
                if not isinstance(got, GONE):
                    raise got
                counts["pending"] += self.lost(pool, i, f"went away while generating rollouts: {got}")
                continue
            for key in counts:
                counts[key] += int(got[key])
            if got["failed"]:
                failing.add(i)
            for pos, gid in enumerate(got["finished_ids"]):
                mine = self.placed.get((pool, i, gid))
                finished.append(((1, mine.order, 0) if mine is not None else (0, pos, i), i, gid))
        return finished, counts, failing

    def lost(self, pool: str, index: int, reason: str) -> int:
        """Take a replica that went away out; place this fleet's groups on it again (how many)."""
        host = self.host
        with host.lock:
            lost = sorted(((g.order, g.prompt, g.params), g.policy) for (p, i, gid), g in list(self.placed.items())
                          if p == pool and i == index and self.placed.pop((p, i, gid)))
        if host.replicas[index].in_rotation:
            host.take_out(host.replicas[index], reason)
        for policy in dict.fromkeys(policy for _, policy in lost):  # each group keeps its sync policy
            self.submit(pool, [entry for entry, its in lost if its == policy], dict(policy))
        return len(lost)

    def take(self, pool: str, chosen: list[tuple[Any, int, str]], counts: dict[str, int], failing: set[int],
             ack: bool = True) -> RolloutTake:
        """Take exactly the `chosen` groups (and report every failed one), in the chosen order; `ack`: as
        SidecarClient.take_rollouts' (a stream's takes leave their predecessors unacknowledged)."""
        host = self.host
        wanted: dict[int, list[str]] = {i: [] for i in failing}
        for _, i, gid in chosen:
            wanted.setdefault(i, []).append(gid)
        found = host.each([host.replicas[i] for i in wanted], lambda r: r.client.take_rollouts(
            0, None, pool=pool, timeout_s=0.0, group_ids=wanted[r.index], ack=ack))
        outputs: dict[tuple[int, str], RequestOutput] = {}
        failed: dict[str, str] = {}
        for i, got in found.items():
            if isinstance(got, BaseException):
                if not isinstance(got, GONE):
                    raise got
                self.lost(pool, i, f"went away at a rollout take: {got}")
                continue
            name = host.replicas[i].name
            failed.update({f"{name}/{gid}": why for gid, why in got.failed.items()})
            with host.lock:
                for gid in [o.request_id for o in got.groups] + list(got.failed):
                    self.placed.pop((pool, i, gid), None)
            for o in got.groups:
                outputs[(i, o.request_id)] = dataclasses.replace(
                    o, request_id=f"{name}/{o.request_id}", metrics={**o.metrics, "replica": i})
        groups = [outputs[(i, gid)] for _, i, gid in chosen if (i, gid) in outputs]
        left = {**counts, "finished": counts["finished"] - len(groups), "failed": 0,
                "leased": counts["leased"] + len(groups)}
        return RolloutTake(groups, host.version, failed, left)


class _StreamRounds:
    """The rounds of a fleet's stream of one pool: at most one long poll in flight per replica (a round
    waits for the first answer; the others stay in flight for the next round), and the last counts each
    replica answered, whose sum says when nothing is left to wait for. A replica that answered with
    nothing unfinished or finished is not asked again (it would answer at once, every round); one whose
    poll is still in flight counts as generating."""

    def __init__(self, pools: FleetPools, pool: str) -> None:
        self.pools, self.pool = pools, pool
        self.polls: dict[int, Future] = {}
        self.counts: dict[int, dict[str, int]] = {}

    def take(self, max_groups: int, wait_s: float, first: bool) -> RolloutTake:
        pools, pool = self.pools, self.pool
        slice_s = min(wait_s, FLEET_POLL_S)
        for r in pools.polled(pool):
            last = self.counts.get(r.index)
            if r.index not in self.polls and (last is None or last["pending"] or last["finished"]):
                self.polls[r.index] = pools.host.pool.submit(r.client.rollout_counts, pool, wait_s=slice_s,
                                                             order="completed")
        if self.polls:
            wait_futures(list(self.polls.values()), timeout=slice_s + TAKE_MARGIN_S, return_when=FIRST_COMPLETED)
        finished: list[tuple[Any, int, str]] = []
        failing: set[int] = set()
        lost = 0
        for i, fut in [(i, f) for i, f in self.polls.items() if f.done()]:
            del self.polls[i]
            try:
                got = fut.result()
            except GONE as e:
                self.counts.pop(i, None)
                lost += pools.lost(pool, i, f"went away while generating rollouts: {e}")
                if lost:
                    self.counts = {}  # its groups went to other replicas: ask every one again
                continue
            self.counts[i] = {k: int(got[k]) for k in _COUNTS}
            if got["failed"]:
                failing.add(i)
            finished += [((0, pos, i), i, gid) for pos, gid in enumerate(got["finished_ids"])]
        counts = {k: sum(c[k] for c in self.counts.values()) for k in _COUNTS}
        counts["pending"] += lost + sum(not self.counts.get(i, {}).get("pending") for i in self.polls)
        take = pools.take(pool, finished[:max_groups], counts, failing, ack=False)
        for o in take.groups:  # what the next answer of its replica will say
            self.counts[o.metrics["replica"]]["finished"] -= 1
        return take
