"""Rollout pools: groups of samples that outlive any one HTTP call and any one trainer process.

POST /rollouts submits prompts to a pool named by the client; each prompt is one group (its n
samples), queued on the driver as its own request group and held through sleep, a sync or a torn
model (wait "always"). POST /rollouts/take answers once `min_groups` groups are finished (every sample
done), oldest submitted first (or in completion order), or at its timeout with what is ready (only the
named groups when it names them: a fleet's choice); GET /rollouts/{pool} counts and lists the finished
ones; POST /rollouts/ack acknowledges takes; POST /rollouts/cancel drops groups, aborting their requests.
A take is two-phase: its groups stay in the pool, leased under the answer's ticket and invisible to
other takes, until a later take or an ack acknowledges the ticket; a lease not acknowledged returns its
groups to the pool (in their submission order, so oldest first) after its lease_s, or at once when a
take or ack arrives with `ack` null (a new consumer: the previous one died or lost its answer).
Invariants: a group leaves its pool only when acknowledged or cancelled, so a trainer killed before
its ack, or an answer lost on the wire, loses nothing; an acknowledged group was returned exactly once
to its consumer. The pools hold at most --max-pool-sequences sequences, leased ones included. All pool
state lives on the event loop's thread; the driver thread only schedules `_settle` there.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import re
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from inference.core import DEFAULT_SYNC_POLICY, RequestOutput, SamplingParams, SyncPolicy
from sidecar.api.common import ApiError, ServerState, rank_error_to_api
from sidecar.api.intake import encode_group
from sidecar.api.models import ErrorBody, PromptOut, SamplingParamsModel, SyncFields
from sidecar.ranks.driver import RankError

POOL_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$"
MAX_TAKE_WAIT_S = 3600.0
DEFAULT_LEASE_S = 600.0
TakeOrder = Literal["submitted", "completed"]
_POLL_S = 1.0  # how often a waiting take looks whether its caller went away


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # as every request body (sidecar/api/models.py)


class RolloutsRequest(_Body, SyncFields):
    pool: str = Field(pattern=POOL_PATTERN, description="the pool's id, chosen by the client (a trainer that "
                      "restarts with the same id takes what its predecessor left)")
    prompts: list[str | list[int]] = Field(min_length=1, description="one group per prompt (its n samples); "
                                           "prompts x n at most --max-request-sequences")
    sampling_params: SamplingParamsModel | list[SamplingParamsModel] = Field(
        default_factory=SamplingParamsModel, description="one for all prompts, or one per prompt")


class TakeRequest(_Body):
    pool: str = Field(pattern=POOL_PATTERN)
    min_groups: int = Field(1, ge=0, description="answer as soon as this many groups are finished")
    max_groups: int | None = Field(None, ge=1, description="return at most this many (the first in "
                                   "`order`); null: all finished ones")
    timeout_s: float = Field(60.0, ge=0.0, le=MAX_TAKE_WAIT_S, description="answer with what is ready after "
                             "this long; the answer comes at once when the pool holds no unfinished group")
    group_ids: list[str] | None = Field(None, max_length=65536, description="only these groups (a fleet takes "
                                        "the ones it chose); null: any")
    order: TakeOrder = Field("submitted", description="which finished groups come first: the oldest submitted, or "
                             "the first completed (an iterator of groups as they finish)")
    ack: list[str] | None = Field(None, max_length=65536, description="tickets of earlier takes this consumer is "
                                  "done with: their groups leave the pool for good. null: this consumer holds no "
                                  "ticket (it is new), so every unacknowledged lease of the pool returns to it first")
    lease_s: float = Field(DEFAULT_LEASE_S, ge=0.0, le=MAX_TAKE_WAIT_S, description="how long the answer's groups "
                           "stay leased to this consumer without an ack before they return to the pool; 0: they "
                           "leave the pool with the answer (no ticket; an answer lost on the wire loses them)")


class PoolCounts(BaseModel):
    pending: int = Field(description="groups submitted and not finished (queued or generating)")
    finished: int = Field(description="groups finished and not taken")
    leased: int = Field(description="groups taken and not yet acknowledged (invisible to takes)")
    failed: int = Field(description="groups the ranks failed, not yet reported by a take")
    sequences: int = Field(description="sequences (n per group) of this pool's groups, all states")


class PoolStatus(PoolCounts):
    finished_ids: list[str] = Field(description="the ids of the finished groups not leased, oldest submitted "
                                    "first (order=completed: the first finished first)")


class RolloutsResponse(BaseModel):
    pool: str
    group_ids: list[str] = Field(description="one per prompt, in prompt order")
    counts: PoolCounts


class TakenGroup(BaseModel):
    group_id: str
    output: PromptOut
    resubmitted: int = Field(0, description="times the pool generated this group again because it finished more "
                             "than max_staleness versions behind the live one while it waited to be taken")


class FailedGroup(BaseModel):
    group_id: str
    error: ErrorBody


class TakeResponse(BaseModel):
    pool: str
    weight_version: int | None = Field(description="the live target version as the take answers")
    groups: list[TakenGroup] = Field(description="finished groups in the take's order; leased under `ticket`")
    failed: list[FailedGroup] = Field(description="groups the ranks failed (a dead rank): removed, resubmit them")
    counts: PoolCounts = Field(description="what the pool holds after this take")
    ticket: str | None = Field(None, description="acknowledge it (a later take's ack, or POST /rollouts/ack) once "
                               "the groups are used; null when no group is leased")
    acked: int = Field(0, description="groups the take's ack removed from the pool")


class AckRequest(_Body):
    pool: str = Field(pattern=POOL_PATTERN)
    ack: list[str] | None = Field(max_length=65536, description="as a take's ack: tickets acknowledged; null "
                                  "returns every unacknowledged lease of the pool to it")


class AckResponse(BaseModel):
    pool: str
    acked: int = Field(description="groups the acknowledged tickets removed from the pool")
    counts: PoolCounts


class CancelRequest(_Body):
    pool: str = Field(pattern=POOL_PATTERN)
    group_ids: list[str] | None = Field(None, max_length=65536, description="the groups to drop; null: every "
                                        "group of the pool")


class CancelResponse(BaseModel):
    pool: str
    cancelled: list[str] = Field(description="the groups dropped (running ones aborted on the ranks), in "
                                 "submission order")
    unknown: list[str] = Field(description="named ids the pool does not hold (taken and acknowledged, or never "
                               "submitted)")
    counts: PoolCounts


@dataclass
class _Group:
    group_id: str
    sequences: int
    item: tuple[Any, SamplingParams]  # (tokenized prompt, params): what a resubmission sends again
    sync: SyncPolicy
    output: RequestOutput | None = None
    error: ErrorBody | None = None
    resubmitted: int = 0
    future: Future | None = None  # the driver's, while it generates: what a cancel aborts
    completed: int = 0  # when it finished, counted in settles of every pool: the completion order
    ticket: str | None = None  # the last take that returned it
    leased: bool = False  # held for that take's ack, invisible to other takes

    @property
    def ready(self) -> bool:
        """Finished and free to be taken."""
        return self.output is not None and not self.leased

    @property
    def done(self) -> bool:
        return self.output is not None or self.error is not None


class RolloutPools:
    """Every pool of one sidecar (module docstring). Methods run on the event loop's thread only."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.max_sequences = state.config.max_pool_sequences
        self.held = 0  # sequences of every pool's groups
        self._pools: dict[str, dict[str, _Group]] = {}  # pool -> group id -> group, in submission order
        self._changed: dict[str, asyncio.Event] = {}  # pool -> set when one of its groups settles
        self._leases: dict[str, tuple[str, float]] = {}  # ticket -> (pool, deadline) while its groups are leased
        self._ids = itertools.count()
        self._tickets = itertools.count()
        self._settles = itertools.count(1)

    def submit(self, pool: str, work: list[tuple[Any, SamplingParams]],
               sync: SyncPolicy = DEFAULT_SYNC_POLICY) -> list[str]:
        """Queue each (tokenized prompt, params) as a group, all or none: 429 naming prompts past the
        pool bound or the driver's queue bound (checked here, with no await before the submits)."""
        sequences = sum(int(p.n) for _, p in work)
        if self.held + sequences > self.max_sequences:
            raise ApiError(429, "PoolFull", f"the rollout pools hold {self.held} sequences and this call adds "
                           f"{sequences}; the limit is {self.max_sequences} (--max-pool-sequences): take and "
                           "acknowledge finished groups first (POST /rollouts/take)", "prompts")
        driver = self.state.driver
        if driver.queued_sequences() + sequences > driver.max_queued:
            raise ApiError(429, "QueueFull", f"{driver.queued_sequences()} sequences are queued and this call adds "
                           f"{sequences}; the limit is {driver.max_queued} (--max-queued-sequences): retry later",
                           "prompts")
        groups = self._pools.setdefault(pool, {})
        ids = []
        for item in work:
            group = _Group(f"r{next(self._ids)}", int(item[1].n), item, sync)
            groups[group.group_id] = group
            self.held += group.sequences
            self._send(pool, group)
            ids.append(group.group_id)
        return ids

    def _send(self, pool: str, group: _Group) -> None:
        loop = asyncio.get_running_loop()
        fut = self.state.driver.submit([group.item], wait="always", sync=group.sync)
        group.future = fut
        fut.add_done_callback(lambda f, g=group, p=pool: _on_loop(loop, self._settle, p, g, f))

    def _resubmit_stale(self, pool: str) -> None:
        """A finished group waiting to be taken that is now more than its max_staleness versions behind
        the live one is generated again from its prompt (the engine bounds running groups the same way at
        each sync): a take never returns what the bound refuses, and the group is not lost. A leased
        group is in its consumer's hands already and is left alone."""
        live = self._live_version()
        if live is None:
            return
        for group in self._pools.get(pool, {}).values():
            bound = group.sync.max_staleness
            if group.ready and bound is not None and live - group.output.weight_version > bound:  # type: ignore[union-attr]
                group.output, group.ticket = None, None  # the ack of its old answer no longer covers it
                group.resubmitted += 1
                self._send(pool, group)

    def _settle(self, pool: str, group: _Group, fut: Future) -> None:
        if self._pools.get(pool, {}).get(group.group_id) is not group or fut is not group.future:
            return  # cancelled meanwhile (its future aborted): nothing to record
        group.future = None
        group.completed = next(self._settles)
        try:
            group.output = fut.result()[0]
        except RankError as e:
            a = rank_error_to_api(e)
            group.error = ErrorBody(type=a.type, message=a.message, field=a.field, rank=a.rank)
        except BaseException as e:  # a future cancelled by someone else: say what it was
            group.error = ErrorBody(type=type(e).__name__, message=str(e) or "the group did not finish")
        self._notify(pool)

    def _notify(self, pool: str) -> None:
        event = self._changed.pop(pool, None)
        if event is not None:
            event.set()

    def finished_groups(self) -> int:
        return sum(g.ready for groups in self._pools.values() for g in groups.values())

    def counts(self, pool: str) -> PoolCounts:
        groups = self._pools.get(pool, {}).values()
        return PoolCounts(pending=sum(not g.done for g in groups), finished=sum(g.ready for g in groups),
                          leased=sum(g.leased for g in groups), failed=sum(g.error is not None for g in groups),
                          sequences=sum(g.sequences for g in groups))

    # ---- leases: a take's groups wait for its consumer's ack --------------------------------------
    def acknowledge(self, pool: str, ack: list[str] | None) -> int:
        """A consumer's ack: the groups of the named tickets leave the pool (leased ones, and those whose
        lease ran out but were not taken again since: the consumer holds them). `ack` None: the consumer is
        new, so every lease of the pool ends now and its groups are takeable again. Returns the groups
        removed."""
        self._expire()
        groups = self._pools.get(pool, {})
        if ack is None:
            for ticket in [t for t, (p, _) in self._leases.items() if p == pool]:
                self._release(ticket)
            return 0
        tickets = set(ack)
        done = [g for g in groups.values() if g.ticket in tickets and g.output is not None]
        for ticket in tickets:
            self._leases.pop(ticket, None)
        self._drop(pool, done)
        return len(done)

    def _release(self, ticket: str) -> None:
        pool, _ = self._leases.pop(ticket)
        for g in self._pools.get(pool, {}).values():
            if g.ticket == ticket:
                g.leased = False
        self._notify(pool)

    def _expire(self) -> None:
        now = time.monotonic()
        for ticket in [t for t, (_, deadline) in self._leases.items() if deadline <= now]:
            self._release(ticket)

    def _lease(self, pool: str, taken: list[_Group], lease_s: float) -> str | None:
        """Hold `taken` for the consumer's ack under a new ticket; lease_s 0 removes them at once."""
        if not taken:
            return None
        if lease_s <= 0:
            self._drop(pool, taken)
            return None
        ticket = f"t{next(self._tickets)}"
        self._leases[ticket] = (pool, time.monotonic() + lease_s)
        for g in taken:
            g.ticket, g.leased = ticket, True
        return ticket

    # ---- take, status, cancel -------------------------------------------------------------------
    async def take(self, body: TakeRequest, request: Request | None,
                   output_of: Callable[[RequestOutput], PromptOut]) -> TakeResponse:
        """Acknowledge `body.ack` (or end the pool's leases when it is None), wait for `min_groups`
        finished groups (or no unfinished one, or the timeout), then lease the first ones in `order`.
        Nothing is taken for a caller that went away while waiting."""
        acked = self.acknowledge(body.pool, body.ack)
        wanted = set(body.group_ids) if body.group_ids is not None else None
        await self._wait(body.pool, wanted, body.min_groups, body.timeout_s, request)
        await _check_connected(request)  # no await between this check and the lease below
        self._expire()
        self._resubmit_stale(body.pool)
        chosen = [g for g in self._chosen(body.pool, wanted) if g.ready]
        if body.order == "completed":
            chosen.sort(key=lambda g: g.completed)
        taken = chosen[:body.max_groups]
        failed = [g for g in self._pools.get(body.pool, {}).values() if g.error is not None]  # reported once
        self._drop(body.pool, failed)
        ticket = self._lease(body.pool, taken, body.lease_s)
        groups = [TakenGroup(group_id=g.group_id, output=output_of(g.output), resubmitted=g.resubmitted)  # type: ignore[arg-type]
                  for g in taken]
        errors = [FailedGroup(group_id=g.group_id, error=g.error) for g in failed]  # type: ignore[arg-type]
        return TakeResponse(pool=body.pool, weight_version=self._live_version(), counts=self.counts(body.pool),
                            groups=groups, failed=errors, ticket=ticket, acked=acked)

    async def _wait(self, pool: str, wanted: set[str] | None, min_groups: int, timeout_s: float,
                    request: Request | None) -> None:
        """Until `min_groups` of the chosen groups are ready, none of them is unfinished, or timeout_s; a
        settle wakes it at once (no polling), the caller's presence is checked every _POLL_S."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._expire()
            self._resubmit_stale(pool)
            groups = self._chosen(pool, wanted)
            left = deadline - time.monotonic()
            if sum(g.ready for g in groups) >= min_groups or all(g.done for g in groups) or left <= 0:
                return
            event = self._changed.setdefault(pool, asyncio.Event())
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(event.wait(), min(left, _POLL_S))
            await _check_connected(request)

    def cancel(self, pool: str, group_ids: list[str] | None) -> CancelResponse:
        """Drop the named groups (every group of the pool when None), whatever their state: a running
        one's requests are aborted on the ranks (Driver.abort), a leased one's ack then removes nothing."""
        groups = self._pools.get(pool, {})
        wanted = set(group_ids) if group_ids is not None else None
        chosen = [g for g in groups.values() if wanted is None or g.group_id in wanted]  # leased ones too
        unknown = [gid for gid in dict.fromkeys(group_ids or []) if gid not in groups]
        for g in chosen:
            if g.future is not None:
                future, g.future = g.future, None
                self.state.driver.abort(future)
        self._drop(pool, chosen)
        self._notify(pool)
        return CancelResponse(pool=pool, cancelled=[g.group_id for g in chosen], unknown=unknown,
                              counts=self.counts(pool))

    async def status(self, pool: str, wait_s: float = 0.0, order: TakeOrder = "submitted",
                     request: Request | None = None) -> PoolStatus:
        """The pool's counts and ready groups' ids in `order`; with wait_s, once one is ready or none is
        unfinished (a long poll: a fleet's stream waits on every replica at once this way)."""
        if wait_s > 0:
            await self._wait(pool, None, 1, wait_s, request)
        self._expire()
        ready = [g for g in self._pools.get(pool, {}).values() if g.ready]
        if order == "completed":
            ready.sort(key=lambda g: g.completed)
        return PoolStatus(**self.counts(pool).model_dump(), finished_ids=[g.group_id for g in ready])

    def _chosen(self, pool: str, wanted: set[str] | None) -> list[_Group]:
        """The pool's groups that are not leased, in submission order, only those in `wanted` when given."""
        groups = [g for g in self._pools.get(pool, {}).values() if not g.leased]
        return groups if wanted is None else [g for g in groups if g.group_id in wanted]

    def _drop(self, pool: str, gone: list[_Group]) -> None:
        groups = self._pools.get(pool, {})
        for g in gone:
            if groups.pop(g.group_id, None) is not None:
                self.held -= g.sequences
        if not groups:
            self._pools.pop(pool, None)

    def _live_version(self) -> int | None:
        head = self.state.driver.statuses[0] if self.state.driver.statuses else None
        return head.weight_versions.get("target") if head is not None else None


def add_rollout_routes(router: APIRouter, state: ServerState, check_params: Callable[..., SamplingParams],
                       output_of: Callable[[RequestOutput], PromptOut]) -> RolloutPools:
    """The pool routes on `router`; `check_params` and `output_of` are the generation routes' own
    (sidecar/api/app.py), so a pool's params and outputs read exactly as /generate's."""
    pools = RolloutPools(state)
    state.metrics.add_gauge("sidecar_rollout_pool_sequences", "Sequences held in rollout pools (submitted, not "
                            "taken), bounded by --max-pool-sequences", lambda: pools.held)
    state.metrics.add_gauge("sidecar_rollout_pool_finished_groups", "Finished rollout groups waiting to be taken",
                            pools.finished_groups)

    @router.post("/rollouts", response_model=RolloutsResponse,
                 summary="Submit prompts to a rollout pool: one group (n samples) per prompt")
    async def submit(body: RolloutsRequest) -> RolloutsResponse:
        sp = body.sampling_params
        models = sp if isinstance(sp, list) else [sp] * len(body.prompts)
        if len(models) != len(body.prompts):
            raise ApiError(400, "InvalidRequestError", f"{len(models)} given for {len(body.prompts)} prompts",
                           "sampling_params")
        params = [check_params(m, state, f"sampling_params[{i}]" if isinstance(sp, list) else "sampling_params")
                  for i, m in enumerate(models)]
        try:
            inputs = await encode_group(state.intake, list(body.prompts), params)
        except ApiError as e:
            if e.field == "prompt":
                e.field = "prompts" if e.index is None else f"prompts[{e.index}]"
            raise
        ids = pools.submit(body.pool, list(zip(inputs, params)), body.sync_policy())
        return RolloutsResponse(pool=body.pool, group_ids=ids, counts=pools.counts(body.pool))

    @router.post("/rollouts/take", response_model=TakeResponse,
                 summary="Lease finished groups of a pool, oldest first, once min_groups are ready")
    async def take(body: TakeRequest, request: Request) -> TakeResponse:
        return await pools.take(body, request, output_of)

    @router.post("/rollouts/ack", response_model=AckResponse,
                 summary="Acknowledge takes: their groups leave the pool (null: end the pool's leases)")
    async def ack(body: AckRequest) -> AckResponse:
        acked = pools.acknowledge(body.pool, body.ack)
        return AckResponse(pool=body.pool, acked=acked, counts=pools.counts(body.pool))

    @router.post("/rollouts/cancel", response_model=CancelResponse,
                 summary="Drop groups of a pool (or the whole pool), aborting the running ones")
    async def cancel(body: CancelRequest) -> CancelResponse:
        return pools.cancel(body.pool, body.group_ids)

    @router.get("/rollouts/{pool}", response_model=PoolStatus,
                summary="A rollout pool's counts and finished groups (wait_s: once one is finished)")
    async def status(pool: str, request: Request, wait_s: float = 0.0, order: TakeOrder = "submitted") -> PoolStatus:
        if re.fullmatch(POOL_PATTERN, pool) is None:
            raise ApiError(400, "InvalidRequestError", f"must match {POOL_PATTERN}", "pool")
        if not 0.0 <= wait_s <= MAX_TAKE_WAIT_S:
            raise ApiError(400, "InvalidRequestError", f"must lie in [0, {MAX_TAKE_WAIT_S:g}]", "wait_s")
        return await pools.status(pool, wait_s, order, request)

    return pools


async def _check_connected(request: Request | None) -> None:
    if request is not None and await request.is_disconnected():
        raise ApiError(499, "ClientClosedRequest", "the client went away; nothing was taken")


def _on_loop(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
    """Run fn on the event loop's thread; at shutdown the loop may be closed, and the pools go with it."""
    if not loop.is_closed():
        loop.call_soon_threadsafe(fn, *args)
