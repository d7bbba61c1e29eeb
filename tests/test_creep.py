"""scripts/tools/creep.py against a real `sidecar launch` on CPU, at a small count: after warm-up every
process of the sidecar keeps its open descriptors exactly and its RSS within 1% (the 1,000-cycle run's
bound: a leak of even a few KiB per cycle, over 30 cycles of a ~350 MiB rank, would show as growth)."""

from __future__ import annotations

import pytest

from scripts.tools import creep


@pytest.mark.slow  # ~1-2 min on the 2-core box: a sidecar and 30 RL cycles
def test_thirty_cycles_leave_rss_and_descriptors_flat_after_warm_up() -> None:
    line = creep.run(creep.parse_args(["--cycles", "30", "--warm-up", "10"]))
    assert line["procs"]["launcher"] and len(line["procs"]) >= 2  # the launcher and its rank
    for name, proc in line["procs"].items():
        assert proc["fds_growth"] == 0, (name, proc)
        assert proc["rss_growth_pct"] is not None and proc["rss_growth_pct"] < 1.0, (name, proc)
    assert line["flat"] and line["gpu_used_mb"]["end"] is None  # no GPU here


def _snap(rss_mb: float, fds: int = 9) -> dict:
    return {"procs": {"launcher": {"pid": 1, "rss": rss_mb * creep.MIB, "fds": fds}}, "gpu_used": None}


def test_the_end_point_forgives_a_transient_spike_but_not_a_rise() -> None:
    args = creep.parse_args(["--cycles", "20", "--warm-up", "5", "--settle", "3"])
    warm = _snap(100.0)
    spike = creep.report_line(args, {"start": warm, "warm": warm, "end": creep.settled([_snap(116), _snap(100.2),
                                                                                         _snap(100.4)])})
    assert spike["flat"] and spike["procs"]["launcher"]["rss_growth_pct"] == 0.2
    rise = creep.report_line(args, {"start": warm, "warm": warm, "end": creep.settled([_snap(102), _snap(103),
                                                                                        _snap(104, fds=10)])})
    assert not rise["flat"] and rise["procs"]["launcher"]["rss_growth_pct"] == 2.0
    assert rise["procs"]["launcher"]["fds_growth"] == 1  # descriptors: the last snapshot's, exactly
