"""`Fleet`: several sidecar replicas behind one trainer, used wherever a SidecarClient is.

`Fleet([url, ...])` has the client's API that `WeightSyncHook` uses (state, sleep, wake_up,
sync_weights, generate, rollouts), over every replica at once. Its invariants:
- One weight version across the fleet: rollouts go only to replicas in rotation, and a replica is in
  rotation only while it holds the fleet's version. One that fails its audit, misses a sync, dies or
  answers with another version is taken out with its reason, and its next good sync re-admits it.
- A sync is one transfer group of every rank of every member, on trainer_hooks/sync.py's choreography
  (the one a SidecarClient runs); each verdict is the replica's own (docs/fleet.md, "How a sync works").
- sleep, wake_up and generate fail only when no replica is left for them; the others keep serving.
- rotation() and metrics_text() read what the fleet holds without contacting a replica.
Replica i is named "dp{i}" (its position in the list; fleet_replicas.py). Imports neither torch nor
httpx at module level (clients are built from URLs on first use; `sidecar status` builds a Fleet).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any

from inference.core import InvalidRequestError, RequestOutput, SidecarError
from trainer_hooks.client_errors import SidecarRequestError, SidecarStateError
from trainer_hooks.fleet_replicas import (
    FleetError,
    FleetGoneError,
    FleetSyncError,
    Replica,
    SyncOutcome,
    admissible,
    check_dp_ranks,
    pick_replicas,
    sequences_of,
    sync_report,
)
from trainer_hooks.fleet_rollouts import FleetPools
from trainer_hooks.rollout_pool import DEFAULT_POOL, RolloutStream, RolloutTake, sync_fields
from trainer_hooks.sync import GONE, FleetGroup, StepFailed

__all__ = ["Fleet", "FleetError", "FleetGoneError"]


class Fleet:
    """See the module docstring. `replicas`: URLs (or SidecarClient-like objects, used as given).

    sleep and wake_up go to every replica concurrently, out-of-rotation ones too (a restarted replica
    must free its memory with the rest). A replica whose call fails is taken out of rotation; the call
    fails only when every replica fails (with the first one's error; FleetGoneError if all are gone).
    """

    def __init__(self, replicas: Iterable[str | Any], api_key: str | None = None, *, timeout: float = 30.0,
                 long_timeout: float = 900.0, retries: int = 1, max_retries: int = 1) -> None:
        items = list(replicas)
        if not items:
            raise InvalidRequestError("replicas", "a fleet needs at least one replica URL")
        if max_retries < 0:
            raise InvalidRequestError("max_retries", f"must be >= 0, got {max_retries}")
        clients = [self._client(x, api_key, timeout, long_timeout, retries) for x in items]
        self.replicas = [Replica(i, c) for i, c in enumerate(clients)]
        self.max_retries = max_retries
        self.version: int | None = None  # the fleet's weight version; None until first contact finds one
        self.lock = threading.Lock()  # rotation, outstanding counts, version, the pools' placed groups
        self._contacted = False
        self.pool = ThreadPoolExecutor(max(4, 4 * len(items)), thread_name_prefix="fleet")
        self.pools = FleetPools(self)  # partial rollouts: the replicas' rollout pools as one
        self._group = FleetGroup(self.pool)

    @staticmethod
    def _client(item: str | Any, api_key: str | None, timeout: float, long_timeout: float, retries: int) -> Any:
        if not isinstance(item, str):
            return item
        from trainer_hooks.client import SidecarClient  # httpx only when a fleet is built from URLs

        return SidecarClient(item, api_key, timeout, long_timeout=long_timeout, retries=retries)

    def close(self) -> None:
        """Close the transfer group this fleet built and every client (the replicas keep running)."""
        self._group.close()
        self.pool.shutdown(wait=True)
        for r in self.replicas:
            close = getattr(r.client, "close", None)
            if close is not None:
                close()

    def release_sender(self) -> None:
        """Close the sender the fleet built from the hook's maker (the next sync builds a new one)."""
        self._group.close()

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- rotation -------------------------------------------------------------------------------
    @property
    def in_rotation(self) -> list[int]:
        with self.lock:
            return [r.index for r in self.replicas if r.in_rotation]

    def take_out(self, replica: Replica, reason: str) -> None:
        with self.lock:
            replica.take_out(reason)

    def each(self, replicas: Sequence[Replica], fn: Callable[[Replica], Any]) -> dict[int, Any]:
        """fn(replica) for every replica concurrently: {index: result, or the exception it raised}."""
        futures = {r.index: self.pool.submit(fn, r) for r in replicas}
        return {i: (f.exception() if f.exception() is not None else f.result()) for i, f in futures.items()}

    def probe(self, replicas: Sequence[Replica] | None = None) -> dict[int, dict[str, Any] | BaseException]:
        """Every replica's /state (or the error reaching it), concurrently; records its ranks and takes
        out one that restarted while in rotation (its weights are the checkpoint's again)."""
        targets = list(self.replicas if replicas is None else replicas)
        found = self.each(targets, lambda r: r.client.state())
        for r in targets:
            s = found[r.index]
            if isinstance(s, BaseException):
                if not isinstance(s, SidecarError):
                    raise s
                continue
            ranks = s.get("ranks", [])
            keys, pids = tuple(str(x.get("rank")) for x in ranks), tuple(int(x.get("pid") or 0) for x in ranks)
            with self.lock:
                if r.pids and pids != r.pids and r.in_rotation:
                    r.take_out("restarted (new rank processes); the next good sync re-admits it")
                r.rank_keys, r.pids = keys, pids
            check_dp_ranks(r)
        self._first_contact(targets, found)
        return found

    def _first_contact(self, probed: Sequence[Replica], found: Mapping[int, Any]) -> None:
        """Admit, once, the replicas that serve the newest healthy version (fleet_replicas.admissible)."""
        states = {i: s for i, s in found.items() if not isinstance(s, BaseException)}
        if self._contacted or len(probed) != len(self.replicas) or not states:
            return  # with none reachable, first contact waits for one
        newest, out = admissible(states)
        with self.lock:
            self._contacted = True
            self.version = newest
            for r in self.replicas:
                if r.index in out:
                    r.take_out(out[r.index])
                elif r.index not in states:
                    r.take_out(f"unreachable: {found[r.index]}")
                else:
                    r.admit(newest)

    def _contact(self) -> None:
        if not self._contacted:
            self.probe()

    def settle_sync(self, model: str, version: int, passed: Collection[int], out: Mapping[int, str]) -> None:
        """After a sync: a target sync admits every replica that passed and sets the fleet's version; any
        sync takes out the replicas in `out`."""
        with self.lock:
            for r in self.replicas:
                if r.index in out:
                    r.take_out(out[r.index])
                elif model == "target" and r.index in passed:
                    r.admit(version)
            if model == "target" and passed:
                self.version = version

    # ---- what the hook calls -----------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """A fleet's /state as the hook reads it: the newest target version, the transfer settings, and
        `replicas` (status())."""
        found = self.probe()
        states = [s for s in found.values() if not isinstance(s, BaseException)]
        if not states:
            raise FleetGoneError(self.reasons("every replica is unreachable", found))
        backends = {s.get("transfer", {}).get("backend") for s in states} - {None}
        if len(backends) > 1:
            raise FleetError(f"the replicas were launched with different --transfer backends: {sorted(backends)}")
        versions = [int(s.get("weight_versions", {}).get("target", 0)) for s in states]
        return {"healthy": all(s.get("healthy") for s in states) and len(states) == len(self.replicas),
                "weight_versions": {"target": max(versions)},
                # what a new hook attaching to the fleet takes over: asleep if any replica sleeps, the
                # weights dropped if any dropped them (a sync refills every member)
                "sleeping": any(s.get("sleeping") for s in states),
                "tags": {"weights": _weights_state(states)},
                "torn": {"target": all(s.get("torn", {}).get("target") for s in states)},
                "transfer": {"backend": next(iter(backends), None),
                             "bucket_bytes": states[0].get("transfer", {}).get("bucket_bytes"),
                             "num_receivers": sum(len(s.get("ranks", [])) for s in states)},
                "replicas": self._rows(found)}

    def checksums(self, model: str = "target", source: str = "held",
                  algorithm: str | None = None) -> list[dict[str, Any]]:
        """Every rank's manifest of every replica in rotation (SidecarClient.checksums on each)."""
        self._contact()
        rotating = [r for r in self.replicas if r.in_rotation]
        if not rotating:
            raise FleetGoneError(self.reasons("no replica in rotation", {r.index: r.reason for r in self.replicas}))
        found = self.each(rotating, lambda r: r.client.checksums(model, source, algorithm))
        for e in found.values():
            if isinstance(e, BaseException):
                raise e
        return [m for r in rotating for m in found[r.index]]

    def status(self) -> list[dict[str, Any]]:
        """One row per replica: name, url, reachable, healthy, version, torn, sleeping, in_rotation, reason,
        outstanding (this fleet's), queued_sequences (the replica's), ranks (fleet keys)."""
        return self._rows(self.probe())

    def _rows(self, found: Mapping[int, Any]) -> list[dict[str, Any]]:
        rows = []
        with self.lock:
            for r in self.replicas:
                s = found.get(r.index)
                ok = isinstance(s, dict)
                st: dict[str, Any] = s if isinstance(s, dict) else {}
                rows.append({"replica": r.name, "url": r.url, "reachable": ok, "healthy": bool(st.get("healthy")),
                             "error": None if ok else str(s), "version": st.get("weight_versions", {}).get("target"),
                             "torn": st.get("torn", {}).get("target"), "sleeping": st.get("sleeping"),
                             "in_rotation": r.in_rotation, "reason": r.reason, "outstanding": r.outstanding,
                             "queued_sequences": st.get("queued_sequences"), "ranks": r.fleet_keys()})
        return rows

    def rotation(self) -> list[dict[str, Any]]:
        """What this fleet itself holds of each replica, read without contacting any: replica, url,
        in_rotation, reason, version (the target version it was admitted at), outstanding, ranks (how
        many), and the counters times_out, retried (prompts moved off it) and served (sequences)."""
        with self.lock:
            return [{"replica": r.name, "url": r.url, "in_rotation": r.in_rotation, "reason": r.reason,
                     "version": r.version, "outstanding": r.outstanding, "ranks": len(r.rank_keys),
                     "times_out": r.times_out, "retried": r.retried, "served": r.served} for r in self.replicas]

    def metrics_text(self) -> str:
        """rotation() and the fleet's version in Prometheus' text format (trainer_hooks/fleet_metrics.py;
        needs prometheus-client). To serve them, register `FleetCollector(fleet)` instead."""
        from trainer_hooks.fleet_metrics import metrics_text

        return metrics_text(self)

    def sleep(self, level: int = 1, in_flight: str = "finish", *, timeout: float | None = None) -> dict[str, Any]:
        return self._control("sleep", lambda r: r.client.sleep(level, in_flight, timeout=timeout))

    def wake_up(self, tags: list[str] | None = None, *, timeout: float | None = None) -> dict[str, Any]:
        """Wake every replica; one that was awake already (a 409 "nothing is asleep", e.g. a replica
        restarted while the others slept, met by a new hook attaching) is awake, not a failure."""
        def wake(r: Replica) -> Any:
            try:
                return r.client.wake_up(tags, timeout=timeout)
            except SidecarStateError:
                if r.client.state().get("sleeping"):
                    raise
                return {"skipped": "awake already"}

        return self._control("wake_up", wake)

    def _control(self, what: str, fn: Callable[[Replica], Any]) -> dict[str, Any]:
        """fn on every replica; failures take their replica out (the class docstring)."""
        self._contact()
        found = self.each(self.replicas, fn)
        errors = {i: e for i, e in found.items() if isinstance(e, BaseException)}
        for e in errors.values():
            if not isinstance(e, SidecarError):
                raise e
        if len(errors) == len(self.replicas):
            if all(isinstance(e, GONE) for e in errors.values()):
                raise FleetGoneError(self.reasons(f"{what}: every replica is gone", errors))
            raise next(iter(errors.values()))
        for i, e in errors.items():
            self.take_out(self.replicas[i], f"{what} failed: {e}")
        return {"replicas": {self.replicas[i].name: v for i, v in found.items() if i not in errors},
                "failed": {self.replicas[i].name: str(e) for i, e in errors.items()}}

    def sync_weights(self, sender: Any, named_tensors: Mapping[str, Any] | Iterable[tuple[str, Any]],
                     version: int, model: str = "target", *, allow_cast: bool = False) -> dict[str, Any]:
        """One sync of every reachable replica through one transfer group. `sender`: a callable
        num_receivers -> WeightSender (the fleet builds one per membership and owns it, because the
        receivers follow the replicas that take part), or a WeightSender whose num_receivers fits the
        replicas' ranks. Returns the fleet's audit (fleet_replicas.sync_report); raises FleetGoneError
        when no replica could take part.

        Members: the replicas that answer /state healthy when the sync starts (a draft sync asks only
        those in rotation: it can take one out, never admit one). A member that goes away before its
        audit, or refuses the start while others accept it, is dropped and the sync runs again at once
        without it, in a fresh group; a start every member refuses is raised as is; a wire failure with
        every member alive is a FleetSyncError naming each replica's error. An audit mismatch fails that
        replica only, and once any replica audited nothing runs again."""
        self._contact()
        named = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        missed: dict[int, str] = {}
        while True:
            try:
                members = self._members(missed, model)
            except FleetGoneError:
                self.settle_sync(model, version, (), {i: f"missed the sync of {model} v{version}: {why}"
                                                      for i, why in missed.items()})
                raise
            try:
                outcome = self._group.sync(sender, members, named, version, model, allow_cast)
                break
            except StepFailed as failed:
                missed.update(self._lost(failed, members))
        return self._settled(outcome, missed)

    def _settled(self, outcome: SyncOutcome, missed: Mapping[int, str]) -> dict[str, Any]:
        model, version = outcome.model, outcome.version
        outcome.missed.update(missed)
        out = {i: f"failed its audit of {model} v{version}: {why}" for i, why in outcome.failed.items()}
        out.update({i: f"missed the sync of {model} v{version}: {why}" for i, why in outcome.missed.items()})
        self.settle_sync(model, version, outcome.passed, out)
        report = sync_report(outcome, self.replicas)
        if not outcome.passed and not outcome.failed:
            raise FleetGoneError(f"no replica took the sync of {model} v{version}:\n  {report['table']}")
        return report

    def _members(self, missed: dict[int, str], model: str) -> list[Replica]:
        """The replicas that take part; the unreachable and unhealthy ones are added to `missed`."""
        found = self.probe()
        members = []
        for r in self.replicas:
            state = found[r.index]
            if r.index in missed:
                continue
            if isinstance(state, BaseException):
                missed[r.index] = f"unreachable: {state}"
            elif not state.get("healthy"):
                missed[r.index] = f"unhealthy: {state.get('failure')}"
            elif model == "target" or r.in_rotation:
                members.append(r)
        if not members:
            raise FleetGoneError(self.reasons(f"no replica can take the sync of {model}", missed))
        return members

    def _lost(self, failed: StepFailed, members: Sequence[Replica]) -> dict[int, str]:
        """The members to drop after a failed step ({index: why}): those that went away, else those that
        refused the start others took. Raises the start's error when every member refused it, and a
        FleetSyncError naming each replica's error when every member is alive and willing."""
        for e in failed.errors.values():
            if not isinstance(e, SidecarError):
                raise e
        step, errors = failed.step, failed.errors
        gone = {i: f"went away at {step}: {e}" for i, e in errors.items() if isinstance(e, GONE)}
        if not gone:
            found = self.probe(members)  # a member that died may have left the others only a timeout
            gone = {r.index: f"went away at {step}: {found[r.index]}" for r in members
                    if isinstance(found[r.index], BaseException) or not found[r.index].get("healthy")}
        refused = {i: e for i, e in errors.items() if isinstance(e, SidecarRequestError)}
        if not gone and refused:
            if len(refused) == len(members):
                raise next(iter(refused.values()))  # every replica refuses this manifest: the trainer's problem
            gone = {i: f"refused the start: {e}" for i, e in refused.items()}
        if gone:
            return gone
        named: dict[str, BaseException] = {self.replicas[i].label: e for i, e in errors.items()}
        if failed.local is not None:
            named["sender"] = failed.local
        raise FleetSyncError(f"the {step} step of the fleet's sync failed", named)

    # ---- rollouts -----------------------------------------------------------------------------------
    def generate(self, prompts: Any, sampling_params: Any = None, *, wait: bool = True,
                 timeout: float | None = None, on_sync: str | None = None,
                 max_staleness: int | None = None) -> list[RequestOutput]:
        """RequestOutputs in prompt order; each output's metrics has "replica" (its dp index) and "retries".

        Each prompt, with its n samples, goes to the replica with the fewest outstanding sequences; one
        call per replica, concurrently. A replica that dies mid-request (connection lost, 503) or answers
        with another weight version is taken out and its unfinished prompts go to the others at once,
        each at most `max_retries` times; the call fails only when no replica is left for a prompt. A
        replica's answer is stale when an output's newest tokens come from another version than the
        fleet's (with on_sync keep or recompute an output may begin under an older one).
        on_sync, max_staleness: SidecarClient.generate's."""
        self._contact()
        items = _prompt_list(prompts)
        params = _params_list(sampling_params, len(items))
        call = _Rollout(items, params, wait, timeout, sync_fields(on_sync, max_staleness))
        running: dict[Future, tuple[Replica, list[int]]] = {}
        self._dispatch(call, range(len(items)), running)
        while running:
            done, _ = wait_first(running)
            replica, idxs = running.pop(done)
            error = done.exception()
            if isinstance(error, GONE):
                self._retry_elsewhere(call, replica, idxs, running, f"died mid-request: {error}")
                continue
            if error is not None:
                raise error
            outs = done.result()
            stale = self.version is not None and any(_newest_version(o) != self.version for o in outs)
            if stale:
                got = sorted({_newest_version(o) for o in outs})
                self._retry_elsewhere(call, replica, idxs, running,
                                      f"answered with weight version {got}, the fleet's is {self.version}")
                continue
            with self.lock:
                replica.served += sum(call.costs[i] for i in idxs)
            for i, o in zip(idxs, outs):
                call.results[i] = dataclasses.replace(
                    o, request_id=str(i), metrics={**o.metrics, "replica": replica.index,
                                                   "retries": len(call.tried[i]) - 1})
        return [o for o in call.results if o is not None]

    # ---- partial rollouts: the replicas' rollout pools as one (trainer_hooks/fleet_rollouts.py) --------------
    def rollouts(self, prompts: Any, sampling_params: Any = None, *, min_groups: int, max_groups: int | None = None,
                 pool: str = DEFAULT_POOL, timeout_s: float = 600.0, poll_s: float = 0.05,
                 on_sync: str | None = None, max_staleness: int | None = None) -> RolloutTake:
        """SidecarClient.rollouts over the fleet: each prompt becomes a group in `pool` of the replica in
        rotation with the fewest sequences outstanding; the call returns once `min_groups` groups are
        finished on the replicas together (or none is unfinished, or after timeout_s), at most
        `max_groups` (default min_groups), oldest first across replicas: groups this fleet did not submit
        (a dead trainer's) first, then in the order this fleet submitted them. Group ids read
        "dp{i}/{id}". The fleet reads the replicas' pools every `poll_s` and takes exactly the groups it
        chose, so the others stay in their sidecar. A replica that goes away is taken out and the groups
        this fleet placed there are submitted again elsewhere (their samples were never returned)."""
        items, per = self._pooled_call(prompts, sampling_params)
        return self.pools.rollouts(pool, items, per, sync_fields(on_sync, max_staleness), min_groups=min_groups,
                                   max_groups=max_groups, timeout_s=timeout_s, poll_s=poll_s)

    def iter_rollouts(self, prompts: Any, sampling_params: Any = None, *, count: int, pool: str = DEFAULT_POOL,
                      timeout_s: float = 600.0, on_sync: str | None = None,
                      max_staleness: int | None = None) -> RolloutStream:
        """SidecarClient.iter_rollouts over the fleet: groups placed as rollouts() places them, then yielded
        as they finish. Each round long-polls every replica that may hold one (GET with wait_s, at most
        one in flight per replica) and takes the finished groups of those that answered, each replica's in
        its completion order; a replica that goes away is handled as rollouts() does."""
        items, per = self._pooled_call(prompts, sampling_params)
        return self.pools.iter_rollouts(pool, items, per, sync_fields(on_sync, max_staleness), count=count,
                                        timeout_s=timeout_s)

    def ack_rollouts(self, pool: str = DEFAULT_POOL) -> int:
        """SidecarClient.ack_rollouts on every replica this fleet took from (or never did: a new consumer
        ends that replica's leases of the pool, a dead predecessor's). Groups removed."""
        return self.pools.ack(pool)

    def cancel_rollouts(self, group_ids: Sequence[str] | None = None, *, pool: str = DEFAULT_POOL) -> dict[str, Any]:
        """SidecarClient.cancel_rollouts over the replicas, by fleet ids ("dp{i}/{id}"); None: the whole pool
        on every replica. {"cancelled": [ids], "unknown": [ids]}."""
        return self.pools.cancel(pool, group_ids)

    def _pooled_call(self, prompts: Any, sampling_params: Any) -> tuple[list[Any], list[Any]]:
        """A partial call's prompts and one params per prompt, after first contact."""
        self._contact()
        items = _prompt_list(prompts)
        per = _params_list(sampling_params, len(items))
        return items, per if isinstance(per, list) else [per] * len(items)

    def _retry_elsewhere(self, call: _Rollout, replica: Replica, idxs: list[int],
                         running: dict[Future, tuple[Replica, list[int]]], reason: str) -> None:
        with self.lock:
            replica.take_out(reason)
            replica.retried += len(idxs)
        self._dispatch(call, idxs, running)

    def _dispatch(self, call: _Rollout, idxs: Iterable[int], running: dict[Future, tuple[Replica, list[int]]]) -> None:
        """Place prompts `idxs` (least outstanding first) and start one call per replica."""
        idxs = list(idxs)
        if not idxs:
            return
        if not self.in_rotation:
            with self.lock:
                why = {r.index: r.reason for r in self.replicas}
            raise FleetGoneError(self.reasons("no replica is left in rotation to serve this call", why))
        for i in idxs:
            if len(call.tried[i]) > self.max_retries:
                names = ", ".join(f"dp{j}" for j in call.tried[i])
                raise FleetError(f"prompt {i} failed on {names}; it was retried {self.max_retries} time(s) "
                                 f"(max_retries)")
        with self.lock:
            loads = {r.index: r.outstanding for r in self.replicas if r.in_rotation}
            picks = pick_replicas(loads, [call.costs[i] for i in idxs], [set(call.tried[i]) for i in idxs])
            if any(p is None for p in picks):
                raise FleetGoneError(self.reasons("no replica is left to serve this call",
                                                   {r.index: r.reason or "tried already" for r in self.replicas}))
            groups: dict[int, list[int]] = {}
            for i, p in zip(idxs, picks):
                assert p is not None
                groups.setdefault(p, []).append(i)
                call.tried[i].append(p)
            for p, group in groups.items():
                self.replicas[p].outstanding += sum(call.costs[i] for i in group)
        for p, group in groups.items():
            replica = self.replicas[p]
            running[self.pool.submit(self._generate_on, replica, call, group)] = (replica, group)

    def _generate_on(self, replica: Replica, call: _Rollout, group: list[int]) -> list[RequestOutput]:
        try:
            params = call.params if not isinstance(call.params, list) else [call.params[i] for i in group]
            return replica.client.generate([call.items[i] for i in group], params, wait=call.wait,
                                           timeout=call.timeout, **call.policy)
        finally:
            with self.lock:
                replica.outstanding -= sum(call.costs[i] for i in group)

    def reasons(self, head: str, why: Mapping[int, Any]) -> str:
        """`head`, then one line per replica of `why` ({index: reason}), named with its URL."""
        return head + "".join(f"\n  {self.replicas[i].label}: {w}" for i, w in sorted(why.items()))


@dataclasses.dataclass
class _Rollout:
    """One generate call's prompts, their parameters (one object, or a list per prompt) and progress."""

    items: list[Any]
    params: Any
    wait: bool
    timeout: float | None
    policy: dict[str, Any]  # on_sync, max_staleness: SidecarClient.generate's
    costs: list[int] = dataclasses.field(default_factory=list)
    tried: list[list[int]] = dataclasses.field(default_factory=list)  # per prompt, the replicas it was sent to
    results: list[RequestOutput | None] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.items)
        per = self.params if isinstance(self.params, list) else [self.params] * n
        self.costs = [sequences_of(p) for p in per]
        self.tried = [[] for _ in range(n)]
        self.results = [None] * n


def _weights_state(states: Sequence[Mapping[str, Any]]) -> str:
    """The weights arena of a fleet as one: dropped on some replica, else asleep on some, else awake."""
    found = {(s.get("tags") or {}).get("weights", "awake") for s in states}
    return next((state for state in ("asleep_empty", "asleep_mirrored") if state in found), "awake")


def wait_first(running: Mapping[Future, Any]) -> tuple[Future, set[Future]]:
    done, pending = wait_futures(list(running), return_when=FIRST_COMPLETED)
    return next(iter(done)), pending


def _prompt_list(prompts: Any) -> list[Any]:
    """The client's rule: a string or a list of token ids is one prompt."""
    if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


def _params_list(sampling_params: Any, n: int) -> Any:
    """One params object for every prompt, or a list with one per prompt."""
    if isinstance(sampling_params, Sequence) and not isinstance(sampling_params, (str, Mapping)):
        if len(sampling_params) != n:
            raise InvalidRequestError("sampling_params", f"a list needs one entry per prompt ({n}), got "
                                      f"{len(sampling_params)}")
        return list(sampling_params)
    return sampling_params


def _newest_version(output: RequestOutput) -> int:
    """The target version of an output's newest tokens: its last span's (one span: its weight_version)."""
    spans = [span for c in output.outputs for span in c.weight_version_spans]
    return max((version for _, version in spans), default=output.weight_version)

