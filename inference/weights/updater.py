"""The engine's half of a weight sync: `WeightUpdater`, one per Worker (`Worker.weights`).

It is the only owner of the facts of a model's weights: the live version, the torn flag and its
reason, whether they are loaded, the manifest the last finished sync delivered, and which memory
arena holds them (`ARENA_OF`). LLM, the Worker and the rank server ask it and keep no copy.

Per sync: init_transfer(init_info) once (again after any wire failure), then start(which, version,
manifest) -> update() -> finish(sender_digests); or, when the sender delivers its digests in the
sync (inference/transfer/delivery.py), update(digests_follow=True) returns them for finish. Its engine
(LLM) listens: `before_write` settles the step in flight before a start or finish, `on_live` drops
what the old weights computed once a version goes live. Rules:
- Versions only grow: start refuses a version that is not an integer in (live, INT64_MAX], so a version
  names one set of weights and outputs tagged with it trace back to them. start validates the whole
  manifest against the model before any byte moves (InvalidRequestError naming the field or tensor
  and this rank); a failed start changes nothing.
- A second start while a session is open, and update/finish without start, are StateErrors.
- An adapter-only manifest (a LoRA-served model: its adapter tensors alone) starts only while the base
  weights are intact (loaded, not torn, not dropped at a level-2 sleep); otherwise the base comes with it.
- Any failure after start ends the session. The model is torn from the moment its first byte may be
  overwritten until an audit passes: a failed or abandoned update leaves it torn, and a torn model
  is not servable. The version advances only when the audit passes, and with TP > 1 only when every
  rank's audit passed (`finish`): no rank goes live, and enters the model's collectives, alone.
- A TransferError breaks the group: the next start asks for a new init_transfer.
- Weights are written or digested only while their arena is awake (`check_awake`: a released arena is
  an illegal address on CUDA; a level-2 wake leaves it awake but empty, which a sync refills). The
  arena's contents are marked invalid when the first byte may be written and valid again when the
  audit passes, so the memory manager never mirrors half-written weights at a level-1 sleep.
Digest rule: the sender names it in the start manifest ("algorithm"; inference/transfer/digests.py),
and this rank digests what it holds under that rule, wherever its bytes are (a CPU rank computes the
device rule on the host); finish digests that name another rule fail the audit with an "algorithm"
mismatch naming both.
Overlapped audit: once every tensor landed (the backend's `landed` call, before the status step;
else when update returns) this rank starts digesting the held regions (inference/weights/audit.py),
which runs while the ranks report; a device digest is collected (and the received manifest built)
before update returns, while the sender's digests travel, so finish only compares. Nothing
writes the model between update and finish (no step runs on a model with an open session, and start,
update and reset refuse), so the digest is of the bytes finish audits. What could release them waits
for it first: sleep and shutdown (`settle_digest`, which also drops the result: a sleep loses
unaudited bytes, so finish digests what the model holds after it), and every end of the session.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from checksum import ChecksumMismatch, Manifest, Report, TensorRecord, digest_tensors
from inference.core import INT64_MAX, InvalidRequestError, StateError
from inference.memory.arenas import WEIGHT_TAGS
from inference.transfer.digests import manifest_algorithm
from inference.transfer.groups import InitInfo
from inference.transfer.plan import ManifestCache, ParsedManifest
from inference.transfer.receiver import WeightReceiver
from inference.weights.audit import HeldDigests, agree_on_audit, audit_report, early_expected
from inference.weights.installed import fp8_layers, sender_report
from inference.weights.state import (
    ModelWeightState,
    RouteCache,
    Session,
    UpdateResult,
    WeightHost,
    arena_asleep,
    parameter_slots,
    set_arena_valid,
)
from inference.weights.target import Routing, UpdateTarget, route_manifest

log = logging.getLogger(__name__)

ARENA_OF = {"target": "weights", "draft": "draft_weights"}  # the memory arena of each model's weights
assert set(ARENA_OF.values()) == set(WEIGHT_TAGS)


class WeightUpdater:
    """See the module docstring."""

    def __init__(self, host: WeightHost) -> None:
        self._host = host
        self.receiver: WeightReceiver | None = None
        self._session: Session | None = None
        self._states: dict[str, ModelWeightState] = {}
        self._received: dict[str, Manifest] = {}  # model -> what its last finished sync delivered
        self._routes: dict[str, RouteCache] = {}
        self.manifests = ManifestCache()  # parsed manifests, reused while the sender's layout repeats
        self.routings_built = 0  # route_manifest runs (tests check the route cache with it)
        self._digests = HeldDigests()
        self.before_write: Callable[[], None] | None = None  # the engine settles its step in flight
        self.on_live: Callable[[str], None] | None = None  # a model's new version went live

    # ---- what the weights are (asked by LLM, the Worker and the rank server) ------------------------
    def _state(self, which: str) -> ModelWeightState:
        state = self._states.get(which)  # asked every step: no throwaway default object
        if state is None:
            state = self._states[which] = ModelWeightState()
        return state

    def version(self, which: str = "target") -> int:
        return self._state(which).version

    @property
    def versions(self) -> dict[str, int]:
        return {w: self._state(w).version for w in self._host.models}

    @property
    def torn(self) -> dict[str, bool]:
        return {w: self._state(w).torn for w in self._host.models}

    @property
    def loaded(self) -> dict[str, bool]:
        return {w: self._state(w).loaded for w in self._host.models}

    @property
    def has_draft(self) -> bool:
        return "draft" in self._host.models

    def is_servable(self, which: str = "target") -> bool:
        """Loaded, not torn, and no update session writing into it."""
        state, session = self._state(which), self._session
        return (which in self._host.models and state.loaded and not state.torn
                and (session is None or session.which != which))

    def state(self, which: str = "target") -> dict[str, Any]:
        state, session = self._state(which), self._session
        return {"model": which, "version": state.version, "torn": state.torn, "torn_reason": state.torn_reason,
                "loaded": state.loaded, "servable": self.is_servable(which),
                "session_open": session is not None and session.which == which,
                "needs_sync": self.needs_sync_reason(which)}

    def needs_sync_reason(self, which: str = "target") -> str | None:
        """Why the bytes `which` holds are NOT its live version's, so that only a sync makes them so (None:
        they are): torn (a failed or open update), dropped at a level-2 sleep and not refilled since, or
        reset. The one answer every reader of "what weights does this rank hold" gives."""
        state = self._state(which)
        if state.torn:
            return state.torn_reason or "torn"
        memory, tag = self._host.memory, ARENA_OF[which]
        if memory is not None and tag in memory.tags and not memory.contents_valid(tag):
            return (f"its weights were released by a level-2 sleep and no sync has refilled them since: it "
                    f"does not hold version {state.version}")
        if not state.loaded:
            return "its weights were reset; no sync has loaded them since"
        return None

    @property
    def needs_sync(self) -> dict[str, str | None]:
        return {w: self.needs_sync_reason(w) for w in self._host.models}

    def check_servable(self) -> None:
        """StateError naming the first model that may not serve, and why."""
        for which in self._host.models:
            if not self.is_servable(which):
                state, open_ = self._state(which), self._session is not None and self._session.which == which
                why = state.torn_reason or ("an update session is open" if open_ else "its weights were reset")
                raise StateError(f"the {which} model is not servable ({why}); sync its weights first")

    def needs_trainer(self) -> bool:
        """Some model is torn or awaits its first sync and no session is open to fix it: only the
        trainer's next sync ends that (a session in progress ends by itself)."""
        return any(not self.is_servable(w) and (self._session is None or self._session.which != w)
                   for w in self._host.models)

    def received_manifest(self, which: str = "target", algorithm: str | None = None) -> Manifest:
        """The digests of what the last finished sync of `which` delivered (full tensors, trainer names)."""
        rank = self._host.rank_key
        if which not in self._received:
            raise StateError(f"rank {rank}: no sync of the {which} model has finished on this rank")
        received = self._received[which]
        if algorithm is not None and algorithm != received.algorithm:
            raise InvalidRequestError("algorithm", f"rank {rank}: the last sync's received digests are "
                                      f"{received.algorithm!r}, not {algorithm!r} (the sender picks the rule "
                                      "of a sync); source=held digests what is held now by any rule")
        return received

    def check_awake(self, which: str, before: str) -> None:
        """StateError unless the arena of `which` is awake: reading or writing a released arena is an
        illegal address on CUDA (a level-2 wake makes it usable again, empty)."""
        asleep = self._asleep(which)
        if asleep is not None:
            raise StateError(f"rank {self._host.rank_key}: the {which} weights are asleep ({asleep}); "
                             f"wake_up(['weights']) before {before}")

    def arena_tag(self, which: str) -> str:
        """The memory arena (inference/memory/arenas.py tag) that holds the weights of `which`."""
        return ARENA_OF[which]

    def _asleep(self, which: str) -> str | None:
        """The state of the arena of `which` when it is not awake; None when awake (or not in an arena)."""
        return arena_asleep(self._host.memory, ARENA_OF[which])

    def _set_arena_valid(self, which: str, valid: bool) -> None:
        set_arena_valid(self._host.memory, ARENA_OF[which], valid)

    # ---- the group ----------------------------------------------------------------------------------
    def init_transfer(self, init_info: Any) -> tuple[str, ...]:
        """Join the sender's group (blocks until every rank joined). Replaces any previous group; an
        open session on the old group is abandoned (its model stays torn if bytes had moved). Returns the
        models this rank holds in FP8 (they take FP8 payloads when the sender quantizes on send; a sender
        that offers to, `send_fp8`, is refused when there is none)."""
        host = self._host
        info = InitInfo.from_dict(init_info)
        if host.device is None:
            raise StateError(f"rank {host.rank_key}: init_device before init_weight_transfer_engine")
        fp8_models = tuple(w for w, m in host.models.items() if fp8_layers(m))
        if info.send_fp8 and not fp8_models:
            raise InvalidRequestError("init_info.send_fp8", f"rank {host.rank_key}: the sender quantizes on send, but "
                                      "no model here is in fp8 mode (sidecar launch --quantization fp8): send "
                                      "unquantized weights (send_fp8=False)")
        rank = info.receiver_rank(host.rank_key, host.tp.rank)
        if self._session is not None:
            self._end_session(f"abandoned by a new init_weight_transfer_engine ({info.session_id})")
        self.close_transfer()
        self.receiver = WeightReceiver(info, rank, host.device, host.rank_key)
        log.info("rank %s joined weight transfer session %s as group rank %d (%s)", host.rank_key,
                 info.session_id, rank, info.backend)
        return fp8_models

    def close_transfer(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None

    # ---- a session ----------------------------------------------------------------------------------
    def start(self, which: str, version: int, manifest: Any, *, allow_cast: bool = False) -> None:
        """Open an update session of `which` to `version` (see the module docstring's rules)."""
        rank = self._host.rank_key
        if which not in ARENA_OF:
            raise InvalidRequestError("model", f"must be 'target' or 'draft', got {which!r}")
        if self.before_write is not None:
            self.before_write()  # no step may read weights being written
        if which == "draft" and not self.has_draft:
            raise InvalidRequestError("draft", f"rank {rank}: no draft model is loaded, so a draft weight update "
                                      "has nothing to write; nothing was written")
        if which in self._host.models:
            self.check_awake(which, "a weight update")
        if self._session is not None:
            raise StateError(f"rank {rank}: a {self._session.which} weight update (version "
                             f"{self._session.version}) is open; finish it first")
        if self.receiver is None or self.receiver.broken is not None:
            why = "was never initialized" if self.receiver is None else f"is broken ({self.receiver.broken})"
            raise StateError(f"rank {rank}: the weight transfer group {why}; call init_weight_transfer_engine first")
        if which not in self._host.models:
            raise StateError(f"rank {rank}: no {which} model loaded")
        self._check_version(which, version)
        manifest_version, specs = self.manifests.parse(manifest)
        if manifest_version is not None and manifest_version != version:
            raise InvalidRequestError("manifest.version", f"is {manifest_version}, but the update is for version "
                                      f"{version}")
        algorithm = manifest_algorithm(manifest)
        routing = self._routing(which, specs, allow_cast)
        payload = next((r.spec.name for r in routing.routes if r.part is not None), None)
        if payload is not None and not self.receiver.info.send_fp8:
            raise InvalidRequestError(payload, f"rank {rank}: an FP8 payload (quantized on send), but this transfer "
                                      "session was not initialized to carry them: make the sender with "
                                      "send_fp8=True; nothing was written")
        if all(r.adapter for r in routing.routes) and self._intact_version(which) < 0:
            raise InvalidRequestError("manifest", f"rank {rank}: an adapter-only sync, but the {which} model's base "
                                      "weights are not intact (torn by a failed sync, reset, or dropped at a "
                                      "level-2 sleep): send the base with the adapter; nothing was written")
        target = UpdateTarget(which, self._host.model_configs[which], routing, rank, algorithm)
        self._session = Session(which, version, specs, target, algorithm)

    def _check_version(self, which: str, version: object) -> None:
        """Versions only grow: InvalidRequestError naming `version` unless it is an integer in
        (live, INT64_MAX] (an int64, as trainers count steps and metrics carry it)."""
        if not isinstance(version, int) or isinstance(version, bool) or not 0 <= version <= INT64_MAX:
            raise InvalidRequestError("version", f"must be an integer in [0, 2**63 - 1], got {version!r}")
        live = self._state(which).version
        if version <= live:
            raise InvalidRequestError("version", f"rank {self._host.rank_key}: {version} is not newer than the "
                                      f"live {which} version {live}: versions only grow; send {live + 1} or more")

    def _routing(self, which: str, specs: ParsedManifest, allow_cast: bool) -> Routing:
        """route_manifest (validation included), cached while the manifest and the parameters stay the same."""
        host = self._host
        model, config = host.models[which], host.model_configs[which]
        cache = self._routes.get(which)
        if cache is None or not cache.matches(specs, allow_cast, model, config):
            self._routes.pop(which, None)  # a failed validation leaves no stale routing behind
            routing = route_manifest(specs, model, config, which=which, rank=host.rank_key, tp_size=host.tp.size,
                                     allow_cast=allow_cast)
            self.routings_built += 1
            cache = RouteCache(specs, allow_cast, model, config, parameter_slots(model), routing)
            self._routes[which] = cache
        return cache.routing

    def update(self, update_info: Any = None, *, digests_follow: bool = False,
               owner: str | None = None) -> dict[str, Any] | None:
        """Receive every bucket of the open session. `update_info`: None or {} (or a list with one entry per
        rank of this sidecar, indexed by tp rank, for multi-rank drivers). `digests_follow`: the
        sender delivers its digests in the sync (WeightSender.send(deliver_digests=True)); they are
        returned, as `finish` takes them, for the caller to finish at once (None without). With TP > 1,
        an update with `digests_follow` that fails after bytes may have moved takes part in the ranks'
        agreement on the audit in finish's place (the others may have passed and wait in it). `owner`: the
        nonce the sender must present in the plan agreement (WeightReceiver.receive)."""
        session = self._require_session("update_weights")
        host = self._host
        try:
            if isinstance(update_info, list):
                update_info = update_info[host.tp.rank]
            if update_info not in (None, {}):
                raise InvalidRequestError("update_info", f"must be empty: one call receives the whole plan, "
                                          f"got {update_info!r}")
            if session.received:
                raise StateError(f"rank {host.rank_key}: update_weights called twice in one session")
            self.check_awake(session.which, "a weight update")
            assert self.receiver is not None
            # queued once the bytes landed, while the ranks report
            session.target.on_landed = lambda: self._launch_held_digest(session)
            installs = (host.tp.size, host.tp.rank) if session.target.installs_fp8 else None
            self.receiver.receive(session.version, session.specs, session.target,
                                  on_agreed=lambda: self._begin_writes(session), digests_follow=digests_follow,
                                  held_version=self._intact_version(session.which), owner=owner,
                                  installed=installs)
            session.received = True
            delivered = None
            try:
                if session.held_digests is None:  # a backend without landed()
                    self._launch_held_digest(session)
                self._digests.collect(session)  # while the sender's digests travel: finish only compares
            finally:
                if digests_follow:
                    delivered, session.expected_installed = self.receiver.sender_digests(session.algorithm)
        except BaseException as e:
            if digests_follow and session.bytes_moved:  # the other TP ranks may have passed: they wait in finish
                agree_on_audit(host.tp, host.device, host.rank_key, e, None,
                               f"the update of {session.which} version {session.version}")
            self._end_session(f"update to version {session.version} failed: {e}")
            raise
        return delivered

    def refuse_update(self) -> bool:
        """Refuse the plan agreement of an update whose start failed in the same call (POST
        /weights/update with "start"), so the waiting sender's send() fails at once and the group stays
        usable. Touches no session. False without a usable group (the sender's collective then fails on
        its own, at worst at its timeout); TransferError if the agreement fails (the group breaks)."""
        receiver = self.receiver
        if receiver is None or receiver.broken is not None:
            return False
        receiver.refuse()
        return True

    def finish(self, sender_digests: Any, *, held_manifest: bool = False) -> UpdateResult:
        """Audit what this rank received against the sender's digests; on success the version goes live.

        `sender_digests`: see inference/transfer/digests.py `expected_manifest`. Raises ChecksumMismatch
        (naming the first tensor and this rank) on a mismatch, a missing or an extra tensor, or digests
        of another rule; the model is then torn. An FP8 model's installed bytes are audited too: against
        the bytes written, and against the sender's expected installed digests when update() took them
        from the sync (inference/transfer/installed_digests.py), so a rank that installed other bytes
        than the rule gives never goes live. `held_manifest` adds the digests of the parameters
        this rank holds (engine names, a second pass over every byte), for comparing replicas.
        With TP > 1 every rank of the engine calls finish at the same boundary (with or without a
        session), and the ranks agree on the verdict first (audit.py `agree_on_audit`): the version
        goes live on every rank or on none, and a rank whose own audit passed raises the failing ranks'
        error, its model torn too.
        """
        session, host = self._session, self._host
        what = (f"the audit of {session.which} version {session.version}" if session is not None
                else "finish_weight_update")
        result: UpdateResult | None = None
        failure: BaseException | None = None
        try:
            session = self._require_session("finish_weight_update")
            result = self._audit(session, sender_digests, held_manifest)
        except BaseException as e:
            failure = e
        failure = agree_on_audit(host.tp, host.device, host.rank_key, failure,
                                 result.report if result is not None else None, what)
        if failure is not None:
            if self._session is not None:
                self._end_session(f"audit of version {self._session.version} failed: {failure}")
            raise failure
        assert session is not None and result is not None
        state = self._state(session.which)
        state.version, state.torn, state.torn_reason, state.loaded = session.version, False, None, True
        self._set_arena_valid(session.which, True)
        self._received[session.which] = result.received
        self._session = None
        if self.on_live is not None:
            self.on_live(session.which)
        return result

    def _audit(self, session: Session, sender_digests: Any, held_manifest: bool) -> UpdateResult:
        """This rank's own audit of the session (see finish); raises on any failure, changes no state."""
        rank = self._host.rank_key
        if self.before_write is not None:
            self.before_write()  # (settled at start: normally nothing)
        if not session.received:
            raise StateError(f"rank {rank}: finish_weight_update before update_weights completed")
        expected = early_expected(sender_digests, session, rank)
        if self._asleep(session.which) is not None:
            raise StateError(f"rank {rank}: the {session.which} weights were put to sleep during the update, "
                             "which dropped the received bytes; wake_up and sync again")
        records, received = self._digests.received(session)
        checked = audit_report(sender_digests, expected, session, rank, records, received)
        own = session.target.installed_report()  # before installed_records: it takes the held digests
        installed = tuple(session.target.installed_records(records))
        against = self._against_sender(session, installed)
        report = Report.merge([checked, session.target.tied_report(received), own, against])
        if not report.ok:
            raise ChecksumMismatch(report)
        if session.target.audited_parts:  # a delta into TP slices: the full tensors' digests are the sender's
            assert self.receiver is not None and self.receiver.full_digests is not None
            received = session.target.manifest_of(session.version, session.target.full_records(
                self.receiver.full_digests))
        held = self._held(session.which, session.version, session.algorithm) if held_manifest else None
        return UpdateResult(session.which, session.version, rank, report, received, held, installed,
                            against.tensors_checked)

    def _against_sender(self, session: Session, installed: tuple[TensorRecord, ...]) -> Report:
        """The installed FP8 digests against the ones the sender expects this rank to hold (delivered in
        the sync; an empty report when it delivered none). StateError when it meant to and could not."""
        rank, expected = self._host.rank_key, session.expected_installed
        if expected is None:
            return Report.build((), [rank], 0)
        if expected.missing is not None:
            raise StateError(f"rank {rank}: {expected.missing}, so the installed FP8 weights of {session.which} "
                             f"version {session.version} cannot be checked; nothing goes live: sync again")
        return sender_report(installed, expected.digests, session.which, rank)

    def abort(self, reason: str = "aborted by the caller") -> None:
        """End the open session (if any); its model stays torn if any byte may have been written."""
        if self._session is not None:
            self._end_session(reason)

    def reset(self, which: str | None = None) -> None:
        """Zero the weights of `which` (default: every model); not servable until a sync passes."""
        models = self._host.models
        if self._session is not None:
            raise StateError(f"rank {self._host.rank_key}: cannot reset weights while an update session is open")
        for name in [which] if which is not None else list(models):
            if name not in models:
                raise StateError(f"rank {self._host.rank_key}: no {name} model loaded")
            with torch.no_grad():
                for p in models[name].parameters():
                    p.zero_()
            self._state(name).loaded = False

    # ---- digests of what is held --------------------------------------------------------------------
    def held_manifest(self, which: str = "target", algorithm: str | None = None) -> Manifest:
        """The digests of the parameters this rank holds now (its shards, engine names) at its live
        version, by `algorithm` (None: checksum.pick_algorithm over them, the device rule on a GPU)."""
        if which not in self._host.models:
            raise InvalidRequestError("model", f"rank {self._host.rank_key}: no {which} model loaded "
                                      f"(models: {sorted(self._host.models)})")
        self.check_awake(which, "digesting them")
        return self._held(which, self._state(which).version, algorithm)

    def checksums(self, which: str = "target") -> dict[str, str]:
        """Digests of the parameters this rank holds (its shards, engine names), keyed rank:name."""
        host = self._host
        if which not in host.models:
            raise StateError(f"rank {host.rank_key}: no {which} model loaded")
        records = digest_tensors(list(host.models[which].named_parameters()))
        return {f"{host.rank_key}:{r.name}": r.digest for r in records}

    def settle_digest(self) -> None:
        """Wait for the overlapped received digest, if one runs, and drop its result. Call before
        anything releases or rewrites the weights' memory (Worker.sleep and shutdown do): finish then
        digests the bytes the model holds after it."""
        session = self._session
        if session is not None and session.held_digests is not None:
            pending, session.held_digests, session.held_received = session.held_digests, None, None
            pending.settle()  # its outcome no longer matters: finish digests afresh

    def warm_up(self) -> None:
        """Compile the device digest for this rank's GPU now (seconds, once), so the first sync does not."""
        if self._host.device is not None:
            self._digests.warm_up(self._host.device)

    def close(self) -> None:
        """Settle the overlapped digest and stop its thread (the worker is shutting down)."""
        self.settle_digest()
        self._digests.close()

    # ---- helpers ------------------------------------------------------------------------------------
    def _held(self, which: str, version: int, algorithm: str | None) -> Manifest:
        return self._digests.manifest(self._host.models[which], which, version, self._host.rank_key, algorithm)

    def _require_session(self, what: str) -> Session:
        if self._session is None:
            raise StateError(f"rank {self._host.rank_key}: {what} without a matching start_weight_update")
        return self._session

    def _launch_held_digest(self, session: Session) -> None:
        if session.held_digests is None:
            session.held_digests = self._digests.launch(session, self._host.device)

    def _intact_version(self, which: str) -> int:
        """The live version of `which` when the bytes held are exactly it (loaded, not torn, awake and
        valid: a level-2 sleep drops them), the base a delta sync may be applied to; else -1."""
        state, memory, tag = self._state(which), self._host.memory, ARENA_OF[which]
        if state.torn or not state.loaded or self._asleep(which) is not None:
            return -1
        if memory is not None and tag in memory.tags and not memory.contents_valid(tag):
            return -1
        return state.version

    def _begin_writes(self, session: Session) -> None:
        """Both ends agreed on the plan: from here on the model's bytes may change."""
        session.bytes_moved = True
        self._mark_torn(session.which, f"update to version {session.version} in progress")
        self._set_arena_valid(session.which, False)

    def _mark_torn(self, which: str, reason: str) -> None:
        state = self._state(which)
        state.torn, state.torn_reason = True, reason

    def _end_session(self, reason: str) -> None:
        session = self._session
        assert session is not None
        if session.held_digests is not None:
            session.held_digests.settle()  # nobody reads the model after the session is gone
        self._session = None
        if session.bytes_moved:
            self._mark_torn(session.which, reason)
            log.error("rank %s: %s model torn: %s", self._host.rank_key, session.which, reason)


