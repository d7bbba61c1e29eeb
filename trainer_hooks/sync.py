"""The weight-sync protocol, trainer's side: ONE choreography, used by `SidecarClient` (one sidecar) and
by `Fleet` (every rank of every replica in one transfer group); sidecar/api/control.py is the other side.

- Agree: POST /weights/init on every sidecar, carrying SYNC_PROTOCOL, while sender.connect() blocks (a
  refused init calls the sender's wait off at once). Another protocol is refused by either side, with
  both versions named: a 409 from the sidecar, SidecarProtocolError here.
- Own: the init answers a session (its session id and the nonce `join` drew, one for the group);
  every update carries it, and the sidecar refuses (409 naming `session`) one of a session another
  init replaced; send() presents the nonce in the plan agreement, so the ranks refuse the bytes of any
  other sender (another trainer's) before one moves.
- Start, send, answer: per sidecar ONE POST /weights/update carrying the start, written before
  sender.send(named, deliver_digests=True). send() moves the bytes, then delivers its digests to every
  rank over the group; every rank compares and commits, so each update's answer is that sidecar's audit.
  A refused start makes its ranks refuse the sender's plan agreement: send() fails at once, and the
  sidecar's error (naming field and rank) wins.
- A manifest whose layout a sidecar parsed travels as that key alone; a sidecar that does not know it
  (restarted) answers 400 on `manifest.layout`, and the round runs again with the tensors.
- Delta syncs are the sender's (WeightSender(delta=True), negotiated in its init_info): each sync is still
  this one round; the ranks and the sender decide delta or full over the group (inference/transfer/delta.py).
- FP8 on send is the sender's too (WeightSender(send_fp8=True), in its init_info): each init answers the
  models every rank holds in FP8, and a sync sends the FP8 payload only for a model that every sidecar of
  the group holds in FP8 (else the tensors as given, which an FP8 rank quantizes on receive).
- A fleet's group: the sender is rank 0; rank k of member j is 1 + (the ranks of the members before j) + k,
  given to each member as InitInfo.ranks; the group is reused while its members (and their pids) stay.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Hashable, Mapping, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from inference.core import SidecarError
from trainer_hooks.client_errors import (
    PROTOCOL_MISMATCH,
    SidecarChecksumError,
    SidecarConnectionError,
    SidecarProtocolError,
    SidecarRequestError,
    SidecarUnavailableError,
)
from trainer_hooks.fleet_replicas import FleetError, Replica, SyncOutcome, fleet_rank_key

if TYPE_CHECKING:
    from trainer_hooks.wire import Pending, Wire

SYNC_PROTOCOL = 3  # this choreography's and the sidecar routes' version (3: delta offers name TP slices)
LAYOUT_FIELD = "manifest.layout"  # the field of the sidecar's 400 for a layout key it does not know
GONE = (SidecarConnectionError, SidecarUnavailableError)  # a sidecar that went away, not a bad request


class SyncPeer:
    """One sidecar's weight routes over its wire, and the manifest layouts it has parsed."""

    def __init__(self, wire: Wire, timeout: float | None = None) -> None:
        self.wire, self.timeout = wire, timeout
        self.layouts: set[str] = set()
        self.session: dict[str, str] | None = None  # what the last init answered: every update carries it
        self.fp8_models: frozenset[str] = frozenset()  # the models every rank holds in FP8 (the last init's)

    def init(self, init_info: Mapping[str, Any], nonce: str | None = None) -> dict[str, Any]:
        """POST /weights/init: join the sender's group, speaking SYNC_PROTOCOL (module docstring). `nonce`:
        the session's (one for every member of a group); None: the sidecar draws it."""
        body = {"init_info": dict(init_info), "protocol": SYNC_PROTOCOL, "nonce": nonce}
        try:
            answer = self.wire.begin("POST", "/weights/init", body, self.timeout).result()
        except SidecarRequestError as e:
            if e.field != "protocol":
                raise
            raise SidecarProtocolError(e.status, PROTOCOL_MISMATCH, f"the sidecar does not know the field: it "
                                       f"predates weight-sync protocol {SYNC_PROTOCOL}, which this client speaks",
                                       "protocol") from e
        theirs = answer.get("protocol")
        if theirs != SYNC_PROTOCOL:
            raise SidecarProtocolError(409, PROTOCOL_MISMATCH, f"the sidecar speaks weight-sync protocol {theirs}, "
                                       f"this client protocol {SYNC_PROTOCOL}", "protocol")
        self.session = answer.get("session")
        self.fp8_models = frozenset(answer.get("fp8_models") or ())
        return answer

    def update(self, start: Mapping[str, Any], update_info: Any = None, *, bind_sender: bool = False) -> Pending:
        """POST /weights/update carrying the start, written now; its answer (the audit) when read. With
        `bind_sender` the sender must present the session's nonce (send(owner=...)) or its bytes are refused."""
        session = {**self.session, "bind_sender": bind_sender} if self.session is not None else None
        body = {"start": dict(start), "update_info": update_info, "session": session}
        return self.wire.begin("POST", "/weights/update", body, self.timeout)

    def abort(self) -> dict[str, Any]:
        """POST /weights/abort: end the open session now ({"aborted": whether one was open})."""
        return self.wire.begin("POST", "/weights/abort", {}, self.timeout).result()

    def start_body(self, version: int, manifest: Any, model: str, allow_cast: bool, *, short: bool) -> dict[str, Any]:
        """The start; with `short`, a manifest whose layout this sidecar parsed travels as that key alone
        (the same dict otherwise: callers test `body["manifest"] is manifest`)."""
        layout = manifest_layout(manifest)
        if short and layout is not None and layout in self.layouts:
            manifest = {k: v for k, v in manifest.items() if k != "tensors"}
        return {"model": model, "version": version, "manifest": manifest, "allow_cast": allow_cast}


def manifest_layout(manifest: Any) -> str | None:
    """The layout key of a manifest that lists its tensors (None otherwise)."""
    return manifest.get("layout") if isinstance(manifest, dict) and "tensors" in manifest else None


def join(sender: Any, infos: Mapping[Hashable, tuple[SyncPeer, Mapping[str, Any]]],
         pool: Executor | None = None) -> tuple[dict[Hashable, Any], BaseException | None]:
    """Agree: every peer's init (on `pool`'s threads) while sender.connect() blocks here. Returns each peer's
    answer or error, and connect()'s error."""
    own = pool is None
    runner = ThreadPoolExecutor(max(1, len(infos)), thread_name_prefix="sidecar-init") if own else pool
    assert runner is not None
    nonce = secrets.token_hex(16)  # one for the whole group: the sender presents it to every rank
    try:
        futures = {k: runner.submit(peer.init, info, nonce) for k, (peer, info) in infos.items()}

        def refused(done: Future) -> None:
            if done.exception() is not None:
                sender.call_off_connect(f"the sidecar refused the init: {done.exception()}")

        for fut in futures.values():
            fut.add_done_callback(refused)
        _, error = _run(sender.connect)
        return _outcomes(futures), error
    finally:
        if own:
            runner.shutdown(wait=True)


def sync_round(sender: Any, peers: Mapping[Hashable, SyncPeer], named: list[tuple[str, Any]], version: int,
               model: str, allow_cast: bool) -> tuple[dict[Hashable, Any], BaseException | None]:
    """Start, send, answer on every peer of the sender's group (module docstring). Returns each peer's
    answer (its audit in "audit") or error, and send()'s error."""
    fp8 = bool(getattr(sender, "send_fp8", False)) and all(model in p.fp8_models for p in peers.values())
    manifest = sender.manifest(named, version, fp8=fp8)
    owner = next((p.session["nonce"] for p in peers.values() if p.session), None)
    for short in (True, False):
        starts = {k: p.start_body(version, manifest, model, allow_cast, short=short) for k, p in peers.items()}
        pending = {k: _begin(p, starts[k]) for k, p in peers.items()}
        _, error = _run(lambda: sender.send(named, deliver_digests=True, owner=owner))
        answers = {k: _read(v) for k, v in pending.items()}
        stale = [k for k, a in answers.items() if isinstance(a, SidecarRequestError) and a.field == LAYOUT_FIELD
                 and starts[k]["manifest"] is not manifest]
        if stale and error is not None:
            for k in stale:  # e.g. a restarted sidecar: send the tensors
                peers[k].layouts.discard(manifest["layout"])
            manifest = sender.manifest(named, version, fp8=fp8)  # arm the sender again for the second send()
            continue
        layout = manifest_layout(manifest)
        for k, a in answers.items():
            if layout is not None and not isinstance(a, BaseException):
                peers[k].layouts.add(layout)
        return answers, error
    raise AssertionError("unreachable: the full manifest is never answered on manifest.layout")


def connect_one(peer: SyncPeer, sender: Any) -> dict[str, Any]:
    """Join one sidecar and the sender: its init answer, or the sidecar's error (naming the field), else
    connect()'s."""
    answers, error = join(sender, {0: (peer, sender.init_info())})
    return _verdict_of_one(answers[0], error)


def sync_one(peer: SyncPeer, sender: Any, named: list[tuple[str, Any]], version: int, model: str,
             allow_cast: bool) -> dict[str, Any]:
    """One sidecar's sync: the audit of what every rank received against the sender's digests ("ok" True;
    a mismatch raises SidecarChecksumError naming tensor and rank)."""
    if not getattr(sender, "connected", True):
        connect_one(peer, sender)
    answers, error = sync_round(sender, {0: peer}, named, version, model, allow_cast)
    return _verdict_of_one(answers[0], error)["audit"]


def _verdict_of_one(answer: Any, local: BaseException | None) -> Any:
    """The sidecar's error first (it names the field and the rank), then the sender's, then the answer."""
    if isinstance(answer, SidecarError):
        raise answer
    if local is not None:
        raise local
    if isinstance(answer, BaseException):
        raise answer
    return answer


class StepFailed(Exception):
    """A step of a fleet's sync failed somewhere: each member's error ({index: error}) and the sender's."""

    def __init__(self, step: str, errors: dict[int, BaseException], local: BaseException | None) -> None:
        super().__init__(f"the {step} step failed: {errors} {local}")
        self.step, self.errors, self.local = step, errors, local


class FleetGroup:
    """A Fleet's transfer group: the sender (built from the hook's maker and owned, or the caller's) and the
    members it joined. `sync` runs the choreography on the members; `StepFailed` says where it failed."""

    def __init__(self, pool: Executor) -> None:
        self.pool = pool
        self.sender: Any = None
        self.owned = False
        self.key: tuple[Any, ...] | None = None  # the members (index, rank pids) joined

    def close(self) -> None:
        """Close the sender if the fleet made it (one the caller gave stays the caller's)."""
        if self.owned and self.sender is not None:
            self.sender.close()
        self.sender, self.owned, self.key = None, False, None

    def sync(self, sender_arg: Any, members: Sequence[Replica], named: list[tuple[str, Any]], version: int,
             model: str, allow_cast: bool) -> SyncOutcome:
        sender = self._connect(sender_arg, members)
        answers, error = sync_round(sender, {r.index: r.client.weights for r in members}, named, version, model,
                                    allow_cast)
        if not _audited(answers):  # else the digests reached the ranks: each verdict is in, none runs again
            errors = {i: a for i, a in answers.items() if isinstance(a, BaseException)}
            if errors or error is not None:
                self.key = None  # a broken group: the next attempt joins every member again
                raise StepFailed("update", errors, error)  # type: ignore[arg-type]
        return _verdicts(members, answers, model, version)

    def _connect(self, sender_arg: Any, members: Sequence[Replica]) -> Any:
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
        infos: dict[Hashable, tuple[SyncPeer, Mapping[str, Any]]] = {}
        first = 1
        for r in members:
            infos[r.index] = (r.client.weights, {**info, "ranks": {k: first + j for j, k in enumerate(r.rank_keys)}})
            first += len(r.rank_keys)
        joined, error = join(sender, infos, self.pool)
        errors = {i: e for i, e in joined.items() if isinstance(e, BaseException)}
        if errors or error is not None:
            raise StepFailed("init", errors, error)  # type: ignore[arg-type]
        self.key = key
        return sender


def _verdicts(members: Sequence[Replica], answers: Mapping[Hashable, Any], model: str, version: int) -> SyncOutcome:
    """Each replica's own verdict from its update's answer (or error)."""
    outcome = SyncOutcome(model, version)
    for r in members:
        result = answers[r.index]
        if isinstance(result, SidecarChecksumError):
            message = _rekeyed(r, result.message)
            rank = fleet_rank_key(r.index, result.rank) if result.rank else None
            outcome.failed[r.index] = message if rank is None or rank in message else f"rank {rank}: {message}"
        elif isinstance(result, GONE):
            outcome.missed[r.index] = f"went away before its audit: {result}"
        elif isinstance(result, SidecarError):
            outcome.failed[r.index] = _rekeyed(r, f"the sync was refused: {result}")
        elif isinstance(result, BaseException):
            raise result
        elif result["audit"].get("ok"):
            outcome.passed[r.index] = result["audit"]
        else:
            audit = result["audit"]
            outcome.failed[r.index] = _rekeyed(r, f"{audit.get('summary')}\n{audit.get('table')}")
    return outcome


def _rekeyed(replica: Replica, text: str) -> str:
    """A replica's message with its own rank keys (dp0:... without --dp-rank) written as the fleet's."""
    for key in replica.rank_keys:
        text = text.replace(key, fleet_rank_key(replica.index, key))
    return text


def _audited(answers: Mapping[Hashable, Any]) -> bool:
    """Whether some replica audited (passed or failed): the sender's digests reached every rank, so a
    replica's error is its own (a replica that went away missed the sync; nothing is sent again)."""
    return any(isinstance(v, SidecarChecksumError) or (isinstance(v, dict) and "audit" in v) for v in answers.values())


def _begin(peer: SyncPeer, start: dict[str, Any]) -> Pending | BaseException:
    try:
        return peer.update(start, bind_sender=True)
    except SidecarError as e:  # the request could not even be written: that sidecar is gone
        return e


def _read(pending: Pending | BaseException) -> Any:
    if isinstance(pending, BaseException):
        return pending
    try:
        return pending.result()
    except Exception as e:
        return e


def _run(fn: Callable[[], Any]) -> tuple[Any, BaseException | None]:
    """fn() here, its error returned (the sidecars' errors name the rank; they are read first)."""
    try:
        return fn(), None
    except Exception as e:
        return None, e


def _outcomes(futures: Mapping[Hashable, Future]) -> dict[Hashable, Any]:
    return {i: (f.exception() if f.exception() is not None else f.result()) for i, f in futures.items()}
