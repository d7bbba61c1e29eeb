"""The sleep controller: the arenas of one worker by tag, moved through sleep levels and wake-up.

See inference/memory/arenas.py for the arenas themselves and the level semantics.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from inference.core import InvalidRequestError, StateError
from inference.memory.arenas import (
    ARENA_TAGS,
    DEFAULT_ALLOC_BYTES,
    DEFAULT_CHUNK_BYTES,
    KV_TAG,
    WAKE_GROUPS,
    WEIGHT_TAGS,
    Arena,
    ArenaState,
    CpuArena,
    adopt_parameters,
    module_parameters,
    parameters_nbytes,
)


@dataclass
class TransitionStats:
    """What one sleep or wake did. `bytes_by_tag` counts bytes released (sleep) or mapped (wake);
    `skipped_tags` were already in the requested state. Device figures are cudaMemGetInfo, queried
    before and after the transition; `seconds` covers the transition only, not those queries."""

    op: str  # "sleep" or "wake"
    level: int | None
    seconds: float = 0.0
    bytes_by_tag: dict[str, int] = field(default_factory=dict)
    seconds_by_tag: dict[str, float] = field(default_factory=dict)
    skipped_tags: list[str] = field(default_factory=list)
    device_free_before: int | None = None
    device_free_after: int | None = None
    device_total: int | None = None

    @property
    def freed_bytes(self) -> int | None:
        """Device bytes freed (negative for a wake); None off CUDA."""
        if self.device_free_before is None or self.device_free_after is None:
            return None
        return self.device_free_after - self.device_free_before

    def as_dict(self) -> dict:
        return {**asdict(self), "freed_bytes": self.freed_bytes}


class MemoryManager:
    """Owns the arenas of one worker by tag and moves them through sleep and wake.

    Rules: `sleep(level)` puts every awake arena to sleep and is an error when none is awake.
    `wake_up(tags)` is an error when nothing is asleep; within it, arenas that are already awake are
    skipped (listed in `skipped_tags`), so `wake_up(["weights"])` then `wake_up()` wakes the rest and a
    failed wake can simply be retried. Transitions are serialised by a lock; the caller must have
    stopped all work that touches the arenas before calling `sleep`.
    """

    def __init__(
        self,
        device: torch.device | str,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        alloc_bytes: int | None = DEFAULT_ALLOC_BYTES,
    ) -> None:
        """`chunk_bytes`: copy and host-mirror granularity. `alloc_bytes` (CUDA): size of each
        physical allocation backing an arena; None backs each arena with a single allocation."""
        if chunk_bytes < 1:
            raise InvalidRequestError("chunk_bytes", f"must be >= 1, got {chunk_bytes}")
        if alloc_bytes is not None and alloc_bytes < 1:
            raise InvalidRequestError("alloc_bytes", f"must be >= 1 or None, got {alloc_bytes}")
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device.type not in ("cpu", "cuda"):
            raise InvalidRequestError("device", f"arenas live on 'cpu' or 'cuda', got {device}")
        self.device = device
        self.measure_device = True  # query cudaMemGetInfo around each transition (~7 us a query)
        self.chunk_bytes = chunk_bytes
        self.alloc_bytes = alloc_bytes
        self._arenas: dict[str, Arena] = {}
        self._lock = threading.RLock()

    # ---- building -------------------------------------------------------------------------
    def create_arena(self, tag: str, nbytes: int) -> Arena:
        """Allocate (and map) a new awake arena of at least `nbytes`."""
        _check_tags([tag], ARENA_TAGS, "tag")
        with self._lock:
            if tag in self._arenas:
                raise StateError(f"arena {tag!r} already exists")
            if self.device.type == "cuda":
                from inference.memory.vmm import CudaArena  # the driver bindings load only here

                arena: Arena = CudaArena(tag, nbytes, self.device, self.chunk_bytes, self.alloc_bytes)
            else:
                arena = CpuArena(tag, nbytes, self.chunk_bytes)
            self._arenas[tag] = arena
            return arena

    def adopt_module(self, tag: str, module: nn.Module) -> Arena:
        """Create the arena `tag` sized for `module`'s parameters and adopt them into it. Parameters
        already in another arena are shared, not copied. `contents_valid` is True unless some
        parameter was on the meta device (then the loader calls `mark_loaded` after loading)."""
        with self._lock:
            others = [a for t, a in self._arenas.items() if t != tag]
            params = module_parameters(module, others)
            any_meta = any(p.is_meta for _, p in params)  # meta tensors carry no data to copy
            arena = self.create_arena(tag, parameters_nbytes(p for _, p in params))
            adopt_parameters(module, arena, others)
            arena.contents_valid = not any_meta
            return arena

    # ---- queries --------------------------------------------------------------------------
    @property
    def tags(self) -> list[str]:
        return list(self._arenas)

    def arena(self, tag: str) -> Arena:
        if tag not in self._arenas:
            raise InvalidRequestError("tag", f"no arena {tag!r}; arenas: {self.tags}")
        return self._arenas[tag]

    def state(self, tag: str) -> ArenaState:
        return self.arena(tag).state

    def contents_valid(self, tag: str) -> bool:
        return self.arena(tag).contents_valid

    @property
    def is_sleeping(self) -> bool:
        """True while any arena is asleep (a partly woken worker is still sleeping)."""
        return any(a.state != ArenaState.AWAKE for a in self._arenas.values())

    def states(self) -> dict[str, dict[str, object]]:
        return {
            t: {"state": a.state.value, "contents_valid": a.contents_valid} for t, a in self._arenas.items()
        }

    def check_ready(self, tags: Iterable[str] | None = None) -> None:
        """Raise StateError unless the arenas (default: all) are awake and their contents valid."""
        for tag in self._arenas if tags is None else tags:
            arena = self.arena(tag)
            if arena.state != ArenaState.AWAKE:
                raise StateError(f"arena {tag!r} is {arena.state.value}; call wake_up first")
            if not arena.contents_valid and tag != KV_TAG:
                raise StateError(
                    f"arena {tag!r} is awake but holds no valid weights (released at sleep level 2 "
                    "or a weight update did not finish); sync the weights first"
                )

    # ---- loading flags ----------------------------------------------------------------------
    def mark_loaded(self, tag: str) -> None:
        """Declare the awake arena's contents valid (after a weight sync or a load)."""
        arena = self.arena(tag)
        arena._require(ArenaState.AWAKE, "mark loaded")
        arena.contents_valid = True

    def mark_not_loaded(self, tag: str) -> None:
        """Declare the contents invalid (a weight update started or failed half-way)."""
        self.arena(tag).contents_valid = False

    def prepare_host_mirrors(self) -> None:
        """Allocate the weights arenas' host mirrors ahead of the first level-1 sleep."""
        for tag in WEIGHT_TAGS:
            if tag in self._arenas:
                self._arenas[tag].prepare_host_mirror()

    # ---- transitions ----------------------------------------------------------------------
    def sleep(self, level: int) -> TransitionStats:
        """Release every awake arena: level 1 mirrors the weights to the host, level 2 drops them;
        the KV cache is always dropped. KV first, weights last (as SGLang orders it)."""
        if isinstance(level, bool) or level not in (1, 2):
            raise InvalidRequestError("level", f"sleep level must be 1 or 2, got {level!r}")
        with self._lock:
            awake = [t for t in (KV_TAG, *reversed(WEIGHT_TAGS)) if self._awake(t)]
            if not awake:
                raise StateError(
                    "sleep: already asleep (no arena is awake)"
                    if self._arenas
                    else "sleep: there are no arenas to release"
                )
            stats, start = self._begin("sleep", level)
            stats.skipped_tags = [t for t in self._arenas if t not in awake]
            for tag in awake:
                t0 = time.perf_counter()
                stats.bytes_by_tag[tag] = self._arenas[tag].sleep(keep=level == 1 and tag != KV_TAG)
                stats.seconds_by_tag[tag] = time.perf_counter() - t0
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # hand the caching allocator's free blocks back too
            return self._end(stats, start)

    def wake_up(self, tags: Sequence[str] | None = None) -> TransitionStats:
        """Map the arenas of `tags` ("weights" = target and draft, "kv_cache"; None = all) again.
        Raises WakeError if device memory is short; arenas woken before the failure stay awake."""
        if isinstance(tags, str):
            raise InvalidRequestError("tags", f"must be a list of tags, got the string {tags!r}")
        if tags is not None:
            if not tags:
                raise InvalidRequestError("tags", "empty list; pass None to wake everything")
            _check_tags(tags, tuple(WAKE_GROUPS), "tags")
        with self._lock:
            if not self.is_sleeping:
                raise StateError("wake_up: nothing is asleep")
            wanted = [t for g in (tags if tags is not None else WAKE_GROUPS) for t in WAKE_GROUPS[g]]
            targets = [t for t in ARENA_TAGS if t in wanted and t in self._arenas]
            stats, start = self._begin("wake", None)
            for tag in targets:
                if self._awake(tag):
                    stats.skipped_tags.append(tag)
                    continue
                t0 = time.perf_counter()
                stats.bytes_by_tag[tag] = self._arenas[tag].wake()
                stats.seconds_by_tag[tag] = time.perf_counter() - t0
            return self._end(stats, start)

    def close(self) -> None:
        """Free every arena (views become invalid); the manager is empty afterwards."""
        with self._lock:
            for arena in self._arenas.values():
                arena.close()
            self._arenas.clear()

    # ---- helpers --------------------------------------------------------------------------
    def _awake(self, tag: str) -> bool:
        return tag in self._arenas and self._arenas[tag].state == ArenaState.AWAKE

    def _device_free(self) -> tuple[int | None, int | None]:
        if self.device.type != "cuda" or not self.measure_device:
            return None, None
        free, total = torch.cuda.mem_get_info(self.device)
        return free, total

    def _begin(self, op: str, level: int | None) -> tuple[TransitionStats, float]:
        stats = TransitionStats(op=op, level=level)
        stats.device_free_before, stats.device_total = self._device_free()
        return stats, time.perf_counter()

    def _end(self, stats: TransitionStats, t0: float) -> TransitionStats:
        stats.seconds = time.perf_counter() - t0
        stats.device_free_after, _ = self._device_free()
        return stats


def _check_tags(tags: Iterable[str], known: tuple[str, ...], field_name: str) -> None:
    for tag in tags:
        if tag not in known:
            raise InvalidRequestError(field_name, f"unknown tag {tag!r}; known tags: {list(known)}")
