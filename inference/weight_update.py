"""Weight-update sessions for the Worker (`WeightUpdateMixin`), with the seed's state rules.

Per sync: init_weight_transfer_engine(init_info) once (again after any wire failure), then
start_weight_update(version, manifest) or start_draft_weight_update(...) -> update_weights() ->
finish_weight_update(sender_digests). Rules:
- start validates the whole manifest against the model before any byte moves (InvalidRequestError
  naming the tensor and this rank); a failed start changes nothing.
- A second start while a session is open, and update/finish without start, are StateErrors.
- Any failure after start ends the session. The model is torn from the moment its first byte may be
  overwritten until an audit passes: a failed or abandoned update leaves it torn, and a torn model
  is not servable (`is_servable`). The version advances only when the audit passes.
- A TransferError breaks the group: the next start asks for a new init_weight_transfer_engine.
Sleep integration (when the host has a `memory: MemoryManager`, as Worker does): an update needs its
weights arena awake (asleep at level 1 or 2 -> StateError: wake_up(["weights"]) first; a level-2
wake leaves the arena awake but empty, which is exactly what a sync refills). The arena's
contents are marked invalid when the first byte may be written and valid again when the audit
passes, so `Worker.is_ready()` agrees with `is_servable()`.
Digest rule: the sender names it in the start manifest ("algorithm"; inference/transfer/digests.py),
and this rank digests what it holds under that rule, wherever its bytes are (a CPU rank computes the
device rule on the host); finish digests that name another rule fail the audit with an "algorithm"
mismatch naming both.
Overlapped audit: when update_weights has received every tensor it starts digesting the held
regions: under the device rule, on a GPU, ONE kernel launch queued right behind the writes (finish waits
on its event); otherwise on a side thread. That digest runs while the trainer still digests its own
copy (the trainer calls finish only after that). Nothing writes the model between update_weights and
finish (no step runs on a model with an open session, and start, update and reset_weights refuse), so
the digest is of the bytes finish audits. What could release them waits for it first: sleep and
shutdown (`settle_weight_digest`, which also drops the result: a sleep loses unaudited bytes, so finish
digests what the model holds after it), and every end of the session (finish, abort, a failure, a new
init).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from checksum import ChecksumMismatch, Manifest, Report, TensorRecord, compare, pick_algorithm
from inference import envs
from inference.config import ModelConfig
from inference.core import InvalidRequestError, StateError
from inference.memory import ArenaState
from inference.parallel import TPInfo
from inference.transfer.digests import (
    PendingRecords,
    RecordDigests,
    check_algorithm,
    expected_manifest,
    kernel_device,
    manifest_algorithm,
)
from inference.transfer.groups import InitInfo, TransferError
from inference.transfer.plan import ManifestCache, ParsedManifest
from inference.transfer.receiver import WeightReceiver
from inference.transfer.target import Fault, Routing, UpdateTarget, route_manifest
from inference.weight_state import ModelWeightState, RouteCache, Session, UpdateResult, parameter_slots

log = logging.getLogger(__name__)

WEIGHT_ARENAS = {"target": "weights", "draft": "draft_weights"}  # the tags inference.worker gives them
FAULT_ENV = envs.WEIGHT_FAULT.name  # test-only: "flip:<tensor name>" flips a byte of that tensor on arrival


class WeightUpdateMixin:
    """Mixed into inference.worker.Worker (which provides the attributes below)."""

    models: dict[str, nn.Module]
    model_configs: dict[str, ModelConfig]
    device: torch.device | None
    tp: TPInfo
    dp_rank: int
    rank_key: str  # a property of Worker: "dp{i}:pp{j}:tp{k}"

    def _init_weight_update_state(self) -> None:
        self._wt_receiver: WeightReceiver | None = None
        self._wt_session: Session | None = None
        self._wt_states: dict[str, ModelWeightState] = {}
        self._wt_routes: dict[str, RouteCache] = {}
        self._wt_manifests = ManifestCache()  # parsed manifests, reused while the sender's layout repeats
        self.routings_built = 0  # validate_manifest runs (tests check the route cache with it)
        self.weight_transfer_fault: Fault | None = _fault_from_env()
        self._wt_digests = RecordDigests("received-digest")  # device launches, or the host thread
        self.overlap_audit_digest = True  # False: finish takes the received digest (benchmarks, A/B)

    # ---- state --------------------------------------------------------------------------------
    def _wt_state(self, which: str) -> ModelWeightState:
        return self._wt_states.setdefault(which, ModelWeightState())

    @property
    def weight_versions(self) -> dict[str, int]:
        return {w: self._wt_state(w).version for w in self.models}

    @property
    def torn(self) -> dict[str, bool]:
        return {w: self._wt_state(w).torn for w in self.models}

    @property
    def weights_loaded(self) -> dict[str, bool]:
        return {w: self._wt_state(w).loaded for w in self.models}

    def is_servable(self, which: str = "target") -> bool:
        """Loaded, not torn, and no update session writing into it."""
        state = self._wt_state(which)
        session = self._wt_session
        return (which in self.models and state.loaded and not state.torn
                and (session is None or session.which != which))

    def weight_state(self, which: str = "target") -> dict[str, Any]:
        state = self._wt_state(which)
        session = self._wt_session
        return {"model": which, "version": state.version, "torn": state.torn, "torn_reason": state.torn_reason,
                "loaded": state.loaded, "servable": self.is_servable(which),
                "session_open": session is not None and session.which == which}

    def supports_draft_weight_updates(self) -> bool:
        return "draft" in self.models

    def _weights_arena(self, which: str) -> tuple[Any, str] | None:
        memory = getattr(self, "memory", None)
        tag = WEIGHT_ARENAS.get(which)
        return (memory, tag) if memory is not None and tag in memory.tags else None

    def _check_weights_writable(self, which: str) -> None:
        """StateError when the weights of `which` are asleep: writing a released arena is an illegal
        address on CUDA (a level-2 wake makes it writable again, empty)."""
        arena = self._weights_arena(which)
        if arena is not None and arena[0].state(arena[1]) != ArenaState.AWAKE:
            raise StateError(f"rank {self.rank_key}: the {which} weights are asleep "
                             f"({arena[0].state(arena[1]).value}); wake_up(['weights']) before a weight update")

    def _set_arena_valid(self, which: str, valid: bool) -> None:
        arena = self._weights_arena(which)
        if arena is not None:
            (arena[0].mark_loaded if valid else arena[0].mark_not_loaded)(arena[1])

    # ---- the group ----------------------------------------------------------------------------
    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Join the sender's group (blocks until every rank joined). Replaces any previous group; an
        open session on the old group is abandoned (its model stays torn if bytes had moved)."""
        info = InitInfo.from_dict(init_info)
        if self.device is None:
            raise StateError(f"rank {self.rank_key}: init_device before init_weight_transfer_engine")
        rank = info.receiver_rank(self.rank_key, self.dp_rank, self.tp.rank, self.tp.size)
        if self._wt_session is not None:
            self._end_session(f"abandoned by a new init_weight_transfer_engine ({info.session_id})")
        self.close_weight_transfer_engine()
        self._wt_receiver = WeightReceiver(info, rank, self.device, self.rank_key)
        log.info("rank %s joined weight transfer session %s as group rank %d (%s)", self.rank_key,
                 info.session_id, rank, info.backend)

    def close_weight_transfer_engine(self) -> None:
        if self._wt_receiver is not None:
            self._wt_receiver.close()
            self._wt_receiver = None

    # ---- a session ----------------------------------------------------------------------------
    def start_weight_update(self, version: int, manifest: Any, *, allow_cast: bool = False) -> None:
        self._start("target", version, manifest, allow_cast)

    def start_draft_weight_update(self, version: int, manifest: Any, *, allow_cast: bool = False) -> None:
        if not self.supports_draft_weight_updates():
            raise InvalidRequestError("draft", f"rank {self.rank_key}: no draft model is loaded, so a draft "
                                      "weight update has nothing to write; nothing was written")
        self._start("draft", version, manifest, allow_cast)

    def _start(self, which: str, version: int, manifest: Any, allow_cast: bool) -> None:
        if self._wt_session is not None:
            raise StateError(f"rank {self.rank_key}: a {self._wt_session.which} weight update (version "
                             f"{self._wt_session.version}) is open; finish it first")
        if self._wt_receiver is None or self._wt_receiver.broken is not None:
            why = "was never initialized" if self._wt_receiver is None else f"is broken ({self._wt_receiver.broken})"
            raise StateError(f"rank {self.rank_key}: the weight transfer group {why}; call "
                             "init_weight_transfer_engine first")
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise InvalidRequestError("version", f"must be an integer >= 0, got {version!r}")
        if which not in self.models:
            raise StateError(f"rank {self.rank_key}: no {which} model loaded")
        manifest_version, specs = self._wt_manifests.parse(manifest)
        if manifest_version is not None and manifest_version != version:
            raise InvalidRequestError("manifest.version", f"is {manifest_version}, but the update is for version "
                                      f"{version}")
        algorithm = manifest_algorithm(manifest)
        self._check_weights_writable(which)
        routing = self._routing(which, specs, allow_cast)
        fault = self.weight_transfer_fault
        if fault is not None and (len(fault) != 2 or fault[0] != "flip"):
            raise InvalidRequestError("weight_transfer_fault", f"must be ('flip', tensor name), got {fault!r}")
        target = UpdateTarget(which, self.model_configs[which], routing, self.rank_key, fault, algorithm)
        self._wt_session = Session(which, version, specs, target, algorithm)

    def _routing(self, which: str, specs: ParsedManifest, allow_cast: bool) -> Routing:
        """route_manifest (validation included), cached while the manifest and the parameters stay the same."""
        model, config = self.models[which], self.model_configs[which]
        cache = self._wt_routes.get(which)
        if cache is None or not cache.matches(specs, allow_cast, model, config):
            self._wt_routes.pop(which, None)  # a failed validation leaves no stale routing behind
            routing = route_manifest(specs, model, config, which=which, rank=self.rank_key, tp_size=self.tp.size,
                                     allow_cast=allow_cast)
            self.routings_built += 1
            cache = RouteCache(specs, allow_cast, model, config, parameter_slots(model), routing)
            self._wt_routes[which] = cache
        return cache.routing

    def update_weights(self, update_info: Any = None) -> None:
        """Receive every bucket of the open session. `update_info`: None or {} (or a list indexed by
        dp_rank * tp_size + tp_rank, one entry per rank, for multi-rank drivers)."""
        session = self._require_session("update_weights")
        try:
            if isinstance(update_info, list):
                update_info = update_info[self.dp_rank * self.tp.size + self.tp.rank]
            if update_info not in (None, {}):
                raise InvalidRequestError("update_info", f"must be empty: one call receives the whole plan, "
                                          f"got {update_info!r}")
            if session.received:
                raise StateError(f"rank {self.rank_key}: update_weights called twice in one session")
            self._check_weights_writable(session.which)
            assert self._wt_receiver is not None
            self._wt_receiver.receive(session.version, session.specs, session.target,
                                      on_agreed=lambda: self._begin_writes(session))
            session.received = True
            if self.overlap_audit_digest:
                session.held_digests = self._digest_held(session)
        except BaseException as e:
            self._end_session(f"update to version {session.version} failed: {e}")
            raise

    def finish_weight_update(self, sender_digests: Any, *, held_manifest: bool = False) -> UpdateResult:
        """Audit what this rank received against the sender's digests; on success the version goes live.

        `sender_digests`: a Manifest, records (TensorRecords or their dicts), {"tensors": records}, or
        {"digests": [one hex digest per manifest tensor, in manifest order]}; a dict may name its
        "algorithm" (default: the session's). Raises ChecksumMismatch (naming the first tensor and this
        rank) on a mismatch, a missing or an extra tensor, or digests of another rule; the model is then
        torn. `held_manifest` adds the digests of the parameters this rank holds (engine names, a second
        pass over every byte), for comparing replicas across dp ranks.
        """
        session = self._require_session("finish_weight_update")
        try:
            if not session.received:
                raise StateError(f"rank {self.rank_key}: finish_weight_update before update_weights completed")
            expected = expected_manifest(sender_digests, which=session.which, version=session.version,
                                         rank=self.rank_key, specs=session.specs, algorithm=session.algorithm)
            self._check_weights_present(session.which)
            held = session.held_digests.result() if session.held_digests is not None else None
            if held is None:
                held = self._received_held_digests(session)
            received = session.target.received_manifest(session.version, held)
            report = Report.merge([compare(expected, received), session.target.tied_report(received)])
            if not report.ok:
                raise ChecksumMismatch(report)
            held = self._held_manifest(session.which, session.version, session.algorithm) if held_manifest else None
        except BaseException as e:
            self._end_session(f"audit of version {session.version} failed: {e}")
            raise
        state = self._wt_state(session.which)
        state.version, state.torn, state.torn_reason, state.loaded = session.version, False, None, True
        self._set_arena_valid(session.which, True)
        self._wt_session = None
        return UpdateResult(session.which, session.version, self.rank_key, report, received, held)

    def settle_weight_digest(self) -> None:
        """Wait for the overlapped received digest, if one runs, and drop its result. Call before
        anything releases or rewrites the weights' memory (Worker.sleep and shutdown do): finish then
        digests the bytes the model holds after it."""
        session = self._wt_session
        if session is not None and session.held_digests is not None:
            pending, session.held_digests = session.held_digests, None
            pending.settle()  # its outcome no longer matters: finish digests afresh

    def close_weight_digests(self) -> None:
        """Settle the overlapped digest and stop its thread (the worker is shutting down)."""
        self.settle_weight_digest()
        self._wt_digests.close()

    def warm_up_weight_digest(self) -> None:
        """Compile the device digest for this rank's GPU now (seconds, once), so the first sync does not."""
        if self.device is not None and self.device.type == "cuda":
            self._wt_digests.warm_up(self.device)

    def held_manifest(self, which: str = "target", algorithm: str | None = None) -> Manifest:
        """The digests of the parameters this rank holds now (its shards, engine names) at its live
        version, by `algorithm` (None: checksum.pick_algorithm over them, the device rule on a GPU)."""
        if which not in self.models:
            raise InvalidRequestError("model", f"rank {self.rank_key}: no {which} model loaded "
                                      f"(models: {sorted(self.models)})")
        arena = self._weights_arena(which)
        if arena is not None and arena[0].state(arena[1]) != ArenaState.AWAKE:  # released: nothing to read
            raise StateError(f"rank {self.rank_key}: the {which} weights are asleep "
                             f"({arena[0].state(arena[1]).value}); wake_up(['weights']) before digesting them")
        return self._held_manifest(which, self._wt_state(which).version, algorithm)

    def abort_weight_update(self, reason: str = "aborted by the caller") -> None:
        """End the open session (if any); its model stays torn if any byte may have been written."""
        if self._wt_session is not None:
            self._end_session(reason)

    def reset_weights(self, which: str | None = None) -> None:
        """Zero the weights of `which` (default: every model); not servable until a sync passes."""
        if self._wt_session is not None:
            raise StateError(f"rank {self.rank_key}: cannot reset weights while an update session is open")
        for name in [which] if which is not None else list(self.models):
            if name not in self.models:
                raise StateError(f"rank {self.rank_key}: no {name} model loaded")
            with torch.no_grad():
                for p in self.models[name].parameters():
                    p.zero_()
            self._wt_state(name).loaded = False

    # ---- helpers ------------------------------------------------------------------------------
    def _require_session(self, what: str) -> Session:
        if self._wt_session is None:
            raise StateError(f"rank {self.rank_key}: {what} without a matching start_weight_update")
        return self._wt_session

    def _digest_held(self, session: Session) -> PendingRecords | None:
        """Start digesting the held regions after the work that wrote them (see the module docstring);
        None when some tensor never arrived (finish reports it)."""
        items = session.target.held_items()
        if items is None:
            return None
        written = None  # a device launch is ordered behind the writes by its stream; the host path waits
        if self.device is not None and self.device.type == "cuda" and kernel_device(items, session.algorithm) is None:
            written = torch.cuda.Event()
            written.record(torch.cuda.current_stream(self.device))
        return self._wt_digests.launch(items, session.algorithm, written=written)

    def _received_held_digests(self, session: Session) -> list[TensorRecord] | None:
        """The held regions' digests taken now (no overlapped digest ran); None if some tensor is missing."""
        items = session.target.held_items()
        return None if items is None else self._wt_digests.digest(items, session.algorithm)

    def _check_weights_present(self, which: str) -> None:
        arena = self._weights_arena(which)
        if arena is not None and arena[0].state(arena[1]) != ArenaState.AWAKE:
            raise StateError(f"rank {self.rank_key}: the {which} weights were put to sleep during the update, "
                             "which dropped the received bytes; wake_up and sync again")

    def _begin_writes(self, session: Session) -> None:
        """Both ends agreed on the plan: from here on the model's bytes may change."""
        session.bytes_moved = True
        self._mark_torn(session.which, f"update to version {session.version} in progress")
        self._set_arena_valid(session.which, False)

    def _mark_torn(self, which: str, reason: str) -> None:
        state = self._wt_state(which)
        state.torn, state.torn_reason = True, reason

    def _end_session(self, reason: str) -> None:
        session = self._wt_session
        assert session is not None
        if session.held_digests is not None:
            session.held_digests.settle()  # nobody reads the model after the session is gone
        self._wt_session = None
        if session.bytes_moved:
            self._mark_torn(session.which, reason)
            log.error("rank %s: %s model torn: %s", self.rank_key, session.which, reason)

    def _held_manifest(self, which: str, version: int, algorithm: str | None) -> Manifest:
        params = [(name, p.detach()) for name, p in self.models[which].named_parameters()]
        rule = pick_algorithm(t for _, t in params) if algorithm is None else check_algorithm(algorithm)
        records = self._wt_digests.digest(params, rule)
        return Manifest(which, version, self.rank_key, tuple(records), rule)


def _fault_from_env() -> Fault | None:
    """Test-only fault injection: SIDECAR_WEIGHT_FAULT="flip:<tensor name>"."""
    spec = envs.WEIGHT_FAULT.get()
    if not spec:
        return None
    kind, _, name = spec.partition(":")
    return (kind, name)


__all__ = ["FAULT_ENV", "ModelWeightState", "TransferError", "UpdateResult", "WeightUpdateMixin"]
