"""Async scheduling's step (docs/dev/design.md, "Async scheduling"): launch step i+1, then read back and
commit step i, which leaves step i+1 in flight on the device while the host returns.

`StepOverlap` owns the one step in flight; `LLM.step` hands it each scheduled batch. Invariants: at
most one step is in flight; every placeholder token (inference/sched/sequence.py) stands for a token of the
step launched last, because the scheduler's `advance` (placeholders for a launched step) runs only
after the commit of the step before it, and that commit happens before the next schedule().
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from inference.engine.step_stats import StepLog
from inference.engine.worker import Worker
from inference.runner.runner import InFlightStep
from inference.sched.scheduler import ScheduledBatch, Scheduler, StepResult
from inference.sched.sequence import Sequence

# commits a step's results (with its stop strings): the sequences that finished
ApplyResults = Callable[[ScheduledBatch, list[StepResult], Callable[..., list[Sequence]]], list[Sequence]]


@dataclass
class _Launched:
    """A launched step whose tokens are not read back yet."""

    batch: ScheduledBatch
    handle: InFlightStep
    log: StepLog | None  # the step log it was counted in, and its open record (StepLog.begin)
    record: Any


class StepOverlap:
    """The step in flight of one engine, and the async step over it."""

    def __init__(self, scheduler: Scheduler, worker: Worker, apply_results: ApplyResults) -> None:
        self.scheduler = scheduler
        self.worker = worker
        self.apply_results = apply_results  # LLM._apply_results: versions, commit, stop strings
        self.in_flight: _Launched | None = None

    def step(self, batch: ScheduledBatch, log: StepLog | None) -> list[Sequence]:
        """Launch `batch` (it may be empty), then read back and commit the step in flight before it;
        return the sequences that finished in that one.

        The batch was scheduled as if every pending token were known; its rows fetch those tokens on
        the device. Its own tokens become placeholders only after the commit, so every token the
        commit's stop strings and the batch's block registrations read is known. A launched step whose
        rows all belong to finished sequences is read back at once (nothing is left to run)."""
        launched = None
        if not batch.is_empty:
            launched = _Launched(batch, self.worker.execute_model(batch, overlap=True), log,
                                 log.begin(batch) if log is not None else None)
        finished = self.finish()
        if launched is not None:
            self.scheduler.advance(batch)
            self.in_flight = launched
            if not self.scheduler.has_unfinished():
                finished += self.finish()
        return finished

    def finish(self) -> list[Sequence]:
        """Read back and commit the step in flight, if any (its one host sync); what finished in it."""
        step, self.in_flight = self.in_flight, None
        if step is None:
            return []
        finished = self.apply_results(step.batch, step.handle.results(), self.scheduler.commit_pending)
        if step.log is not None:
            step.log.end(step.record, len(finished))
        return finished
