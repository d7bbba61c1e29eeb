"""CUDA arenas on the driver's virtual memory management API, through NVIDIA's cuda-bindings.

`VmmRange` reserves a virtual address range once (cuMemAddressReserve) and maps physical memory into
it in chunks (cuMemCreate + cuMemMap + cuMemSetAccess); releasing unmaps and frees the physical
memory (cuMemUnmap + cuMemRelease) but keeps the reservation, so the next map lands at the same
address. `CudaArena` wraps the range as one uint8 torch tensor without a copy; parameter and KV
views into it therefore keep their data_ptr across sleep and wake, and captured CUDA graphs stay
valid.

Invariants:
- A chunk is either mapped with read/write access and owns a handle, or unmapped with no handle.
- A map attempt that fails (out of memory or otherwise) unmaps and releases whatever it mapped, so
  a failed wake leaves the arena exactly as asleep as before; it may be retried.
- Every driver call's CUresult is checked; failures raise VmmError naming the call.
- The reservation is freed only by `close()`.
"""

from __future__ import annotations

from typing import Any

import torch

from inference.core import SidecarError
from inference.memory import (
    DEFAULT_CHUNK_BYTES,
    Arena,
    DeviceMemoryError,
    WakeError,
    gib,
    round_up,
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
    mapped and unmapped chunk by chunk. Call from a thread where `device_index` is current."""

    def __init__(
        self, nbytes: int, device_index: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES, driver: Any = None
    ) -> None:
        self._drv = driver if driver is not None else load_driver()
        self.device_index = device_index
        self._call("cuInit", 0)
        self._retained = 0  # primary-context references this object took (released in close)
        self.ensure_context()
        drv = self._drv
        self._prop = drv.CUmemAllocationProp()
        self._prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        self._prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self._prop.location.id = device_index
        self._access = drv.CUmemAccessDesc()
        self._access.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self._access.location.id = device_index
        self._access.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        flag = drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
        self.granularity = int(self._call("cuMemGetAllocationGranularity", self._prop, flag))
        self.nbytes = round_up(max(nbytes, 1), self.granularity)
        chunk = round_up(min(chunk_bytes, self.nbytes), self.granularity)
        self.chunks = [(off, min(chunk, self.nbytes - off)) for off in range(0, self.nbytes, chunk)]
        self.ptr = int(self._call("cuMemAddressReserve", self.nbytes, 0, 0, 0))
        self._handles: list[Any] = [None] * len(self.chunks)
        self.closed = False

    @property
    def mapped_chunks(self) -> int:
        return sum(h is not None for h in self._handles)

    @property
    def mapped_bytes(self) -> int:
        return sum(size for (_, size), h in zip(self.chunks, self._handles) if h is not None)

    def is_out_of_memory(self, err: VmmError) -> bool:
        return err.code == int(self._drv.CUresult.CUDA_ERROR_OUT_OF_MEMORY)

    def ensure_context(self) -> None:
        """Make sure a context is current on this thread (a fresh thread may have none yet)."""
        ctx = self._call("cuCtxGetCurrent")
        if ctx is None or int(ctx) == 0:
            dev = self._call("cuDeviceGet", self.device_index)
            self._call("cuCtxSetCurrent", self._call("cuDevicePrimaryCtxRetain", dev))
            self._retained += 1

    def map_chunk(self, i: int) -> None:
        """Create physical memory for chunk i and map it read/write; undo everything on failure."""
        assert not self.closed and self._handles[i] is None, f"chunk {i} is already mapped"
        off, size = self.chunks[i]
        addr = self._drv.CUdeviceptr(self.ptr + off)
        handle = self._call("cuMemCreate", size, self._prop, 0)
        try:
            self._call("cuMemMap", addr, size, 0, handle, 0)
            try:
                self._call("cuMemSetAccess", addr, size, [self._access], 1)
            except VmmError:
                self._call("cuMemUnmap", addr, size)
                raise
        except VmmError:
            self._call("cuMemRelease", handle)
            raise
        self._handles[i] = handle

    def unmap_chunk(self, i: int) -> None:
        """Unmap chunk i and free its physical memory; a no-op for an unmapped chunk."""
        handle = self._handles[i]
        if handle is None:
            return
        off, size = self.chunks[i]
        self._call("cuMemUnmap", self._drv.CUdeviceptr(self.ptr + off), size)
        self._handles[i] = None
        self._call("cuMemRelease", handle)

    def map_all(self) -> None:
        """Map every chunk; on failure unmap what this call mapped and re-raise."""
        try:
            for i in range(len(self.chunks)):
                self.map_chunk(i)
        except BaseException:
            self.unmap_all()
            raise

    def unmap_all(self) -> None:
        for i in range(len(self.chunks)):
            self.unmap_chunk(i)

    def close(self) -> None:
        """Unmap everything and free the address reservation; the range is unusable afterwards."""
        if self.closed:
            return
        self.unmap_all()
        self._call("cuMemAddressFree", self._drv.CUdeviceptr(self.ptr), self.nbytes)
        for _ in range(self._retained):
            self._call("cuDevicePrimaryCtxRelease", self._call("cuDeviceGet", self.device_index))
        self._retained = 0
        self.closed = True

    def _call(self, name: str, *args: Any) -> Any:
        """Call driver function `name`, raise VmmError unless CUDA_SUCCESS, return its outputs."""
        result = getattr(self._drv, name)(*args)
        err, *outs = result if isinstance(result, tuple) else (result,)
        if int(err) != int(self._drv.CUresult.CUDA_SUCCESS):
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
    """An arena in a VmmRange. Level-1 sleep copies chunk by chunk to a pinned mirror on its own
    stream and unmaps each chunk as soon as its copy is done; wake maps chunk by chunk and queues
    each chunk's host-to-device copy right after mapping it, so mapping overlaps copying."""

    def __init__(
        self,
        tag: str,
        nbytes: int,
        device: torch.device,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        driver: Any = None,
    ) -> None:
        assert device.type == "cuda" and device.index is not None
        with torch.cuda.device(device):
            torch.cuda.init()
            vmm = VmmRange(nbytes, device.index, chunk_bytes, driver)
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
        super().__init__(tag, base, vmm.chunks)

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
                    events.append(self._stream.record_event())
            for i, event in enumerate(events):
                event.synchronize()
                self._vmm.unmap_chunk(i)

    def _acquire(self, copy_in: bool) -> None:
        with torch.cuda.device(self.device):
            self._vmm.ensure_context()
            for attempt in (1, 2):
                try:
                    self._map_and_copy(copy_in)
                    return
                except VmmError as err:
                    if not self._vmm.is_out_of_memory(err):
                        raise
                    if attempt == 2:
                        raise _memory_error(WakeError, "wake", self.tag, self.nbytes, self.device) from err
                # Our own caching allocator may hold free blocks (e.g. left by a weight sync).
                torch.cuda.empty_cache()

    def _map_and_copy(self, copy_in: bool) -> None:
        """Map every chunk, queueing its restore copy right away; roll back on any failure."""
        try:
            for i, (off, size) in enumerate(self.chunks):
                self._vmm.map_chunk(i)
                if copy_in:
                    assert self._mirror is not None
                    with torch.cuda.stream(self._stream):
                        self.base[off : off + size].copy_(self._mirror[i], non_blocking=True)
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
