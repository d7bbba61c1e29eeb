"""CUDA arenas on the driver's virtual memory management API, through NVIDIA's cuda-bindings.

`VmmRange` reserves a virtual address range once (cuMemAddressReserve) and maps physical memory into
it (cuMemCreate + cuMemMap per physical allocation, then one cuMemSetAccess for the whole range);
releasing unmaps and frees the physical memory (cuMemUnmap + cuMemRelease) but keeps the
reservation, so the next map lands at the same address. `CudaArena` wraps the range as one uint8
torch tensor without a copy; parameter and KV views into it therefore keep their data_ptr across
sleep and wake, and captured CUDA graphs stay valid. Invariants:
- An allocation is either mapped (readable and writable once map_all returns) and owns a handle, or
  unmapped with no handle; the reservation is freed only by `close()`.
- A failed map attempt unmaps and releases whatever it mapped, so a failed wake leaves the arena
  exactly as asleep as before; it may be retried. Every CUresult is checked (VmmError names the call).
- A sleep synchronizes once (queued kernels may still use the memory); a level-2 wake neither
  synchronizes nor empties torch's cache (only a retry after an out-of-memory does).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from inference.core import SidecarError
from inference.memory.arenas import (
    DEFAULT_ALIGN,
    DEFAULT_ALLOC_BYTES,
    DEFAULT_CHUNK_BYTES,
    Arena,
    DeviceMemoryError,
    WakeError,
    gib,
    round_up,
    split_chunks,
)


class VmmError(SidecarError, RuntimeError):
    """A CUDA driver call failed; `call` names it and `code` is its CUresult."""

    def __init__(self, call: str, code: int, name: str) -> None:
        super().__init__(f"CUDA driver call {call} failed: {name} ({code})")
        self.call = call
        self.code = code


def load_driver() -> Any:
    """The driver module of cuda-bindings (>= 12.6 / 13), or of the older cuda-python layout."""
    try:
        from cuda.bindings import driver
    except ImportError:
        try:
            from cuda import cuda as driver  # cuda-python < 12.6
        except ImportError as e:
            raise SidecarError(
                "CUDA arenas need NVIDIA's cuda-bindings: pip install 'cuda-bindings>=12.6'"
            ) from e
    return driver


class VmmRange:
    """A reserved device address range of `nbytes` (rounded up to the allocation granularity),
    backed by physical allocations of `alloc_bytes` (None: one allocation for the whole range).
    Call from a thread where `device_index` is current.

    Driver calls per transition with n allocations: map_all is n x (cuMemCreate + cuMemMap) and one
    cuMemSetAccess over the whole range (the driver accepts any fully mapped range of whole
    mappings); unmap_all is one cuMemUnmap over the whole range (as NVIDIA's vectorAddMMAP sample
    does) and n x cuMemRelease. Should a driver refuse an unmap spanning several mappings
    (CUDA_ERROR_INVALID_VALUE), the range falls back to one cuMemUnmap per allocation for good.
    Mapped allocations always form one prefix run: map_all maps in order and rolls back fully;
    unmap_below releases from the front.
    """

    def __init__(
        self, nbytes: int, device_index: int, alloc_bytes: int | None = DEFAULT_ALLOC_BYTES, driver: Any = None
    ) -> None:
        self._drv = driver if driver is not None else load_driver()
        self.device_index = device_index
        self.trace: list[tuple[str, float]] | None = None  # benchmarks set a list: (call, seconds)
        self._call("cuInit", 0)
        self._retained = 0  # primary-context references this object took (released in close)
        self.ensure_context()
        drv = self._drv
        self._prop = drv.CUmemAllocationProp()
        self._prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        self._prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self._prop.location.id = device_index
        access = drv.CUmemAccessDesc()
        access.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = device_index
        access.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = [access]  # built once: every cuMemSetAccess passes the same descriptor list
        flag = drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
        self.granularity = int(self._call("cuMemGetAllocationGranularity", self._prop, flag))
        self.nbytes = round_up(max(nbytes, 1), self.granularity)
        size = self.nbytes if alloc_bytes is None else round_up(min(max(alloc_bytes, 1), self.nbytes), self.granularity)
        self.allocs = split_chunks(self.nbytes, size)
        self.ptr = int(self._call("cuMemAddressReserve", self.nbytes, 0, 0, 0))
        self._addrs = [drv.CUdeviceptr(self.ptr + off) for off, _ in self.allocs]
        self._handles: list[Any] = [None] * len(self.allocs)
        self.span_unmap = True  # one cuMemUnmap may cover several mappings (cleared if refused)
        self.closed = False

    @property
    def mapped_allocs(self) -> int:
        return sum(h is not None for h in self._handles)

    @property
    def mapped_bytes(self) -> int:
        return sum(size for (_, size), h in zip(self.allocs, self._handles) if h is not None)

    def is_out_of_memory(self, err: VmmError) -> bool:
        return err.code == int(self._drv.CUresult.CUDA_ERROR_OUT_OF_MEMORY)

    def ensure_context(self) -> None:
        """Make sure a context is current on this thread (a fresh thread may have none yet)."""
        ctx = self._call("cuCtxGetCurrent")
        if ctx is None or int(ctx) == 0:
            dev = self._call("cuDeviceGet", self.device_index)
            self._call("cuCtxSetCurrent", self._call("cuDevicePrimaryCtxRetain", dev))
            self._retained += 1

    def map_all(self) -> None:
        """Create and map every allocation, then grant read/write access to the whole range in one
        call. On any failure unmap and release what this call mapped, and re-raise."""
        assert not self.closed and self.mapped_allocs == 0, "map_all on a (partly) mapped range"
        try:
            for i, (_, size) in enumerate(self.allocs):
                handle = self._call("cuMemCreate", size, self._prop, 0)
                try:
                    self._call("cuMemMap", self._addrs[i], size, 0, handle, 0)
                except BaseException:
                    self._call("cuMemRelease", handle)
                    raise
                self._handles[i] = handle
            self._call("cuMemSetAccess", self._addrs[0], self.nbytes, self._access, 1)
        except BaseException:
            self.unmap_all()
            raise

    def unmap_all(self) -> None:
        """Unmap everything mapped and free its physical memory; a no-op when nothing is mapped."""
        self.unmap_below(self.nbytes)

    def unmap_below(self, end: int) -> None:
        """Unmap and release every mapped allocation that lies wholly below byte offset `end`
        (level 1 frees each allocation as soon as the copies covering it are done)."""
        mapped = zip(self.allocs, self._handles)
        run = [i for i, ((off, size), h) in enumerate(mapped) if h is not None and off + size <= end]
        if not run:
            return
        assert run == list(range(run[0], run[-1] + 1)), f"mapped allocations {run} are not one run"
        self._unmap_run(run[0], run[-1] + 1)
        for i in run:
            handle, self._handles[i] = self._handles[i], None
            self._call("cuMemRelease", handle)

    def _unmap_run(self, first: int, last: int) -> None:
        """cuMemUnmap allocations [first, last): one call for the run where the driver allows it."""
        if last - first > 1 and self.span_unmap:
            start, end = self.allocs[first][0], sum(self.allocs[last - 1])
            try:
                self._call("cuMemUnmap", self._addrs[first], end - start)
                return
            except VmmError as err:
                if err.code != int(self._drv.CUresult.CUDA_ERROR_INVALID_VALUE):
                    raise
                self.span_unmap = False  # the driver wants one unmap per mapping: use that from now on
        for i in range(first, last):
            self._call("cuMemUnmap", self._addrs[i], self.allocs[i][1])

    def close(self) -> None:
        """Unmap everything and free the address reservation; the range is unusable afterwards."""
        if self.closed:
            return
        self.unmap_all()
        self._call("cuMemAddressFree", self._addrs[0], self.nbytes)
        for _ in range(self._retained):
            self._call("cuDevicePrimaryCtxRelease", self._call("cuDeviceGet", self.device_index))
        self._retained = 0
        self.closed = True

    def _call(self, name: str, *args: Any) -> Any:
        """Call driver function `name`, raise VmmError unless CUDA_SUCCESS, return its outputs."""
        fn = getattr(self._drv, name)
        if self.trace is None:
            result = fn(*args)
        else:
            t0 = time.perf_counter()
            result = fn(*args)
            self.trace.append((name, time.perf_counter() - t0))
        err, *outs = result if isinstance(result, tuple) else (result,)
        if int(err) != 0:  # CUDA_SUCCESS is 0 in every CUresult
            raise VmmError(name, int(err), _error_name(self._drv, err))
        if not outs:
            return None
        return outs[0] if len(outs) == 1 else tuple(outs)


def _error_name(drv: Any, err: Any) -> str:
    try:
        code, name = drv.cuGetErrorName(err)
        return name.decode() if int(code) == 0 and isinstance(name, bytes) else str(err)
    except Exception:  # naming the error must never hide it
        return str(err)


class _DeviceBuffer:
    """The minimal __cuda_array_interface__ torch needs to wrap `nbytes` at `ptr` without a copy.
    torch keeps this object alive for as long as the tensor lives."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
        }


class CudaArena(Arena):
    """An arena in a VmmRange. `chunks` (copy and mirror pieces of `chunk_bytes`) are independent of
    the range's physical allocations (`alloc_bytes`). Level-1 sleep copies chunk by chunk to the
    pinned mirror on its own stream and frees each allocation once the copies covering it are done;
    level-1 wake maps everything first, then queues every chunk's host-to-device copy."""

    def __init__(
        self,
        tag: str,
        nbytes: int,
        device: torch.device,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        alloc_bytes: int | None = DEFAULT_ALLOC_BYTES,
        driver: Any = None,
    ) -> None:
        assert device.type == "cuda" and device.index is not None
        with torch.cuda.device(device):
            torch.cuda.init()
            vmm = VmmRange(nbytes, device.index, alloc_bytes, driver)
            try:
                try:
                    vmm.map_all()
                except VmmError as err:
                    if vmm.is_out_of_memory(err):
                        raise _memory_error(DeviceMemoryError, "create", tag, vmm.nbytes, device) from err
                    raise
                base = torch.as_tensor(_DeviceBuffer(vmm.ptr, vmm.nbytes), device=device)
                assert base.data_ptr() == vmm.ptr and base.numel() == vmm.nbytes, "torch copied the arena"
                self._stream = torch.cuda.Stream(device)
            except BaseException:
                vmm.close()
                raise
        self._vmm = vmm
        super().__init__(tag, base, split_chunks(vmm.nbytes, round_up(min(chunk_bytes, vmm.nbytes), DEFAULT_ALIGN)))

    @property
    def vmm(self) -> VmmRange:
        return self._vmm

    def _release(self, copy_out: bool) -> None:
        with torch.cuda.device(self.device):
            self._vmm.ensure_context()
            torch.cuda.synchronize(self.device)  # no queued kernel may touch memory being unmapped
            if not copy_out:
                self._vmm.unmap_all()
                return
            assert self._mirror is not None
            events = []
            with torch.cuda.stream(self._stream):
                for (off, size), host in zip(self.chunks, self._mirror):
                    host.copy_(self.base[off : off + size], non_blocking=True)
                    events.append((off + size, self._stream.record_event()))
            for end, event in events:
                event.synchronize()
                self._vmm.unmap_below(end)
            assert self._vmm.mapped_allocs == 0

    def _acquire(self, copy_in: bool) -> None:
        with torch.cuda.device(self.device):
            self._vmm.ensure_context()
            self._map_or_raise()
            if copy_in:
                self._restore()

    def _map_or_raise(self) -> None:
        """Map the range; on out-of-memory empty torch's cache once and retry, then raise WakeError."""
        for attempt in (1, 2):
            try:
                self._vmm.map_all()
                return
            except VmmError as err:
                if not self._vmm.is_out_of_memory(err):
                    raise
                if attempt == 2:
                    raise _memory_error(WakeError, "wake", self.tag, self.nbytes, self.device) from err
            # Our own caching allocator may hold free blocks (e.g. left by a weight sync).
            torch.cuda.empty_cache()

    def _restore(self) -> None:
        """Copy the host mirror back into the (mapped) arena; on failure unmap again and re-raise."""
        assert self._mirror is not None
        try:
            with torch.cuda.stream(self._stream):
                for (off, size), host in zip(self.chunks, self._mirror):
                    self.base[off : off + size].copy_(host, non_blocking=True)
            self._stream.synchronize()
        except BaseException:
            self._stream.synchronize()  # queued copies must finish before their memory goes away
            self._vmm.unmap_all()
            raise

    def _close_backing(self) -> None:
        with torch.cuda.device(self.device):
            self._vmm.ensure_context()
            self._vmm.close()


def _memory_error(
    cls: type[DeviceMemoryError], action: str, tag: str, needed: int, device: torch.device
) -> DeviceMemoryError:
    """The typed error for a map that ran out of device memory, with the figures that explain it."""
    free, _ = torch.cuda.mem_get_info(device)
    return cls(
        f"cannot {action} arena {tag!r} on {device}: it needs {gib(needed)} ({needed} bytes) of device "
        f"memory but only {gib(free)} ({free} bytes) are free; is the trainer still holding it? "
        "Nothing stays mapped from this attempt; retry once memory is free.",
        tag,
        needed,
        free,
    )
