"""Fair admission (inference/sched/wait_queue.py): one large call cannot hold a small one behind all its
sequences, and a call alone is admitted in arrival order with every slot filled. On the scheduler with
the fake runner of tests/test_scheduler.py, and through a real `sidecar launch`: a small HTTP call that
arrives behind an n=64 call finishes first."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from inference.core import SamplingParams
from inference.sched.scheduler import Scheduler
from inference.sched.sequence import Sequence, SequenceStatus
from sidecar.client import SidecarClient
from tests.helpers_sidecar import launch
from tests.test_scheduler import make


def _add(sched: Scheduler, share: str, prompt: list[int], n: int, max_tokens: int) -> list[Sequence]:
    seqs = Sequence.group(share, prompt, SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True))
    for s in seqs:
        sched.add(s)
    return seqs


def _steps_until_done(sched: Scheduler, runner: Any, seqs: list[Sequence], limit: int = 10_000) -> int:
    for step in range(1, limit):
        batch = sched.schedule()
        sched.commit(batch, runner(batch))
        if all(s.is_finished for s in seqs):
            return step
    raise AssertionError("never finished")


def test_a_small_call_is_admitted_at_the_next_free_slot_not_behind_a_large_one() -> None:
    sched, runner = make(num_blocks=256, max_num_seqs=4, budget=64, prefix=False)
    big = _add(sched, "big", [1, 2, 3], n=64, max_tokens=8)
    batch = sched.schedule()
    sched.commit(batch, runner(batch))
    small = _add(sched, "small", [5, 6], n=1, max_tokens=2)
    steps = _steps_until_done(sched, runner, small)
    assert steps <= 2 * 8 + 2  # one wave of the big call at most (FCFS: 16 waves, ~130 steps)
    assert sum(not s.is_finished for s in big) > 48


def test_samples_waiting_for_their_leader_keep_their_turn_under_prefix_caching() -> None:
    """With prefix caching, samples 1..n-1 wait until sample 0's prompt is computed; they keep their place
    (the front of the queue would have let all 63 go before the small call)."""
    sched, runner = make(num_blocks=512, max_num_seqs=4, budget=64, prefix=True)
    big = _add(sched, "big", list(range(1, 10)), n=64, max_tokens=8)  # 9 tokens: two full blocks to share
    batch = sched.schedule()
    sched.commit(batch, runner(batch))
    small = _add(sched, "small", list(range(20, 29)), n=1, max_tokens=2)
    steps = _steps_until_done(sched, runner, small)
    assert steps <= 2 * 8 + 2
    assert sum(not s.is_finished for s in big) > 48


def test_waiting_calls_take_turns_and_a_call_alone_keeps_every_slot() -> None:
    sched, runner = make(num_blocks=256, max_num_seqs=4, budget=256, prefix=False)
    alone = _add(sched, "alone", [1, 2, 3], n=12, max_tokens=4)
    batch = sched.schedule()
    assert [s.index for s in batch.seqs] == [0, 1, 2, 3]  # arrival order, every slot filled
    sched.commit(batch, runner(batch))
    while not all(s.is_finished for s in alone):
        batch = sched.schedule()
        assert len(batch.seqs) == 4 or not sched.waiting  # a share alone never leaves a slot empty
        sched.commit(batch, runner(batch))
    a = _add(sched, "a", [1, 2], n=6, max_tokens=4)
    b = _add(sched, "b", [3, 4], n=6, max_tokens=4)
    batch = sched.schedule()
    assert [(s.share, s.index) for s in batch.seqs] == [("a", 0), ("b", 0), ("a", 1), ("b", 1)]
    assert all(s.status is SequenceStatus.WAITING for s in a[2:] + b[2:])


@pytest.mark.slow
def test_a_small_http_call_finishes_before_a_large_one_queued_first() -> None:
    server = launch("--max-num-seqs", "2")
    try:
        with SidecarClient(server.url, timeout=120) as c:
            done: list[str] = []
            c.pause()
            try:
                big = threading.Thread(target=lambda: (c.generate(["big"], SamplingParams(
                    n=64, max_tokens=24, ignore_eos=True)), done.append("big")))
                big.start()
                _wait_until(lambda: c.state()["queued_sequences"] == 64)
                small = threading.Thread(target=lambda: (c.generate(["small"], SamplingParams(
                    max_tokens=2, ignore_eos=True)), done.append("small")))
                small.start()
                _wait_until(lambda: c.state()["queued_sequences"] == 65)
            finally:
                c.resume()
            small.join(300)
            big.join(300)
            assert done == ["small", "big"]  # FCFS: the small call waited for 32 waves of the big one
    finally:
        assert server.stop() == 0, server.log


def _wait_until(condition: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.02)
