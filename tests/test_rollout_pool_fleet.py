"""Fleet.rollouts(min_groups=...) over two real `sidecar launch` replicas of the tiny model (CPU): groups
spread over both, every group returned exactly once, oldest first across replicas, a stream yields them as
they finish (Fleet.iter_rollouts), and the groups of a replica that dies are placed again on the other."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator

import pytest

from inference.core import SamplingParams
from tests.helpers_sidecar import Sidecar, launch
from trainer_hooks.fleet import Fleet

pytestmark = pytest.mark.slow  # every test here starts real processes or runs for seconds


@pytest.fixture
def replicas() -> Iterator[list[Sidecar]]:
    procs = [launch(), launch("--dp-rank", "1")]
    try:
        yield procs
    finally:
        for p in procs:
            p.stop()


def _params(length: int) -> SamplingParams:
    return SamplingParams(n=2, temperature=1.0, max_tokens=length, ignore_eos=True)


def test_fleet_rollouts_take_each_group_once_oldest_first(replicas: list[Sidecar]) -> None:
    with Fleet([r.url for r in replicas]) as fleet:
        # oldest first across replicas: 4 finished groups, placed alternately, come back in submission order
        first = fleet.rollouts([[10 + i, 11, 12] for i in range(4)], _params(2), min_groups=4, max_groups=1)
        deadline = time.monotonic() + 60
        while sum(r.client.rollout_counts("default")["finished"] for r in fleet.replicas) < 3:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        rest = fleet.rollouts([], min_groups=3)
        order = [o.prompt_token_ids[0] for o in first.groups + rest.groups]
        assert order == [10, 11, 12, 13], order
        assert {o.metrics["replica"] for o in first.groups + rest.groups} == {0, 1}
        assert rest.counts["pending"] == rest.counts["finished"] == 0 and rest.counts["leased"] == 3
        fleet.ack_rollouts()  # what the next call does: the taken groups leave their sidecars
        assert sum(r.client.rollout_counts("default")["sequences"] for r in fleet.replicas) == 0

        # partial steps: every submitted group exactly once
        seen: list[str] = []
        prompts = 0
        for _ in range(3):
            batch = fleet.rollouts([[30 + prompts + j, 1, 2] for j in range(3)],
                                   [_params(n) for n in (3, 80, 5)], min_groups=2)
            prompts += 3
            assert len(batch.groups) == 2 and len(batch.submitted) == 3
            seen += [o.request_id for o in batch.groups]
        seen += [o.request_id for o in fleet.rollouts([], min_groups=99, max_groups=99).groups]
        assert len(seen) == len(set(seen)) == prompts

        # a stream yields each group as it finishes, whichever replica it ran on (long polls, no 50 ms polling)
        stream = fleet.iter_rollouts([[70 + i, 1, 2] for i in range(4)], [_params(n) for n in (300, 3, 60, 8)],
                                     count=3)
        got = [(len(o.outputs[0].token_ids), o.metrics["replica"]) for o in stream]
        assert sorted(n for n, _ in got[:2]) == [3, 8] and got[2][0] == 60 and {r for _, r in got} == {0, 1}
        rest = list(fleet.iter_rollouts([], count=5))  # only the long one is left: the stream ends with it
        assert [len(o.outputs[0].token_ids) for o in rest] == [300] and len(stream.submitted) == 4
        fleet.ack_rollouts()
        assert sum(r.client.rollout_counts("default")["sequences"] for r in fleet.replicas) == 0

        # cancel by fleet id, then the whole pool on every replica: nothing left generating anywhere
        ids = fleet.rollouts([[90 + i, 1, 2] for i in range(3)], _params(1500), min_groups=0).submitted
        one = fleet.cancel_rollouts([ids[0], "dp9/r1"])
        assert one == {"cancelled": [ids[0]], "unknown": ["dp9/r1"]}
        assert sorted(fleet.cancel_rollouts()["cancelled"]) == sorted(ids[1:])
        deadline = time.monotonic() + 30
        while any(r.client.state()["engine_unfinished"] for r in fleet.replicas):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert sum(r.client.rollout_counts("default")["sequences"] for r in fleet.replicas) == 0


def test_a_dead_replicas_groups_are_placed_again(replicas: list[Sidecar]) -> None:
    with Fleet([r.url for r in replicas]) as fleet:
        step = fleet.rollouts([[50 + i, 1, 2] for i in range(4)], [_params(3)] + [_params(1500)] * 3, min_groups=1)
        assert [o.prompt_token_ids[0] for o in step.groups] == [50]
        replicas[1].proc.send_signal(signal.SIGKILL)  # dp1 holds some of the long groups
        rest = fleet.rollouts([], min_groups=3, timeout_s=120.0)
        assert sorted(o.prompt_token_ids[0] for o in rest.groups) == [51, 52, 53]
        assert all(len(c.token_ids) == 1500 for o in rest.groups for c in o.outputs)
        assert {o.metrics["replica"] for o in rest.groups} == {0}
        assert 1 not in fleet.in_rotation
