"""One weight sync of a `Fleet` (trainer_hooks/fleet.py): every rank of every replica in ONE group.

Members: the replicas that answer /state healthy when the sync starts; the others miss it. (A draft
sync asks only the replicas in rotation: it can take one out, never admit one.) The group is rebuilt
when the members change, when one of them restarted (new rank pids), or after a failed step (sessions
may be open, and a new init abandons them); otherwise the last sync's group is reused, and a sync costs
one replica's calls, run concurrently, plus one concurrent /state per replica.

Group ranks: the sender is 0; rank k of member j is 1 + (the ranks of the members before j) + k. Each
member gets the sender's init_info with a `ranks` map of ITS rank keys to those group ranks
(InitInfo.ranks), so replicas whose ranks all call themselves dp0 still take distinct group ranks and
no rank's key has to be known to the others. The sender sees one group of N receivers: the bytes go
out once per bucket, in one broadcast, whatever the number of replicas.

Steps, each one's HTTP calls concurrent: (re)connect -> start -> update on every member beside one
sender.send() -> finish; when every member said `audit_in_update` at init, the update carries finish and
the sender delivers its digests to every rank in the sync (inference/transfer/delivery.py), so each
update's answer is that replica's audit and there is no finish round. Once any replica audited, the
digests reached every rank: each answer is then that replica's verdict, and one that went away missed
the sync (nothing runs again: the others already committed). A member that goes away (connection
lost, 503, unhealthy) before or while the bytes move, or refuses the start while others accept it, is
dropped and the sync runs again at once without it, in a fresh group, until no member is left. A
start refused by every member is the trainer's problem and is raised as is; a wire failure with every
member still alive is a FleetSyncError naming each replica's error. At finish each verdict is the
replica's own: an audit mismatch fails that replica only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from inference.core import SidecarError
from trainer_hooks.client_codec import finish_digests, records_json
from trainer_hooks.client_errors import SidecarChecksumError, SidecarConnectionError, SidecarUnavailableError
from trainer_hooks.fleet_replicas import (
    FleetError,
    FleetGoneError,
    FleetSyncError,
    Replica,
    SyncOutcome,
    fleet_rank_key,
    sync_report,
)

if TYPE_CHECKING:
    from trainer_hooks.fleet import Fleet

GONE = (SidecarConnectionError, SidecarUnavailableError)


class _Lost(Exception):
    """Members that cannot take part in this sync ({index: why}); the sync runs again without them."""

    def __init__(self, reasons: dict[int, str]) -> None:
        super().__init__(str(reasons))
        self.reasons = reasons


class FleetGroup:
    """The fleet's transfer group: the sender, whether the fleet made it, and the members it joined."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.sender: Any = None
        self.owned = False
        self.key: tuple[tuple[int, tuple[int, ...]], ...] | None = None  # (member, its rank pids) joined
        self.inline = False  # every member said audit_in_update at init: update carries finish

    def close(self) -> None:
        """Close the sender if the fleet made it (one the caller gave stays the caller's)."""
        if self.owned and self.sender is not None:
            self.sender.close()
        self.sender, self.owned, self.key = None, False, None

    def sync(self, sender: Any, named: list[tuple[str, Any]], version: int, model: str,
             allow_cast: bool) -> dict[str, Any]:
        fleet = self.fleet
        missed: dict[int, str] = {}
        while True:
            try:
                members = self._members(missed, model)
            except FleetGoneError:
                fleet.settle_sync(model, version, (), {i: f"missed the sync of {model} v{version}: {why}"
                                                       for i, why in missed.items()})
                raise
            try:
                outcome = self._once(sender, members, named, version, model, allow_cast)
                break
            except _Lost as lost:
                self.key = None
                missed.update(lost.reasons)
        outcome.missed.update(missed)
        out = {i: f"failed its audit of {model} v{version}: {why}" for i, why in outcome.failed.items()}
        out.update({i: f"missed the sync of {model} v{version}: {why}" for i, why in outcome.missed.items()})
        fleet.settle_sync(model, version, outcome.passed, out)
        report = sync_report(outcome, fleet.replicas)
        if not outcome.passed and not outcome.failed:
            raise FleetGoneError(f"no replica took the sync of {model} v{version}:\n  {report['table']}")
        return report

    def _members(self, missed: dict[int, str], model: str) -> list[Replica]:
        """The replicas that take part; the unreachable and unhealthy ones are added to `missed`."""
        fleet = self.fleet
        found = fleet.probe()
        members = []
        for r in fleet.replicas:
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
            why = "".join(f"\n  {fleet.replicas[i].label}: {w}" for i, w in sorted(missed.items()))
            raise FleetGoneError(f"no replica can take the sync of {model}:{why}")
        return members

    def _once(self, sender_arg: Any, members: list[Replica], named: list[tuple[str, Any]], version: int,
              model: str, allow_cast: bool) -> SyncOutcome:
        fleet = self.fleet
        sender = self._connect(sender_arg, members)
        manifest = sender.manifest(named, version)
        started = fleet.each(members, lambda r: r.client.start_weights(version, manifest, model=model,
                                                                        allow_cast=allow_cast))
        self._check("start", members, started)
        if self.inline:  # each replica's update answer is its audit (the sender delivers its digests)
            updates = {r.index: fleet.pool.submit(r.client.update_weights, finish=True) for r in members}
            records, error = _run(lambda: sender.send(named, deliver_digests=True))
            finished = _outcomes(updates)
            if not _audited(finished):  # else the digests reached the ranks: each verdict is in, none runs again
                self._check("update", members, finished, error)
            return self._verdicts(members, finished, model, version, records)
        updates = {r.index: fleet.pool.submit(r.client.update_weights) for r in members}
        records, error = _run(lambda: sender.send(named))
        self._check("update", members, _outcomes(updates), error)
        digests = finish_digests(manifest, records)
        finished = fleet.each(members, lambda r: r.client.finish_weights(digests))
        return self._verdicts(members, finished, model, version, records)

    def _verdicts(self, members: list[Replica], finished: Mapping[int, Any], model: str, version: int,
                  records: Any) -> SyncOutcome:
        """Each replica's own verdict from its finish answer (or error)."""
        outcome = SyncOutcome(model, version)
        for r in members:
            result = finished[r.index]
            if isinstance(result, SidecarChecksumError):
                message = _rekeyed(r, result.message)
                rank = fleet_rank_key(r.index, result.rank) if result.rank else None
                outcome.failed[r.index] = message if rank is None or rank in message else f"rank {rank}: {message}"
            elif isinstance(result, GONE):
                outcome.missed[r.index] = f"went away at finish: {result}"
            elif isinstance(result, SidecarError):
                outcome.failed[r.index] = _rekeyed(r, f"finish refused: {result}")
            elif isinstance(result, BaseException):
                raise result
            else:
                audit = result["audit"] if "audit" in result else r.client.audit(
                    model=model, source="received", expected=records_json(records))  # an older sidecar
                if audit.get("ok"):
                    outcome.passed[r.index] = audit
                else:
                    outcome.failed[r.index] = _rekeyed(r, f"{audit.get('summary')}\n{audit.get('table')}")
        return outcome

    def _connect(self, sender_arg: Any, members: list[Replica]) -> Any:
        """The group of exactly these members: reused, or built by init on every member beside connect()."""
        key = tuple((r.index, r.pids) for r in members)
        total = sum(len(r.rank_keys) for r in members)
        if hasattr(sender_arg, "send") and not isinstance(sender_arg, type):  # a WeightSender of the caller's
            if sender_arg.num_receivers != total:
                raise FleetError(f"the WeightSender given has {sender_arg.num_receivers} receiver(s), the replicas "
                                 f"taking part have {total} rank(s): give the hook a backend name instead, so the "
                                 "fleet builds a sender for the replicas of each sync")
            if self.sender is sender_arg and self.key == key and sender_arg.connected:
                return sender_arg
            self.close()
            sender, owned = sender_arg, False
        else:
            if self.owned and self.key == key and self.sender.connected:
                return self.sender
            self.close()
            sender, owned = sender_arg(total), True
        self.sender, self.owned, self.key = sender, owned, None
        info = sender.init_info()
        infos, first = {}, 1
        for r in members:
            infos[r.index] = {**info, "ranks": {k: first + j for j, k in enumerate(r.rank_keys)}}
            first += len(r.rank_keys)
        joins = {r.index: self.fleet.pool.submit(r.client.init_weights, infos[r.index]) for r in members}
        _, error = _run(sender.connect)
        joined = _outcomes(joins)
        self._check("init", members, joined, error)
        self.key = key
        # every member takes "finish" in its update (the sender delivers the digests): one request less per sync
        self.inline = all(isinstance(a, dict) and a.get("audit_in_update") is True for a in joined.values())
        return sender

    def _check(self, step: str, members: Sequence[Replica], results: Mapping[int, Any],
               local: BaseException | None = None) -> None:
        """Raise _Lost for members that went away (or refused a start others took), else FleetSyncError
        (or, a start every member refused, its error) when the step failed anywhere."""
        errors = {i: e for i, e in results.items() if isinstance(e, BaseException)}
        for e in errors.values():
            if not isinstance(e, SidecarError):
                raise e
        if not errors and local is None:
            return
        self.key = None  # open sessions or a broken group: the next attempt re-inits every member
        gone = {i: f"went away at {step}: {e}" for i, e in errors.items() if isinstance(e, GONE)}
        if not gone:
            found = self.fleet.probe(members)  # a member that died may have left the others only a timeout
            gone = {r.index: f"went away at {step}: {found[r.index]}" for r in members
                    if isinstance(found[r.index], BaseException) or not found[r.index].get("healthy")}
        if not gone and step == "start" and errors:
            if len(errors) == len(members):
                raise next(iter(errors.values()))  # every replica refuses this manifest: the trainer's problem
            gone = {i: f"refused the start: {e}" for i, e in errors.items()}
        if gone:
            raise _Lost(gone)
        named: dict[str, BaseException] = {self.fleet.replicas[i].label: e for i, e in errors.items()}
        if local is not None:
            named["sender"] = local
        raise FleetSyncError(f"the {step} step of the fleet's sync failed", named)


def _rekeyed(replica: Replica, text: str) -> str:
    """A replica's message with its own rank keys (dp0:... without --dp-rank) written as the fleet's."""
    for key in replica.rank_keys:
        text = text.replace(key, fleet_rank_key(replica.index, key))
    return text


def _run(fn: Callable[[], Any]) -> tuple[Any, BaseException | None]:
    """fn() here, its error returned (the replicas' errors name the rank; they are read first)."""
    try:
        return fn(), None
    except Exception as e:
        return None, e


def _audited(finished: Mapping[int, Any]) -> bool:
    """Whether some replica audited (passed or failed): the sender's digests reached every rank, so a
    replica's error is its own (a replica that went away missed the sync; nothing is sent again)."""
    return any(isinstance(v, SidecarChecksumError) or (isinstance(v, dict) and "audit" in v)
               for v in finished.values())


def _outcomes(futures: Mapping[int, Future]) -> dict[int, Any]:
    return {i: (f.exception() if f.exception() is not None else f.result()) for i, f in futures.items()}
