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

`release_free_heap` gives the C heap's free pages back to the system (glibc's malloc_trim): after a
large request is parsed and dropped, glibc keeps the freed memory (a 60 MB body of token ids left the
HTTP process 1.4 GB larger), since its mmap threshold grows with every large block it frees.

At exit the heap is unfrozen (atexit, before the interpreter's teardown): the last collection skips
frozen objects, so extension objects in cycles (Triton's nanobind ones) outlived their module and
nanobind reported each as leaked on every stop.
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import functools
import gc
import time
from dataclasses import dataclass
from typing import Any


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


@functools.lru_cache(maxsize=1)
def _libc() -> Any:
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name) if name else None


def release_free_heap() -> bool:
    """malloc_trim(0): return the C heap's free pages to the system. False where there is no glibc."""
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None) if libc is not None else None
    if trim is None:
        return False
    trim(0)
    return True
