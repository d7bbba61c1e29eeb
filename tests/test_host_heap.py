"""inference/memory/host_heap.py: once frozen, the heap a warm engine left is out of the collector's walks, and
the rule its docstring gives holds: a cycle alive at the freeze stays until gc.unfreeze(), one made
after is collected as usual. In a child process, so the test process's heap is never frozen."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow  # every test here starts real processes or runs for seconds

CHILD = textwrap.dedent("""
    import gc, json, weakref
    from inference.memory.host_heap import freeze_startup_heap
    from inference.engine.llm import LLM

    class Node:
        pass

    def cycle():
        a, b = Node(), Node()
        a.peer, b.peer = b, a
        return a, weakref.ref(a)

    llm = LLM(None, device="cpu", max_model_len=64)
    llm.generate(["warm"], None)
    held, before = cycle()  # alive at the freeze, dropped after it
    done = freeze_startup_heap()
    seconds, frozen = done.seconds, gc.get_freeze_count()
    assert done.objects == frozen
    held, after = cycle()  # the first cycle's last outside reference goes; this one is made after the freeze
    del held
    gc.collect()
    kept_before, kept_after = before() is not None, after() is not None
    gc.unfreeze()
    gc.collect()
    print(json.dumps({"seconds": seconds, "frozen": frozen, "kept_before": kept_before,
                      "kept_after": kept_after, "collected_once_unfrozen": before() is None}))
""")


def test_a_frozen_heap_is_out_of_the_collectors_walks() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["frozen"] > 10_000, got  # the warm engine's process: torch, the model, the runner
    assert got["seconds"] > 0
    assert got["kept_before"] and not got["kept_after"], got  # frozen: never walked; later cycles: collected
    assert got["collected_once_unfrozen"], got
