"""Sleep and wake: tagged arenas of device memory that can be released and restored in place.

An `Arena` is one region of memory; model parameters and the KV cache are views into it, so releasing
the arena frees them all at once and restoring it makes every view valid again without touching the
module. Three tags exist: "weights" (target model), "draft_weights" (draft model) and "kv_cache".

Levels (`MemoryManager.sleep`): level 1 copies the weights arenas to a host mirror (allocated once,
reused) and releases them; level 2 releases them without a copy (the next weight sync refills them);
the KV cache is released without a copy at both. Module buffers (rotary tables and the like) never
live in an arena, so they survive every level. Invariants:
- An arena is AWAKE (memory present), ASLEEP_MIRRORED (released, bytes held by the host mirror) or
  ASLEEP_EMPTY (released, bytes lost). `contents_valid` is False from a drop until `mark_loaded`.
- Views keep their identity across a cycle; on CUDA also their address (inference/memory/vmm.py).
- Nothing may read or write an asleep arena (on CUDA an illegal address, on CPU freed memory): the
  worker checks `MemoryManager.check_ready()` before running the model.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from inference.core import SidecarError, StateError

WEIGHT_TAGS = ("weights", "draft_weights")
KV_TAG = "kv_cache"
ARENA_TAGS = (*WEIGHT_TAGS, KV_TAG)
# What `wake_up(tags)` accepts: "weights" wakes the target and the draft together.
WAKE_GROUPS: dict[str, tuple[str, ...]] = {"weights": WEIGHT_TAGS, KV_TAG: (KV_TAG,)}
DEFAULT_ALIGN = 256  # bytes; every view starts on this boundary (vectorised kernels want it)
DEFAULT_CHUNK_BYTES = 1 << 30  # copy and mirror in 1 GiB chunks (level 1 pipelines them)
# Physical allocation size on CUDA; None maps each arena as one allocation, so a level-2 wake is one
# cuMemCreate + cuMemMap + cuMemSetAccess per arena (as torch_memory_saver does per tensor).
DEFAULT_ALLOC_BYTES: int | None = None
POISON_BYTE = 0xFF  # all-ones bytes read as NaN in every float dtype


class ArenaFullError(SidecarError, MemoryError):
    """An allocation does not fit in the arena (the arena was sized too small)."""


class DeviceMemoryError(SidecarError, MemoryError):
    """Not enough free device memory to map an arena; the failed attempt left nothing mapped."""

    def __init__(self, message: str, tag: str, needed_bytes: int, free_bytes: int | None) -> None:
        super().__init__(message)
        self.tag = tag
        self.needed_bytes = needed_bytes
        self.free_bytes = free_bytes


class WakeError(DeviceMemoryError):
    """A wake could not map memory (e.g. the trainer still holds it). The arena stays asleep and
    keeps its mirror, so the same wake can be retried once memory is free."""


class ArenaState(str, enum.Enum):
    AWAKE = "awake"
    ASLEEP_MIRRORED = "asleep_mirrored"  # level 1: the host mirror holds the bytes
    ASLEEP_EMPTY = "asleep_empty"  # level 2 or KV cache: the bytes are gone
    CLOSED = "closed"


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def gib(n: int | None) -> str:
    return "unknown" if n is None else f"{n / (1 << 30):.2f} GiB"


def split_chunks(nbytes: int, chunk: int) -> list[tuple[int, int]]:
    """(offset, size) pieces of at most `chunk` bytes that cover [0, nbytes) in order."""
    assert nbytes > 0 and chunk > 0
    return [(off, min(chunk, nbytes - off)) for off in range(0, nbytes, chunk)]


class Arena:
    """One tagged region of memory with a bump allocator; tensors are views of `base` (uint8).

    Subclasses provide `_release(copy_out)` and `_acquire(copy_in)`; this class owns the state
    machine, the chunked host mirror and the views. `chunks` (offset, size) cover `base` exactly.
    """

    def __init__(self, tag: str, base: torch.Tensor, chunks: Sequence[tuple[int, int]]) -> None:
        assert base.dtype == torch.uint8 and base.dim() == 1
        assert sum(size for _, size in chunks) == base.numel()
        self.tag = tag
        self.base = base
        self.chunks = list(chunks)
        self.state = ArenaState.AWAKE
        self.contents_valid = False
        self._used = 0
        self._mirror: list[torch.Tensor] | None = None

    @property
    def nbytes(self) -> int:
        return self.base.numel()

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def device(self) -> torch.device:
        return self.base.device

    @property
    def has_host_mirror(self) -> bool:
        return self._mirror is not None

    def alloc(
        self, shape: Sequence[int] | int, dtype: torch.dtype, align: int = DEFAULT_ALIGN
    ) -> torch.Tensor:
        """Bump-allocate a contiguous tensor; its bytes are whatever the arena holds."""
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        nbytes = math.prod(shape) * dtype.itemsize
        offset = round_up(self._used, max(align, dtype.itemsize))
        if offset + nbytes > self.nbytes:
            raise ArenaFullError(
                f"arena {self.tag!r}: {nbytes} bytes for {shape} {dtype} do not fit "
                f"({self.nbytes - offset} of {self.nbytes} bytes left)"
            )
        self._used = offset + nbytes
        return self.view(offset, dtype, shape)

    def view(self, offset: int, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        """A tensor of `shape` and `dtype` over the arena's bytes starting at `offset`."""
        self._require(ArenaState.AWAKE, "view")
        nbytes = math.prod(shape) * dtype.itemsize
        if offset % dtype.itemsize or offset < 0 or offset + nbytes > self.nbytes:
            raise ArenaFullError(f"arena {self.tag!r}: bad view at {offset} of {nbytes} bytes ({dtype})")
        return self.base[offset : offset + nbytes].view(dtype).view(tuple(shape))

    def owns(self, tensor: torch.Tensor) -> bool:
        """True if `tensor`'s memory lies inside this (awake) arena."""
        if self.state != ArenaState.AWAKE or tensor.device != self.device or tensor.is_meta:
            return False
        start = self.base.data_ptr()
        return start <= tensor.data_ptr() < start + self.nbytes

    def prepare_host_mirror(self) -> None:
        """Allocate the (pinned on CUDA) host mirror now; allocating 15 GB pinned takes seconds."""
        if self._mirror is None:
            pin = self.device.type == "cuda"
            self._mirror = [torch.empty(size, dtype=torch.uint8, pin_memory=pin) for _, size in self.chunks]

    def release_host_mirror(self) -> None:
        """Give the host mirror back; refused while it holds the only copy of the bytes."""
        if self.state == ArenaState.ASLEEP_MIRRORED:
            raise StateError(f"arena {self.tag!r}: the host mirror holds the only copy of the weights")
        self._mirror = None

    def sleep(self, keep: bool) -> int:
        """Release the memory; with `keep` (and valid contents) copy the bytes to the host mirror
        first. Returns the bytes released."""
        self._require(ArenaState.AWAKE, "sleep")
        mirrored = keep and self.contents_valid
        if mirrored:
            self.prepare_host_mirror()
        self._release(copy_out=mirrored)
        self.state = ArenaState.ASLEEP_MIRRORED if mirrored else ArenaState.ASLEEP_EMPTY
        self.contents_valid = mirrored
        return self.nbytes

    def wake(self) -> int:
        """Map memory again (same views) and restore the mirror if there is one; returns bytes.
        On failure the arena stays asleep in its previous state."""
        if self.state == ArenaState.AWAKE or self.state == ArenaState.CLOSED:
            raise StateError(f"arena {self.tag!r}: cannot wake, it is {self.state.value}")
        self._acquire(copy_in=self.state == ArenaState.ASLEEP_MIRRORED)
        self.state = ArenaState.AWAKE
        return self.nbytes

    def close(self) -> None:
        """Free everything; every view into the arena becomes invalid."""
        if self.state != ArenaState.CLOSED:
            if self.state == ArenaState.AWAKE:
                self._release(copy_out=False)
            self._close_backing()
            self._mirror = None
            self.state = ArenaState.CLOSED
            self.contents_valid = False

    def _require(self, state: ArenaState, action: str) -> None:
        if self.state != state:
            raise StateError(f"arena {self.tag!r}: cannot {action} while {self.state.value}")

    def _release(self, copy_out: bool) -> None:
        raise NotImplementedError

    def _acquire(self, copy_in: bool) -> None:
        raise NotImplementedError

    def _close_backing(self) -> None:
        """Called once, after `_release` if the arena was awake."""


class CpuArena(Arena):
    """Plain host memory. Release resizes the storage to 0 bytes (views stay valid objects and see
    the new memory after the resize back; the address may change). A wake without a mirror fills
    the arena with POISON_BYTE so stale data is never silently reused."""

    def __init__(self, tag: str, nbytes: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        nbytes = round_up(max(nbytes, 1), DEFAULT_ALIGN)
        chunks = split_chunks(nbytes, round_up(min(chunk_bytes, nbytes), DEFAULT_ALIGN))
        super().__init__(tag, torch.empty(nbytes, dtype=torch.uint8), chunks)

    def _release(self, copy_out: bool) -> None:
        if copy_out:
            assert self._mirror is not None
            for (off, size), host in zip(self.chunks, self._mirror):
                host.copy_(self.base[off : off + size])
        self.base.untyped_storage().resize_(0)

    def _acquire(self, copy_in: bool) -> None:
        self.base.untyped_storage().resize_(self.nbytes)
        if copy_in:
            assert self._mirror is not None
            for (off, size), host in zip(self.chunks, self._mirror):
                self.base[off : off + size].copy_(host)
        else:
            self.base.fill_(POISON_BYTE)


def module_parameters(module: nn.Module, exclude: Iterable[Arena] = ()) -> list[tuple[str, nn.Parameter]]:
    """The module's parameters, each Parameter object once (tied weights share one entry), minus
    those already living in an arena of `exclude` (e.g. a draft sharing the target's lm_head)."""
    exclude = list(exclude)
    return [
        (name, p)
        for name, p in module.named_parameters(remove_duplicate=True)
        if not any(arena.owns(p) for arena in exclude)
    ]


def parameters_nbytes(params: Iterable[nn.Parameter], align: int = DEFAULT_ALIGN) -> int:
    """Arena bytes needed to hold `params` with `alloc`'s alignment."""
    total = 0
    for p in params:
        total = round_up(total, max(align, p.dtype.itemsize)) + p.numel() * p.element_size()
    return total


def adopt_parameters(
    module: nn.Module, arena: Arena, exclude: Iterable[Arena] = (), align: int = DEFAULT_ALIGN
) -> dict[str, int]:
    """Move every parameter of `module` into `arena`: copy its data (meta tensors have none) and
    point the Parameter at the arena view, so the Parameter objects and the module are unchanged.
    Buffers are left where they are. Returns {parameter name: byte offset in the arena}."""
    offsets: dict[str, int] = {}
    for name, param in module_parameters(module, exclude):
        view = arena.alloc(param.shape, param.dtype, align)
        if param.is_meta:
            # `.data =` refuses meta -> real; swapping the tensor bodies keeps the Parameter object.
            torch.utils.swap_tensors(param, nn.Parameter(view, requires_grad=param.requires_grad))
        else:
            view.copy_(param.data)
            param.data = view
        offsets[name] = view.data_ptr() - arena.base.data_ptr()
    return offsets
