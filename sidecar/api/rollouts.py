"""Rollout pools: groups of samples that outlive any one HTTP call and any one trainer process.

POST /rollouts submits prompts to a pool named by the client; each prompt is one group (its n
samples), queued on the driver as its own request group and held through sleep, a sync or a torn
model (wait "always"). POST /rollouts/take answers once `min_groups` groups are finished (every sample
done), oldest submitted first, or at its timeout with what is ready (only the named groups when it
names them: a fleet's choice); GET /rollouts/{pool} counts and lists the finished ones.
Invariants: a group leaves its pool only in a take's answer, so it is returned at most once, and a
finished group waits in the sidecar until some caller with the same pool id takes it (a trainer
killed between two calls loses nothing). The pools hold at most --max-pool-sequences sequences.
All pool state lives on the event loop's thread; the driver thread only schedules `_settle` there.
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
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from inference.core import DEFAULT_SYNC_POLICY, RequestOutput, SamplingParams, SyncPolicy
from sidecar.api.common import ApiError, ServerState, rank_error_to_api
from sidecar.api.intake import encode_group
from sidecar.api.models import ErrorBody, PromptOut, SamplingParamsModel, SyncFields
from sidecar.ranks.driver import RankError

POOL_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$"
MAX_TAKE_WAIT_S = 3600.0
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
    max_groups: int | None = Field(None, ge=1, description="return at most this many (oldest first); null: all "
                                   "finished ones")
    timeout_s: float = Field(60.0, ge=0.0, le=MAX_TAKE_WAIT_S, description="answer with what is ready after "
                             "this long; the answer comes at once when the pool holds no unfinished group")
    group_ids: list[str] | None = Field(None, max_length=65536, description="only these groups (a fleet takes "
                                        "the ones it chose); null: any")


class PoolCounts(BaseModel):
    pending: int = Field(description="groups submitted and not finished (queued or generating)")
    finished: int = Field(description="groups finished and not taken")
    failed: int = Field(description="groups the ranks failed, not yet reported by a take")
    sequences: int = Field(description="sequences (n per group) of this pool's groups, all states")


class PoolStatus(PoolCounts):
    finished_ids: list[str] = Field(description="the finished groups' ids, oldest submitted first")


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
    groups: list[TakenGroup] = Field(description="finished groups, oldest submitted first; removed from the pool")
    failed: list[FailedGroup] = Field(description="groups the ranks failed (a dead rank): removed, resubmit them")
    counts: PoolCounts = Field(description="what the pool holds after this take")


@dataclass
class _Group:
    group_id: str
    sequences: int
    item: tuple[Any, SamplingParams]  # (tokenized prompt, params): what a resubmission sends again
    sync: SyncPolicy
    output: RequestOutput | None = None
    error: ErrorBody | None = None
    resubmitted: int = 0

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
        self._ids = itertools.count()

    def submit(self, pool: str, work: list[tuple[Any, SamplingParams]],
               sync: SyncPolicy = DEFAULT_SYNC_POLICY) -> list[str]:
        """Queue each (tokenized prompt, params) as a group, all or none: 429 naming prompts past the
        pool bound or the driver's queue bound (checked here, with no await before the submits)."""
        sequences = sum(int(p.n) for _, p in work)
        if self.held + sequences > self.max_sequences:
            raise ApiError(429, "PoolFull", f"the rollout pools hold {self.held} sequences and this call adds "
                           f"{sequences}; the limit is {self.max_sequences} (--max-pool-sequences): take finished "
                           "groups first (POST /rollouts/take)", "prompts")
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
        fut.add_done_callback(lambda f, g=group, p=pool: _on_loop(loop, self._settle, p, g, f))

    def _resubmit_stale(self, pool: str) -> None:
        """A finished group waiting to be taken that is now more than its max_staleness versions behind
        the live one is generated again from its prompt (the engine bounds running groups the same way at
        each sync): a take never returns what the bound refuses, and the group is not lost."""
        live = self._live_version()
        if live is None:
            return
        for group in self._pools.get(pool, {}).values():
            bound = group.sync.max_staleness
            if group.output is not None and bound is not None and live - group.output.weight_version > bound:
                group.output = None
                group.resubmitted += 1
                self._send(pool, group)

    def _settle(self, pool: str, group: _Group, fut: Future) -> None:
        try:
            group.output = fut.result()[0]
        except RankError as e:
            a = rank_error_to_api(e)
            group.error = ErrorBody(type=a.type, message=a.message, field=a.field, rank=a.rank)
        except BaseException as e:  # a cancelled future: nothing here cancels one, so say what it was
            group.error = ErrorBody(type=type(e).__name__, message=str(e) or "the group did not finish")
        event = self._changed.pop(pool, None)
        if event is not None:
            event.set()

    def finished_groups(self) -> int:
        return sum(g.output is not None for groups in self._pools.values() for g in groups.values())

    def counts(self, pool: str) -> PoolCounts:
        groups = self._pools.get(pool, {}).values()
        return PoolCounts(pending=sum(not g.done for g in groups), finished=sum(g.output is not None for g in groups),
                          failed=sum(g.error is not None for g in groups), sequences=sum(g.sequences for g in groups))

    async def take(self, body: TakeRequest, request: Request | None,
                   output_of: Callable[[RequestOutput], PromptOut]) -> TakeResponse:
        """Wait for `min_groups` finished groups (or no unfinished one, or the timeout), then remove and
        return the oldest finished ones. Nothing is removed for a caller that went away while waiting."""
        deadline = time.monotonic() + body.timeout_s
        wanted = set(body.group_ids) if body.group_ids is not None else None
        while True:
            self._resubmit_stale(body.pool)
            groups = self._chosen(body.pool, wanted)
            finished = sum(g.output is not None for g in groups)
            left = deadline - time.monotonic()
            if finished >= body.min_groups or all(g.done for g in groups) or left <= 0:
                break
            event = self._changed.setdefault(body.pool, asyncio.Event())
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(event.wait(), min(left, _POLL_S))
            await _check_connected(request)
        await _check_connected(request)  # no await between this check and the removal below
        self._resubmit_stale(body.pool)
        taken, failed = self._remove(body.pool, self._chosen(body.pool, wanted), body.max_groups)
        version = self._live_version()
        return TakeResponse(pool=body.pool, weight_version=version, counts=self.counts(body.pool),
                            groups=[TakenGroup(group_id=g.group_id, output=output_of(g.output),
                                               resubmitted=g.resubmitted) for g in taken if g.output is not None],
                            failed=[FailedGroup(group_id=g.group_id, error=g.error) for g in failed
                                    if g.error is not None])

    def status(self, pool: str) -> PoolStatus:
        finished = [g.group_id for g in self._pools.get(pool, {}).values() if g.output is not None]
        return PoolStatus(**self.counts(pool).model_dump(), finished_ids=finished)

    def _chosen(self, pool: str, wanted: set[str] | None) -> list[_Group]:
        """The pool's groups in submission order, only those in `wanted` when given."""
        groups = self._pools.get(pool, {}).values()
        return list(groups) if wanted is None else [g for g in groups if g.group_id in wanted]

    def _remove(self, pool: str, chosen: list[_Group], max_groups: int | None) -> tuple[list[_Group], list[_Group]]:
        groups = self._pools.get(pool, {})
        finished = [g for g in chosen if g.output is not None][:max_groups]
        failed = [g for g in groups.values() if g.error is not None]  # reported by the first take, chosen or not
        for g in finished + failed:
            del groups[g.group_id]
            self.held -= g.sequences
        if not groups:
            self._pools.pop(pool, None)
        return finished, failed

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
                 summary="Take finished groups of a pool, oldest first, once min_groups are ready")
    async def take(body: TakeRequest, request: Request) -> TakeResponse:
        return await pools.take(body, request, output_of)

    @router.get("/rollouts/{pool}", response_model=PoolStatus, summary="A rollout pool's counts and finished groups")
    async def status(pool: str) -> PoolStatus:
        if re.fullmatch(POOL_PATTERN, pool) is None:
            raise ApiError(400, "InvalidRequestError", f"must match {POOL_PATTERN}", "pool")
        return pools.status(pool)

    return pools


async def _check_connected(request: Request | None) -> None:
    if request is not None and await request.is_disconnected():
        raise ApiError(499, "ClientClosedRequest", "the client went away; nothing was taken")


def _on_loop(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
    """Run fn on the event loop's thread; at shutdown the loop may be closed, and the pools go with it."""
    if not loop.is_closed():
        loop.call_soon_threadsafe(fn, *args)
