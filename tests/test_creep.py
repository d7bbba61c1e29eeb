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
