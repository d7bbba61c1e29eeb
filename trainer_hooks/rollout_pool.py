"""The trainer's side of a sidecar's rollout pools (sidecar/api/rollouts.py): a take's answer, the
tickets a client has not acknowledged, a stream of groups in completion order, and the staleness of
what was taken.

A pool is named by the trainer; its groups (one prompt's n samples) live in the sidecar until a take
that returned them is acknowledged, so a trainer killed before its ack, or an answer lost on the wire,
loses nothing: a restarted trainer with the same pool id takes them again (its first take says it is
a new consumer). Staleness of a sample: how many versions its oldest token is behind the live target
version when it was taken (its weight_version_spans; without spans, its weight_version).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from inference.core import RequestOutput

DEFAULT_POOL = "default"
TAKE_MARGIN_S = 30.0  # the HTTP timeout of a take: its own wait plus this
STREAM_WAIT_S = 30.0  # the longest one take of a stream waits in the sidecar (it answers as a group finishes)
TakeOrder = Literal["submitted", "completed"]


@dataclass
class RolloutTake:
    """One take's answer: `groups` are RequestOutputs (request_id = the group id), oldest submitted first;
    `failed` maps the id of each group the ranks failed to its error message (resubmit those);
    `counts` is what the pool holds after the take; `weight_version` the live one at the take
    (a fleet's: its version)."""

    groups: list[RequestOutput]
    weight_version: int | None
    failed: dict[str, str] = field(default_factory=dict)
    counts: dict[str, Any] = field(default_factory=dict)
    submitted: list[str] = field(default_factory=list)  # the groups the call submitted (SidecarClient.rollouts)
    ticket: str | None = None  # what acknowledges these groups (the client's next take of the pool does)


class Tickets:
    """A client's unacknowledged takes, per pool. A pool absent here was never taken from by this client:
    its next take or ack sends `ack` null (a new consumer: the pool's leases return to it first)."""

    def __init__(self) -> None:
        self._held: dict[str, list[str]] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def acking(self, pool: str, ack: bool) -> Iterator[list[str] | None]:
        """The `ack` field of a take or ack of `pool`: every held ticket when `ack`, none otherwise (None for
        a new consumer). The tickets are handed back if the call fails (an ack is idempotent)."""
        with self._lock:
            held = self._held.get(pool)
            sent: list[str] | None = None if held is None else (held if ack else [])
            self._held[pool] = [] if held is None or ack else held
        try:
            yield sent
        except BaseException:
            if sent:
                with self._lock:
                    self._held[pool] = sent + self._held[pool]
            raise

    def hold(self, pool: str, ticket: str | None) -> None:
        if ticket is not None:
            with self._lock:
                self._held.setdefault(pool, []).append(ticket)

    def held(self, pool: str) -> list[str] | None:
        with self._lock:
            held = self._held.get(pool)
            return None if held is None else list(held)


class RolloutStream:
    """Finished groups one by one, in completion order, from repeated takes (`take(max_groups, wait_s,
    first)` answers once one group is finished, with at most max_groups): until `count` came, none is left
    unfinished, or `timeout_s` passed. Each take waits in the sidecar (a long poll), none polls."""

    def __init__(self, take: Callable[[int, float, bool], RolloutTake], count: int, timeout_s: float,
                 submitted: list[str]) -> None:
        self._take, self.count, self.submitted = take, count, submitted
        self.deadline = time.monotonic() + timeout_s
        self.failed: dict[str, str] = {}
        self.counts: dict[str, Any] = {}
        self.weight_version: int | None = None
        self.groups: list[RequestOutput] = []  # yielded so far

    def __iter__(self) -> Iterator[RequestOutput]:
        first = True
        while len(self.groups) < self.count:
            left = self.deadline - time.monotonic()
            if left <= 0 and not first:
                return
            take = self._take(self.count - len(self.groups), max(0.0, min(left, STREAM_WAIT_S)), first)
            first = False
            self.failed.update(take.failed)
            self.counts, self.weight_version = take.counts, take.weight_version
            for group in take.groups:
                self.groups.append(group)
                yield group
            if not take.groups and not take.counts.get("pending", 0) and not take.counts.get("finished", 0):
                return  # nothing left that could finish


def prompt_list(prompts: Any) -> list[Any]:
    """The client's rule: a string or a list of token ids is one prompt."""
    if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


def sync_fields(on_sync: str | None, max_staleness: int | None) -> dict[str, Any]:
    """The sync policy's fields that are set, as the generation bodies and calls carry them (an unset one
    is the sidecar's own: its --on-sync, no staleness bound); the sidecar validates them."""
    return {k: v for k, v in (("on_sync", on_sync), ("max_staleness", max_staleness)) if v is not None}


def oldest_version(completion: Any, fallback: int) -> int:
    """The version of a sample's oldest token (its spans' smallest; `fallback` when it has none)."""
    spans = getattr(completion, "weight_version_spans", None) or []
    return min((int(v) for _, v in spans), default=fallback)


def staleness(outputs: Sequence[RequestOutput], live: int | None) -> tuple[dict[int, int], dict[int, int]]:
    """Histograms {versions behind `live`: count} of the samples (by their oldest token) and of the tokens
    (each token by the version that produced it). `live` None: the newest version among the outputs."""
    if live is None:
        live = max((o.weight_version for o in outputs), default=0)
        live = max([live] + [int(v) for o in outputs for c in o.outputs for _, v in c.weight_version_spans])
    samples: Counter[int] = Counter()
    tokens: Counter[int] = Counter()
    for o in outputs:
        for c in o.outputs:
            samples[live - oldest_version(c, o.weight_version)] += 1
            spans = sorted((int(s), int(v)) for s, v in c.weight_version_spans) or [(0, o.weight_version)]
            ends = [s for s, _ in spans[1:]] + [len(c.token_ids)]
            for (start, version), end in zip(spans, ends):
                if end > start:
                    tokens[live - version] += end - start
    return dict(sorted(samples.items())), dict(sorted(tokens.items()))
