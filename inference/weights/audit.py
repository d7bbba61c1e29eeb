"""The digests a rank takes of the weights it holds: a sync's audit (overlapped with the sender's digest,
or taken at finish) and, on request, a held manifest.

`launch` starts digesting a session's held regions right behind the writes: under the device rule, on
a GPU, ONE kernel launch queued on the writing stream (`collect` takes its result when update ends);
otherwise on a side thread, after an event recorded behind the writes (finish waits for it). One
RecordDigests per rank (its device digester keeps the segment tables of the layouts it saw, and
launches from one thread at a time).

`agree_on_audit`: with TP > 1 the engine's ranks share one model, whose steps run collectives over
their TP group, so a version goes live on every rank or on none: before any rank makes it live, one
all-reduce of a failed flag over the TP group (the group's own timeout bounds it; TP=1 runs nothing),
and only when some rank failed, one gather of each rank's verdict, so every rank's error names them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from checksum import ChecksumMismatch, Manifest, Report, TensorRecord, compare, pick_algorithm
from inference.core import StateError
from inference.parallel import TPInfo
from inference.transfer.digests import (
    PendingRecords,
    RecordDigests,
    check_algorithm,
    digests_match,
    expected_manifest,
    plain_digests,
)
from inference.weights.installed import held_items
from inference.weights.state import Session

log = logging.getLogger(__name__)


class HeldDigests:
    """One rank's digests of what it holds (see the module docstring)."""

    def __init__(self) -> None:
        self._digests = RecordDigests("received-digest")

    def launch(self, session: Session, device: torch.device | None) -> PendingRecords | None:
        """Start digesting the session's held regions after the work that wrote them; None when some
        tensor never arrived (finish reports it)."""
        held = session.target.held_parts()
        if held is None:
            return None
        items = [(spec.name, region) for spec, region in held]
        # each held region is exactly its spec's dtype and shape (inference/weights/target.py _route); a
        # device launch is ordered behind the writes by its stream, the host path waits for them (`after`)
        return self._digests.launch(items, session.algorithm, after=device, specs=[spec for spec, _ in held])

    def collect(self, session: Session) -> None:
        """Take the session's overlapped device digest and build the received manifest now, when update
        ends (the kernel is done or nearly: it was queued behind the copies), into
        `session.held_received`. A host digest (a side thread, longer) is left to finish; so is any
        failure here (finish takes the digest again and reports it)."""
        pending = session.held_digests
        if pending is None or not pending.on_device:
            return
        try:
            session.held_received = self.received(session)
        except Exception:
            log.debug("collecting the overlapped digest failed; finish takes it again", exc_info=True)

    def received(self, session: Session) -> tuple[list[TensorRecord], Manifest]:
        """(records in manifest order, the received Manifest) of what the session wrote: what `collect`
        took, else the overlapped digest's result, else digests taken now."""
        if session.held_received is not None:
            return session.held_received
        held = session.held_digests.result() if session.held_digests is not None else None
        if held is None:
            held = self.now(session)
        records = session.target.received_records(held)
        return records, session.target.manifest_of(session.version, records)

    def now(self, session: Session) -> list[TensorRecord] | None:
        """The held regions' digests taken now (no overlapped digest ran); None if some tensor is missing."""
        items = session.target.held_items()
        return None if items is None else self._digests.digest(items, session.algorithm)

    def manifest(self, model: nn.Module, which: str, version: int, rank: str, algorithm: str | None) -> Manifest:
        """Every parameter `model` holds (engine names), an FP8 weight's row scales after it
        (weights/installed.py `held_items`), by `algorithm` (None: checksum.pick_algorithm over them, the
        device rule on a GPU)."""
        params = held_items(model)
        rule = pick_algorithm(t for _, t in params) if algorithm is None else check_algorithm(algorithm)
        records = self._digests.digest(params, rule)
        return Manifest(which, version, rank, tuple(records), rule)

    def warm_up(self, device: torch.device) -> None:
        """Compile the device digest for `device` now (seconds, once), so the first sync does not."""
        if device.type == "cuda":
            self._digests.warm_up(device)

    def close(self) -> None:
        self._digests.close()


def early_expected(sender_digests: Any, session: Session, rank: str) -> Manifest | None:
    """The sender's digests as this rank's expected Manifest, built (and so validated) at once; None when
    they are the plain list of the session's rule and length, which `audit_report` compares directly
    (building 2 x hundreds of records per sync only on a mismatch)."""
    if plain_digests(sender_digests, session.algorithm, len(session.specs)) is not None:
        return None
    return _expected(sender_digests, session, rank)


def audit_report(sender_digests: Any, expected: Manifest | None, session: Session, rank: str,
                 records: Sequence[TensorRecord], received: Manifest) -> Report:
    """compare(expected, received), with `expected` as early_expected gave it. `records`: received's
    records in manifest order. Equal plain lists give the Report compare gives when all is equal;
    anything else builds the expected Manifest and compares in full (naming each tensor and the rank)."""
    if expected is None:
        plain = plain_digests(sender_digests, session.algorithm, len(session.specs))
        if plain is not None and digests_match(plain, session.target.audit_specs(), records):
            return Report.build((), [rank], len(records))
        expected = _expected(sender_digests, session, rank)
    return compare(expected, received)


def _expected(sender_digests: Any, session: Session, rank: str) -> Manifest:
    return expected_manifest(sender_digests, which=session.which, version=session.version, rank=rank,
                             specs=session.target.audit_specs(), algorithm=session.algorithm)


def agree_on_audit(tp: TPInfo, device: torch.device | None, rank: str, failure: BaseException | None,
                   report: Report | None, what: str) -> BaseException | None:
    """The verdict every TP rank of the engine shares on one audit (`what` names it): None when every
    rank passed, else the error this rank raises. `failure`: this rank's own (None: it passed, with
    `report`). Every rank must call it at the same point (the ranks apply a sync's commands in step).

    A rank that failed raises its own error. A rank that passed raises ChecksumMismatch over every
    rank's report when each failing rank's failure was one (so it names their tensors and ranks), else
    StateError naming the failing ranks and their errors. A collective that fails (a dead rank, at
    the group's timeout) fails the audit on this rank: no rank may go live without knowing the others.
    """
    if tp.size == 1:
        return failure
    try:
        on_device = device is not None and dist.get_backend(tp.group) == dist.Backend.NCCL  # device tensors only
        flag = torch.tensor([int(failure is not None)], dtype=torch.int32, device=device if on_device else "cpu")
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=tp.group)
        if not flag.item():
            return None
        mine = (rank, failure.report if isinstance(failure, ChecksumMismatch) else report,
                None if failure is None else f"{type(failure).__name__}: {failure}")
        verdicts: list[Any] = [None] * tp.size
        dist.all_gather_object(verdicts, mine, group=tp.group)
    except Exception as e:
        if failure is not None:
            failure.add_note(f"the TP ranks could not agree on {what}: {e}")
            return failure
        return StateError(f"rank {rank}: the TP ranks could not agree on {what} ({type(e).__name__}: {e}); "
                          "this rank's audit passed, but it does not go live alone")
    failed = [(key, message) for key, _, message in verdicts if message is not None]
    names = ", ".join(key for key, _ in failed)
    if failure is not None:
        failure.add_note(f"{what} failed on rank(s) {names}; no TP rank goes live")
        return failure
    reports = [r for _, r, _ in verdicts if r is not None]
    if sum(not r.ok for r in reports) == len(failed):  # every failure was a mismatch
        return ChecksumMismatch(Report.merge(reports))
    said = "; ".join(f"rank {key}: {message}" for key, message in failed)
    return StateError(f"rank {rank}: {what} failed on rank(s) {names} ({said}); this rank's passed, but no TP "
                      "rank goes live alone")
