"""`WeightSyncHook`: the trainer's side of one RL step (sleep -> train -> sync + audit -> wake -> rollouts).

Every rank of a distributed trainer calls the hook at the same points: weight sources are
collectives (FSDP2 all-gathers, ZeRO-3 gathers), so all ranks collect together; only the sending
rank (rank 0 by default) keeps the full tensors and talks to the sidecar. Non-sending ranks never
touch the client. The step counters are deterministic, so every rank syncs at the same call.

Attaching (a sidecar outlives its trainer): a new hook reads the sidecar's state first (`attach`: what
sleeps, the live version), and before its first rollouts, unless it synced already, syncs its weights
(sync_on_attach=True) or raises AttachError when the live weights are not the trainer's (False).
Versions: the first sync uses the live target version + 1; each passing sync advances `version` by one
(a retried sync uses a fresh number). The draft is synced after the target under the same version.

Failure rules: an audit mismatch raises AuditError carrying the report table (or, with
retry_on_mismatch, re-sends once first); on an FP8 sidecar each rank also checks the FP8 bytes it installed
against the trainer's own application of the rule, delivered in the sync, before it goes live
(check_installed, the default; docs/fp8.md). A
sidecar that cannot be reached or whose ranks died raises SidecarGoneError, with the tail of its log when
the hook knows the log path. Every client call has a timeout (the client's), so nothing hangs forever.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from checksum import Manifest, compare, digest_tensors
from inference.core import SamplingParams, SidecarError, StateError
from inference.quant.installed import installed_part
from inference.transfer.backends import check_backend, default_backend
from inference.transfer.fp8_payload import payload_tensors
from inference.transfer.sender import WeightSender
from trainer_hooks.client_errors import SidecarChecksumError, SidecarConnectionError, SidecarUnavailableError
from trainer_hooks.fleet import Fleet
from trainer_hooks.logprob_gap import REPLAY_STATS_PREFIX, measure_logprob_gap
from trainer_hooks.rollout_pool import DEFAULT_POOL, RolloutTake, staleness, sync_fields
from trainer_hooks.sources import collect_weights, peft_adapter_weights, peft_base_weights
from trainer_hooks.trainer_host import trainer_host

log = logging.getLogger("trainer_hooks")
LOG_TAIL_LINES = 40


class AuditError(SidecarError):
    """The sidecar does not hold the bytes the trainer sent. `report` is the audit dict, `table` its table."""

    def __init__(self, model: str, version: int, report: dict[str, Any]) -> None:
        self.model, self.version, self.report = model, version, report
        self.table = str(report.get("table", ""))
        super().__init__(f"weight audit failed for model {model!r} version {version}: "
                         f"{report.get('summary', '')}\n{self.table}")


class SidecarGoneError(SidecarError):
    """The sidecar is unreachable or its ranks died; the message ends with its log's tail when known."""


class AttachError(SidecarError):
    """With sync_on_attach=False: the sidecar does not serve the trainer's weights (another version, other
    digests, or a torn model); the message says which and how to sync instead."""


class WeightSyncHook:
    """See the module docstring. `client` is a trainer_hooks.client.SidecarClient (or anything with its
    API that raises its errors, trainer_hooks/client_errors.py), or a trainer_hooks.fleet.Fleet.

    With a Fleet the hook hands the fleet a maker of WeightSenders instead of one sender (the receivers
    follow the replicas that take part in each sync), and a sync that leaves some replicas out of
    rotation (failed audit, missed sync) is a logged warning naming them (also in
    `stats["out_of_rotation"]`), not an error, while the others serve the new version; AuditError /
    SidecarGoneError only when no replica holds it.
    """

    def __init__(self, client: Any, model: Any, draft_model: Any = None, *, sender: WeightSender | str | None = None,
                 sleep_level: int = 1, sync_every: int = 1, grad_accum_steps: int = 1, audit: bool = True,
                 retry_on_mismatch: bool = False, rank: int | None = None, is_sender: bool | None = None,
                 sender_rank: int = 0, allow_cast: bool = False, log_path: str | Path | None = None,
                 transfer_timeout_s: float = 120.0, logprob_gap: bool = False,
                 trainer_host: str | None = None, rollout_pool: str = DEFAULT_POOL,
                 sync_on_attach: bool = True, delta: bool = False, adapter_only: bool = False,
                 send_fp8: bool = False, check_installed: bool = True) -> None:
        if sleep_level not in (1, 2):
            raise ValueError(f"sleep_level must be 1 or 2, got {sleep_level!r}")
        if sync_every < 1 or grad_accum_steps < 1:
            raise ValueError(f"sync_every and grad_accum_steps must be >= 1, got {sync_every}, {grad_accum_steps}")
        self.client, self.model, self.draft_model = client, model, draft_model
        self.sleep_level, self.sync_every, self.grad_accum_steps = sleep_level, sync_every, grad_accum_steps
        self.audit, self.retry_on_mismatch, self.allow_cast = audit, retry_on_mismatch, allow_cast
        self.rank = rank if rank is not None else _dist_rank()
        self.sender_rank = sender_rank
        self.is_sender = is_sender if is_sender is not None else self.rank == sender_rank
        self.log_path = Path(log_path) if log_path is not None else None
        self.transfer_timeout_s = transfer_timeout_s
        # where the sidecars dial the transfer's store; None: loopback, or the address that routes to a
        # sidecar on another machine (trainer_hooks/trainer_host.py)
        self.trainer_host = trainer_host
        self.logprob_gap = logprob_gap  # measure the trainer-vs-rollout gap after each rollouts() call
        self.rollout_pool = rollout_pool  # the sidecar's pool of partial rollouts (rollouts(min_groups=...))
        self.delta = delta  # senders it builds send only what changed after a full sync (docs/sync-modes.md)
        # senders it builds quantize the linears on send for the models the sidecar holds in FP8 (docs/fp8.md)
        self.send_fp8 = send_fp8
        # senders it builds deliver, in each sync, the installed FP8 digests every FP8 rank checks before it
        # goes live (on receive: the trainer quantizes its linears once more for them; docs/fp8.md)
        self.check_installed = check_installed
        # `model` (and `draft_model`) are PEFT LoRA models served unmerged (sidecar launch --lora, --draft-lora):
        # each sync sends their adapter tensors alone, and the base beside them only after the sidecar's
        # weights were dropped (level 2) or a sync failed
        self.adapter_only = adapter_only
        self._base_in_doubt = False  # adapter_only: a sync failed since the last good one (the rank is torn)
        self.pooled = False  # groups may be unfinished in the pool: sleep holds them instead of finishing them
        self._sender: WeightSender | None = sender if isinstance(sender, WeightSender) else None
        self._backend = sender if isinstance(sender, str) else None
        self._owns_sender = self._sender is None
        self._make_sender: Callable[[int], WeightSender] | None = None  # what a Fleet builds its senders with
        self.calls = 0            # after_optimizer_step() calls (micro-steps when grad_accum_steps > 1)
        self.optimizer_steps = 0
        self.syncs = 0
        self.version: int | None = None  # the live version this hook last synced (sender rank)
        self.asleep = False
        self.weights_fresh = False  # weights woken and refilled since the last sleep
        self.weights_dropped = False  # the sidecar's weights are gone (sleep level 2): only a sync refills them
        self.sync_on_attach = sync_on_attach
        self.attached: dict[str, Any] | None = None  # the sidecar's state when this hook attached (sender rank)
        self._attach_settled = False  # the first rollouts' sync or check ran (every rank)
        # attached to a sidecar whose KV cache sleeps but whose weights are awake (an earlier trainer's
        # last sync): the first sleep() still has the weights to put away
        self._found_half_awake = False
        self.stats: dict[str, Any] = {}  # the last step's figures (ms), see _timed
        self._collected: dict[int, _ParameterViews] = {}  # id(model) -> its reusable views (plain modules)

    # ---- the RL step --------------------------------------------------------------------------
    def before_training(self) -> None:
        """Put the sidecar to sleep (sending rank) so training gets the memory."""
        self.sleep()

    def sleep(self) -> None:
        self.attach()
        if self.is_sender and (not self.asleep or self._found_half_awake):
            if self._found_half_awake:  # the sidecar sleeps all of its memory or none: wake the rest first
                self._call(self.client.wake_up, ["kv_cache"])
            # unfinished pool groups are held (their KV recomputed after the wake), not run to the end now
            args = (self.sleep_level, "hold") if self.pooled else (self.sleep_level,)
            self._timed("sleep_ms", self.client.sleep, *args)
            self.weights_dropped = self.weights_dropped or self.sleep_level == 2
            self._found_half_awake = False
        self.asleep, self.weights_fresh = True, False

    def after_optimizer_step(self) -> dict[str, Any] | None:
        """Count one call; sync at the boundaries. The audit report when synced on the sending rank,
        else None.

        Call it once per `optimizer.step()` call site. With grad_accum_steps=k every k-th call counts as
        an optimizer step (for loops that call it per micro-batch); a sync happens on every
        sync_every-th optimizer step."""
        self.calls += 1
        if self.calls % self.grad_accum_steps:
            return None
        self.optimizer_steps += 1
        if self.optimizer_steps % self.sync_every:
            return None
        return self.sync()

    def sync(self) -> dict[str, Any] | None:
        """Collect (every rank), then on the sending rank: wake weights, send + audit target (and draft)."""
        t0 = time.perf_counter()
        target = self._collect_adapter(self.model) if self.adapter_only else self._collect(self.model)
        draft = None if self.draft_model is None else (  # a plain draft beside a PEFT target syncs whole
            self._collect_adapter(self.draft_model) if self.adapter_only and hasattr(self.draft_model, "peft_config")
            else self._collect(self.draft_model))
        self.stats["collect_ms"] = _ms(t0)
        self.syncs += 1
        if not self.is_sender:
            self.weights_fresh = True
            return None
        self.attach()
        if self.asleep:
            self._timed("wake_weights_ms", self.client.wake_up, ["weights"])
        version = self._next_version()
        t0 = time.perf_counter()
        self._base_in_doubt = self.adapter_only
        report = self._sync_model("target", target, version)
        checked = int(report.get("installed_checked") or 0)
        if draft is not None:
            drafted = self._sync_model("draft", draft, self.version if self.version is not None else version)
            checked += int(drafted.get("installed_checked") or 0)
        self.stats.update(sync_ms=_ms(t0), version=self.version, audit="ok" if report.get("ok") else "mismatch",
                          algorithm=report.get("algorithm"), audit_ms=report.get("audit_ms"),  # the ranks' part
                          installed_checked=checked)
        self.weights_fresh, self.weights_dropped, self._base_in_doubt = True, False, False
        return report

    def rollouts(self, prompts: Any, sampling: SamplingParams | Any = None, *, min_groups: int | None = None,
                 max_groups: int | None = None, timeout_s: float = 600.0, broadcast: bool = False,
                 on_sync: str | None = None, max_staleness: int | None = None) -> list[Any]:
        """Wake the KV cache (and the weights if no sync refilled them) and generate on the sending rank.

        Without min_groups: every prompt's group (its n samples), in prompt order. With min_groups=G:
        the prompts join the sidecar's rollout pool (`rollout_pool`) as new groups and the call returns
        once G groups are finished, at most `max_groups` (default G), oldest submitted first: groups left
        unfinished by earlier calls (or by a trainer that died) come before this call's. The rest keep
        generating in the sidecar and are held through the next sleep and sync (docs/async-rl.md).
        Fewer than G come back only if none is left unfinished or after timeout_s. Each output's
        request_id is its group id. stats: rollout_groups, rollout_carried (groups submitted before this
        call), rollout_left (groups left in the pool). Every call (with min_groups or not) sets
        staleness_samples / staleness_tokens: histograms of versions behind the live one (each sample's
        oldest token; each token) of what it returned, so each step reads its own.
        A call with min_groups acknowledges what the previous one returned (those groups leave the
        sidecar); its own stay leased in the sidecar until then, so a trainer killed before its next
        call loses none (docs/async-rl.md, "Restarts").

        on_sync ("keep", "recompute", "abort"; None: the sidecar's --on-sync) and max_staleness: what a
        weight sync that goes live while a sample runs does to it (docs/async-rl.md).
        broadcast: also hand the outputs to every other rank (torch.distributed, the trainer's group).
        With logprob_gap=True the hook then measures the trainer-vs-rollout logprob gap (stats).
        """
        self._settle_attach()
        outputs: list[Any] = []
        if self.is_sender:
            self.wake()
            policy = sync_fields(on_sync, max_staleness)
            if min_groups is None:
                outputs = self._timed("generate_ms", self.client.generate, prompts, sampling, **policy)
                samples, tokens = staleness(outputs, self.version)
                self.stats.update(staleness_samples=samples, staleness_tokens=tokens)
            else:
                outputs = self._partial(prompts, sampling, min_groups, max_groups, timeout_s, policy)
        if broadcast and torch.distributed.is_available() and torch.distributed.is_initialized():
            box = [outputs]
            torch.distributed.broadcast_object_list(box, src=self.sender_rank)
            outputs = box[0]
        if self.logprob_gap and outputs:
            self._measure_gap(outputs)
        return outputs

    def _partial(self, prompts: Any, sampling: Any, min_groups: int, max_groups: int | None,
                 timeout_s: float, policy: dict[str, Any]) -> list[Any]:
        t0 = time.perf_counter()
        pool = self.rollout_pool
        self.pooled = True
        take = self._call(self.client.rollouts, prompts, sampling, min_groups=min_groups, max_groups=max_groups,
                          pool=pool, timeout_s=timeout_s, **policy)
        self._note_take(take, t0)
        return take.groups

    def iter_rollouts(self, prompts: Any, sampling: SamplingParams | Any = None, *, count: int,
                      timeout_s: float = 600.0, on_sync: str | None = None,
                      max_staleness: int | None = None) -> Iterator[Any]:
        """rollouts(min_groups=count) one group at a time: the prompts join the pool, then each finished
        group is yielded as it completes (completion order; the sidecar answers each take as a group
        finishes), until `count` came (fewer if none is left unfinished, or after timeout_s). The stats
        of rollouts() are set when the iteration ends. Sending rank only: other ranks get nothing."""
        if not self.is_sender:
            return
        self.wake()
        t0 = time.perf_counter()
        self.pooled = True
        stream = self._call(self.client.iter_rollouts, prompts, sampling, count=count, pool=self.rollout_pool,
                            timeout_s=timeout_s, **sync_fields(on_sync, max_staleness))
        it = iter(stream)
        while True:
            try:
                group = self._call(next, it)
            except StopIteration:
                break
            yield group
        self._note_take(RolloutTake(stream.groups, stream.weight_version, stream.failed, stream.counts,
                                    stream.submitted), t0)

    def _note_take(self, take: RolloutTake, t0: float) -> None:
        """The stats of a partial call (rollouts docstring); failed groups are logged."""
        new = set(take.submitted)
        if take.failed:
            log.warning("%d rollout group(s) of pool %r failed on the sidecar (resubmit their prompts):\n%s",
                        len(take.failed), self.rollout_pool,
                        "\n".join(f"  {g}: {why}" for g, why in take.failed.items()))
        samples, tokens = staleness(take.groups, take.weight_version if take.weight_version is not None
                                    else self.version)
        self.stats.update(rollout_ms=_ms(t0), rollout_groups=len(take.groups),
                          rollout_carried=sum(o.request_id not in new for o in take.groups),
                          rollout_left=take.counts.get("pending", 0) + take.counts.get("finished", 0),
                          rollout_failed=dict(take.failed), staleness_samples=samples, staleness_tokens=tokens)

    def _measure_gap(self, outputs: list[Any]) -> None:
        """stats["logprob_gap_*"]: self.model's logprobs of the rollout tokens against the rollout's
        (trainer_hooks/logprob_gap.py); when every completion carries its routing (an MoE model sampled
        with return_routing), also stats["logprob_gap_replay_*"]: the same under the rollout's routing.
        Runs on the ranks that hold the outputs: a sharded model's forward is a collective, so such
        trainers pass broadcast=True."""
        t0 = time.perf_counter()
        self.stats.update(measure_logprob_gap(self.model, outputs).as_stats())
        if all(getattr(c, "routing", None) is not None for o in outputs for c in o.outputs if len(c.token_ids)):
            gap = measure_logprob_gap(self.model, outputs, replay=True)
            self.stats.update(gap.as_stats(REPLAY_STATS_PREFIX))
        self.stats["logprob_gap_ms"] = _ms(t0)

    def wake(self) -> None:
        """Wake the KV cache, and the weights too when no sync refilled them (level 1 restores them
        from host memory; level 2 dropped them, so that is a StateError). On a new hook this wakes a
        sidecar that an earlier trainer left asleep."""
        self.attach()
        if self.is_sender and self.asleep:
            if not self.weights_fresh and self.weights_dropped:
                raise StateError("sleep level 2 dropped the sidecar's weights; sync before rollouts "
                                 "(hook.sync(), or rollouts() with sync_on_attach=True)")
            self._timed("wake_kv_ms", self.client.wake_up, ["kv_cache"] if self.weights_fresh else None)
        self.asleep = False

    def attach(self) -> dict[str, Any] | None:
        """The handshake (module docstring), once, on the sending rank: read the sidecar's state and take
        its sleep over (what is asleep, whether the weights were dropped). The state read, or None on
        other ranks. Every call of the hook that talks to the sidecar runs it first."""
        if not self.is_sender or self.attached is not None:
            return self.attached
        state = self._call(self.client.state)
        weights = (state.get("tags") or {}).get("weights", "awake")  # its arena's state (inference/memory)
        self.attached = state
        self.asleep = bool(state.get("sleeping"))
        self.weights_fresh = weights == "awake"
        self.weights_dropped = weights == "asleep_empty"
        self._found_half_awake = self.asleep and weights == "awake"
        log.info("attached to %s: target v%s, %s%s", _where(self.client),
                 (state.get("weight_versions") or {}).get("target"), "asleep" if self.asleep else "awake",
                 " (weights dropped)" if self.weights_dropped else "")
        return state

    def _settle_attach(self) -> None:
        """Before the first rollouts of a hook that has not synced: sync (sync_on_attach) or check that
        the live weights are the trainer's. Every rank runs it (collecting the weights is a collective)."""
        if self._attach_settled:
            return
        self._attach_settled = True
        if self.syncs:
            return
        if self.sync_on_attach:
            self.sync()
            return
        # adapter_only: what the sidecar received last is the adapter (its base is the launch checkpoint)
        named = self._collect_adapter(self.model) if self.adapter_only else self._collect(self.model)
        if self.is_sender:
            self._check_attached(named)

    def _check_attached(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """sync_on_attach=False: AttachError unless the sidecar serves these weights. A sidecar at version 0
        serves the checkpoint it was launched with, which the trainer says it holds too (its layout is the
        engine's, so `sidecar audit --url URL --checkpoint DIR` is the check of those bytes); a later
        version must be a sync of exactly these tensors (the digests of what it received)."""
        state = self.attach() or {}
        live = (state.get("weight_versions") or {}).get("target")
        fix = "pass WeightSyncHook(..., sync_on_attach=True) (the default) to sync the trainer's weights first"
        if (state.get("torn") or {}).get("target"):
            raise AttachError(f"the sidecar at {_where(self.client)} holds no weight version (a sync failed "
                              f"there; its model is torn): {fix}")
        if not live:
            log.info("attached with sync_on_attach=False to a sidecar at version 0 (its launch checkpoint)")
            self.version = 0
            return
        try:
            received = [Manifest.from_dict(m, "received") for m in self._call(self.client.checksums, "target",
                                                                                 "received")]
        except SidecarError as e:
            raise AttachError(f"the sidecar at {_where(self.client)} serves target v{live}, whose digests cannot "
                              f"be read to compare with the trainer's ({e}): {fix}") from e
        if any(installed_part(r.name) is not None for r in received[0].records):
            named = payload_tensors(named)  # it was synced with FP8 on send: it received the FP8 payload
        mine = Manifest("target", int(live), received[0].rank, tuple(digest_tensors(
            [(n, t.detach()) for n, t in named], algorithm=received[0].algorithm)), received[0].algorithm)
        for theirs in received:
            report = compare(mine, theirs)
            if not report.ok:
                bad = [m.tensor for m in report.mismatches if m.tensor]
                raise AttachError(f"the sidecar at {_where(self.client)} serves target v{live}, not this trainer's "
                                  f"weights: {len(bad)} of {len(mine.records)} tensors differ (first: "
                                  f"{bad[0] if bad else report.summary()}); another trainer synced it: {fix}")
        self.version = int(live)

    @contextlib.contextmanager
    def training(self) -> Iterator[WeightSyncHook]:
        """`with hook.training(): ...`: sleep on enter; on a clean exit sync, unless a sync already
        ran inside the block. On an exception nothing is synced (the sidecar stays asleep)."""
        self.sleep()
        before = self.syncs
        yield self
        if self.syncs == before:
            self.sync()

    def close(self) -> None:
        """Acknowledge the last rollouts taken (the trainer is done with them: they leave the sidecar's
        pool) and close the sender if the hook made it (the sidecar itself is the caller's)."""
        if self.pooled and self.is_sender:
            try:
                self.client.ack_rollouts(self.rollout_pool)
            except SidecarError as e:  # the groups are not lost: they return to the pool after their lease
                log.warning("could not acknowledge the last rollouts of pool %r: %s", self.rollout_pool, e)
            self.pooled = False
        if self._owns_sender and self._sender is not None:
            self._sender.close()
            self._sender = None
        if self._make_sender is not None and isinstance(self.client, Fleet):
            self.client.release_sender()  # the sender it built with our maker

    def __enter__(self) -> WeightSyncHook:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None:
            self.pooled = False  # the step did not finish: its rollouts stay leased and return to the pool
        self.close()

    # ---- internals ----------------------------------------------------------------------------
    def _collect(self, model: Any) -> list[tuple[str, torch.Tensor]]:
        """collect_weights, except that a plain module's views are reused while they stay valid."""
        cached = self._collected.get(id(model))
        if cached is not None and cached.model is model and cached.valid():
            return list(cached.named)
        named = collect_weights(model, keep=self.is_sender)
        views = _ParameterViews.of(model, named)
        if views is not None:
            self._collected[id(model)] = views
        else:
            self._collected.pop(id(model), None)
        return named

    def _collect_adapter(self, model: Any) -> list[tuple[str, torch.Tensor]]:
        """adapter_only: the adapter's tensors on the sending rank (nothing to gather: every rank holds
        them whole), with the unmerged base in front when the sidecar's weights were dropped."""
        if not self.is_sender:
            return []
        self.attach()
        named = peft_adapter_weights(model)
        # a failed sync tore the rank's model, and a torn rank takes no adapter-only sync
        base = self.weights_dropped or self._base_in_doubt
        return [*peft_base_weights(model), *named] if base else named

    def _sync_model(self, model: str, named: list[tuple[str, torch.Tensor]], version: int) -> dict[str, Any]:
        attempts = 2 if self.retry_on_mismatch else 1
        for attempt in range(attempts):
            report = self._send_once(model, named, version)
            if report.get("ok") or not self.audit:
                if not report.get("ok"):
                    log.warning("audit of %s v%d failed (audit=False): %s", model, version, report.get("summary"))
                self.version = version
                self._note_rotation(model, version, report)
                return report
            if attempt + 1 < attempts:
                log.warning("audit of %s v%d failed; sending again:\n%s", model, version, report.get("table"))
                version += 1
                if self.adapter_only:  # the failed audit tore it: the base comes too
                    peft = self.model if model == "target" else self.draft_model
                    named = [*peft_base_weights(peft), *peft_adapter_weights(peft)]
        raise AuditError(model, version, report)

    def _send_once(self, model: str, named: list[tuple[str, torch.Tensor]], version: int) -> dict[str, Any]:
        sender = self._get_sender()  # a Fleet takes the maker too
        try:
            return self._call(self.client.sync_weights, sender, named, version, model=model,
                              allow_cast=self.allow_cast)
        except SidecarChecksumError as e:  # the per-rank check at finish
            return {"ok": False, "summary": str(e), "table": e.message}

    def _next_version(self) -> int:
        if self.version is None:
            live = self._call(self.client.state).get("weight_versions", {}).get("target")
            self.version = int(live) if live is not None else 0
        return self.version + 1

    def _note_rotation(self, model: str, version: int, report: dict[str, Any]) -> None:
        """A fleet's report names the replicas out of rotation after this sync: warn, naming each."""
        if "out_of_rotation" not in report:
            return
        out = dict(report["out_of_rotation"])
        self.stats["out_of_rotation"] = out
        if out:
            log.warning("weight sync of %s v%d: %d replica(s) out of rotation, the others serve it:\n%s", model,
                        version, len(out), "\n".join(f"  {name}: {why}" for name, why in out.items()))

    def _get_sender(self) -> WeightSender | Callable[[int], WeightSender]:
        """The sender; for a Fleet (unless a WeightSender was given) a maker of one for N receivers."""
        if self._sender is None and self._make_sender is None:
            transfer = self._call(self.client.state).get("transfer", {})
            make = functools.partial(self._new_sender, transfer)
            if isinstance(self.client, Fleet):
                self._make_sender = make
            else:
                self._sender = make(int(transfer.get("num_receivers", 1)))
        return self._sender if self._sender is not None else self._make_sender  # type: ignore[return-value]

    def _new_sender(self, transfer: dict[str, Any], num_receivers: int) -> WeightSender:
        device = _model_device(self.model)
        backend = self._backend or transfer.get("backend") or default_backend(device.type, shared_gpu=False)
        urls = [r.url for r in self.client.replicas] if isinstance(self.client, Fleet) else [
            str(getattr(self.client, "url", ""))]
        kwargs: dict[str, Any] = {"num_receivers": num_receivers, "timeout_s": self.transfer_timeout_s,
                                  "master_host": self.trainer_host or trainer_host(urls), "delta": self.delta,
                                  "send_fp8": self.send_fp8, "check_installed": self.check_installed}
        if transfer.get("bucket_bytes"):
            kwargs["bucket_bytes"] = int(transfer["bucket_bytes"])
        if check_backend(backend).cuda:
            kwargs["device"] = device if device.type == "cuda" else None
        return WeightSender(backend, **kwargs)

    def _timed(self, key: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        result = self._call(fn, *args, **kwargs)
        self.stats[key] = _ms(t0)
        return result

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run a client call; a dead or unreachable sidecar becomes SidecarGoneError with its log tail."""
        try:
            return fn(*args, **kwargs)
        except (SidecarConnectionError, SidecarUnavailableError) as e:
            raise SidecarGoneError(f"{getattr(fn, '__name__', 'call')}: the sidecar is gone: {e}"
                                   f"{self._log_tail()}") from e

    def _log_tail(self) -> str:
        if self.log_path is None:
            return ""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
        except OSError as e:
            return f"\n(its log {self.log_path} is unreadable: {e})"
        return f"\n--- last {len(lines)} lines of {self.log_path} ---\n" + "\n".join(lines)


class _ParameterViews:
    """A plain module's collected weights (detached views of its live parameters: an optimizer step
    updates them in place, so the views show the new values), reused while every module keeps the same
    children and the same Parameter objects, on the same storage with the same shape. Checking that walks
    a flat list instead of the module tree and skips re-normalizing every name and re-detaching every
    parameter (~10 us per parameter). Anything that gathers, offloads or merges (ZeRO-3, FSDP2, LoRA)
    yields copies, not views of parameters, and is collected afresh every time."""

    def __init__(self, model: nn.Module, named: list[tuple[str, torch.Tensor]]) -> None:
        self.model, self.named = model, named
        modules = list(model.modules())
        self._children = [(m, tuple(m._modules.values())) for m in modules]
        self._counts = [(m, len(m._parameters)) for m in modules]
        self._slots = [(m, n, p, _state(p)) for m in modules for n, p in m._parameters.items()]

    @classmethod
    def of(cls, model: Any, named: list[tuple[str, torch.Tensor]]) -> _ParameterViews | None:
        if not isinstance(model, nn.Module) or not named:
            return None
        live = {(p.data_ptr(), p.dtype, p.shape) for p in model.parameters()}
        if any(type(t) is not torch.Tensor or (t.data_ptr(), t.dtype, t.shape) not in live for _, t in named):
            return None  # some weight is not a view of a parameter: nothing to reuse
        return cls(model, named)

    def valid(self) -> bool:
        if not all(len(kids) == len(m._modules) and all(a is b for a, b in zip(kids, m._modules.values()))
                   for m, kids in self._children):
            return False
        return (all(len(m._parameters) == n for m, n in self._counts)
                and all(m._parameters.get(n) is p and _state(p) == state for m, n, p, state in self._slots))


def _state(p: nn.Parameter | None) -> tuple[int, torch.Size] | None:
    return None if p is None else (p.data_ptr(), p.shape)


def _where(client: Any) -> str:
    """The sidecar's address for a message (a Fleet's: each replica's)."""
    if isinstance(client, Fleet):
        return "the fleet (" + ", ".join(r.url for r in client.replicas) + ")"
    return str(getattr(client, "url", "the sidecar"))


def _dist_rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


def _model_device(model: Any) -> torch.device:
    module = model if isinstance(model, nn.Module) else getattr(model, "module", None)
    if isinstance(module, nn.Module):
        for p in module.parameters():
            return p.device
    return torch.device("cpu")


def _ms(t0: float) -> float:
    return round((time.perf_counter() - t0) * 1000.0, 2)


def sampling(**fields: Any) -> SamplingParams:
    """SamplingParams for rollouts (a convenience re-export so trainers need not import inference)."""
    return SamplingParams(**fields)


__all__: Sequence[str] = ("AttachError", "AuditError", "SidecarGoneError", "WeightSyncHook", "sampling")
