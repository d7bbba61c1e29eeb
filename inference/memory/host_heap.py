"""A long-lived engine process and Python's cyclic garbage collector.

By the time an engine is warm, its process holds a few hundred thousand objects the collector tracks
(torch, Triton, the model's modules, the captured graphs' bookkeeping): 228k in a CPU process holding
the Qwen2-0.5B shape, where one full collection takes over 100 ms on a small host. The collector runs a full
collection whenever enough new objects survived (a quarter of the old ones), and it walks every one of
those startup objects each time: a host stall of that length in the middle of a rollout step or of a
weight sync. `freeze_startup_heap` moves them to the collector's permanent generation (gc.freeze), so
later collections walk only what was allocated after the engine was built; vLLM's and SGLang's engine
processes do the same.

Rule: freeze in a process that keeps its engine until it exits (a rank, the sidecar's HTTP process, a
benchmark's run); a process that drops an engine and goes on calls gc.unfreeze() first, or the
engine's reference cycles (and the device memory they hold) are never collected.

At exit the heap is unfrozen (atexit, before the interpreter's teardown): the last collection skips
frozen objects, so extension objects in cycles (Triton's nanobind ones) outlived their module and
nanobind reported each as leaked on every stop.
"""

from __future__ import annotations

import atexit
import gc
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class HeapFreeze:
    """What freeze_startup_heap did: the seconds its collection took (what each full collection would have
    cost from then on) and the objects it froze. Callers keep `objects`: gc.get_freeze_count() walks the
    whole frozen list (15 ms for 166k objects on the CPU box), far too slow to ask per engine step."""

    seconds: float
    objects: int


def freeze_startup_heap() -> HeapFreeze:
    """Collect once, then freeze every object alive now (gc.freeze)."""
    t0 = time.perf_counter()
    gc.collect()
    elapsed = time.perf_counter() - t0
    gc.freeze()
    atexit.unregister(gc.unfreeze)  # once, however often a process freezes
    atexit.register(gc.unfreeze)
    return HeapFreeze(elapsed, gc.get_freeze_count())
