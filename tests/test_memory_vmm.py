"""The VMM range logic of sleep and wake (inference/memory/vmm.py) against a fake driver, on the CPU:
one allocation per arena at a stable address, rollback of a partial map, failed driver calls named
and nothing leaked, the per-allocation unmap fallback, and partial unmaps."""

from __future__ import annotations

import enum
from types import SimpleNamespace

import pytest


class FakeResult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2


def _struct(**fields: object) -> SimpleNamespace:
    return SimpleNamespace(location=SimpleNamespace(type=None, id=None), **fields)


class FakeDriver:
    """Just enough of cuda.bindings.driver: physical memory is a byte budget, mappings are address
    ranges. Like the driver, cuMemSetAccess and cuMemUnmap accept a range only if it is tiled exactly
    by whole mappings; with `span_unmap=False` an unmap must cover exactly one mapping."""

    CUresult = FakeResult
    CUmemAllocationType = SimpleNamespace(CU_MEM_ALLOCATION_TYPE_PINNED=1)
    CUmemLocationType = SimpleNamespace(CU_MEM_LOCATION_TYPE_DEVICE=1)
    CUmemAccess_flags = SimpleNamespace(CU_MEM_ACCESS_FLAGS_PROT_READWRITE=3)
    CUmemAllocationGranularity_flags = SimpleNamespace(CU_MEM_ALLOC_GRANULARITY_RECOMMENDED=1)
    CUdeviceptr = int
    GRAN = 2 << 20
    BASE = 1 << 40

    def __init__(self, capacity: int, span_unmap: bool = True) -> None:
        self.free = capacity
        self.span_unmap = span_unmap
        self.handles: dict[int, int] = {}  # handle -> size
        self.mapped: dict[int, tuple[int, int]] = {}  # start address -> (size, handle)
        self.accessible: set[int] = set()  # mapping starts granted read/write access
        self.reserved: dict[int, int] = {}
        self.calls: list[str] = []  # every cu* call made, in order
        self.fail: dict[str, list] = {}  # call name -> [successes left, error to return then]
        self._next_handle = 100

    def CUmemAllocationProp(self) -> SimpleNamespace:  # the driver's spelling
        return _struct(type=None)

    def CUmemAccessDesc(self) -> SimpleNamespace:
        return _struct(flags=None)

    def __getattr__(self, name: str):  # every cu* call goes through the failure injector
        impl = object.__getattribute__(self, "_" + name)

        def call(*args: object) -> tuple:
            self.calls.append(name)
            if name in self.fail:
                self.fail[name][0] -= 1
                if self.fail[name][0] < 0:
                    return (self.fail.pop(name)[1], None)
            return impl(*args)

        return call

    def tiling(self, ptr: int, size: int) -> list[int] | None:
        """Starts of the mappings that tile [ptr, ptr + size) exactly, or None."""
        starts, at = [], ptr
        while at < ptr + size and at in self.mapped:
            starts.append(at)
            at += self.mapped[at][0]
        return starts if at == ptr + size else None

    def _cuInit(self, flags: int) -> tuple:
        return (FakeResult.CUDA_SUCCESS,)

    def _cuCtxGetCurrent(self) -> tuple:
        return (FakeResult.CUDA_SUCCESS, 1)

    def _cuGetErrorName(self, err: FakeResult) -> tuple:
        return (FakeResult.CUDA_SUCCESS, err.name.encode())

    def _cuMemGetAllocationGranularity(self, prop: object, flag: int) -> tuple:
        return (FakeResult.CUDA_SUCCESS, self.GRAN)

    def _cuMemAddressReserve(self, size: int, align: int, addr: int, flags: int) -> tuple:
        self.reserved[self.BASE] = size
        return (FakeResult.CUDA_SUCCESS, self.BASE)

    def _cuMemAddressFree(self, ptr: int, size: int) -> tuple:
        assert self.reserved.pop(ptr) == size and not self.mapped
        return (FakeResult.CUDA_SUCCESS,)

    def _cuMemCreate(self, size: int, prop: SimpleNamespace, flags: int) -> tuple:
        assert prop.type == 1 and size % self.GRAN == 0
        if size > self.free:
            return (FakeResult.CUDA_ERROR_OUT_OF_MEMORY, None)
        self.free -= size
        handle = self._next_handle
        self._next_handle += 1
        self.handles[handle] = size
        return (FakeResult.CUDA_SUCCESS, handle)

    def _cuMemRelease(self, handle: int) -> tuple:
        assert all(h != handle for _, h in self.mapped.values()), "released a handle that is still mapped"
        self.free += self.handles.pop(handle)
        return (FakeResult.CUDA_SUCCESS,)

    def _cuMemMap(self, ptr: int, size: int, offset: int, handle: int, flags: int) -> tuple:
        assert self.handles[handle] == size and offset == 0
        assert ptr >= self.BASE and ptr + size <= self.BASE + self.reserved[self.BASE]
        assert all(ptr + size <= s or s + n <= ptr for s, (n, _) in self.mapped.items()), "overlapping map"
        self.mapped[ptr] = (size, handle)
        return (FakeResult.CUDA_SUCCESS,)

    def _cuMemSetAccess(self, ptr: int, size: int, descs: list, count: int) -> tuple:
        starts = self.tiling(ptr, size)
        if starts is None or count != 1 or descs[0].flags != 3:
            return (FakeResult.CUDA_ERROR_INVALID_VALUE,)
        self.accessible.update(starts)
        return (FakeResult.CUDA_SUCCESS,)

    def _cuMemUnmap(self, ptr: int, size: int) -> tuple:
        starts = self.tiling(ptr, size)
        if starts is None or (len(starts) > 1 and not self.span_unmap):
            return (FakeResult.CUDA_ERROR_INVALID_VALUE,)
        for start in starts:
            del self.mapped[start]
            self.accessible.discard(start)
        return (FakeResult.CUDA_SUCCESS,)


def fake_range(capacity: int, nbytes: int, alloc_bytes: int | None, span_unmap: bool = True) -> tuple:
    from inference.memory.vmm import VmmRange

    drv = FakeDriver(capacity, span_unmap)
    vmm = VmmRange(nbytes, 0, alloc_bytes, driver=drv)
    drv.calls.clear()
    return drv, vmm


def test_vmm_whole_arena_is_one_allocation_at_a_stable_address() -> None:
    g = FakeDriver.GRAN
    drv, vmm = fake_range(8 * g, 5 * g + 1, None)
    assert vmm.nbytes == 6 * g and vmm.allocs == [(0, 6 * g)]
    for _ in range(2):
        vmm.map_all()
        assert drv.calls == ["cuMemCreate", "cuMemMap", "cuMemSetAccess"]  # a level-2 wake
        assert list(drv.mapped) == [vmm.ptr] and drv.accessible == {vmm.ptr} and drv.free == 2 * g
        drv.calls.clear()
        vmm.unmap_all()
        assert drv.calls == ["cuMemUnmap", "cuMemRelease"]  # a level-2 sleep
        assert not drv.mapped and drv.free == 8 * g
        drv.calls.clear()
    vmm.close()
    assert not drv.reserved


def test_vmm_partial_map_failure_rolls_back_and_can_retry() -> None:
    from inference.memory.vmm import VmmError

    g = FakeDriver.GRAN
    drv, vmm = fake_range(3 * g, 5 * g + 1, 2 * g)
    assert vmm.nbytes == 6 * g and [s for _, s in vmm.allocs] == [2 * g] * 3
    with pytest.raises(VmmError, match="cuMemCreate failed: CUDA_ERROR_OUT_OF_MEMORY") as err:
        vmm.map_all()  # the first allocation fits, the second does not
    assert vmm.is_out_of_memory(err.value)
    assert drv.free == 3 * g and not drv.mapped and not drv.handles and vmm.mapped_allocs == 0
    assert drv.reserved == {vmm.ptr: 6 * g}  # the address range is kept for the retry
    drv.free = 8 * g  # the trainer let go of its memory
    drv.calls.clear()
    vmm.map_all()
    assert vmm.mapped_bytes == 6 * g and sorted(drv.mapped) == [vmm.ptr + off for off, _ in vmm.allocs]
    assert drv.calls.count("cuMemSetAccess") == 1 and drv.accessible == set(drv.mapped)  # one call for all
    drv.calls.clear()
    vmm.unmap_all()
    assert drv.calls == ["cuMemUnmap"] + ["cuMemRelease"] * 3
    assert drv.free == 8 * g and not drv.mapped
    vmm.close()
    assert not drv.reserved


@pytest.mark.parametrize(("call", "successes"), [("cuMemMap", 2), ("cuMemSetAccess", 0)])
def test_vmm_failed_driver_call_names_the_call_and_leaks_nothing(call: str, successes: int) -> None:
    from inference.memory.vmm import VmmError

    g = FakeDriver.GRAN
    drv, vmm = fake_range(1 << 30, 4 * g, g)
    drv.fail[call] = [successes, FakeResult.CUDA_ERROR_INVALID_VALUE]
    with pytest.raises(VmmError, match=f"{call} failed: CUDA_ERROR_INVALID_VALUE") as err:
        vmm.map_all()
    assert not vmm.is_out_of_memory(err.value)
    assert not drv.mapped and not drv.handles and vmm.mapped_allocs == 0 and drv.free == 1 << 30
    vmm.map_all()  # nothing half-done stands in the way of the next attempt
    assert vmm.mapped_bytes == 4 * g
    vmm.close()


def test_vmm_falls_back_to_one_unmap_per_allocation_when_the_driver_refuses_a_span() -> None:
    g = FakeDriver.GRAN
    drv, vmm = fake_range(1 << 30, 3 * g, g, span_unmap=False)
    vmm.map_all()
    vmm.unmap_all()
    assert not drv.mapped and not drv.handles and drv.free == 1 << 30 and not vmm.span_unmap
    vmm.map_all()
    drv.calls.clear()
    vmm.unmap_all()  # the refused span is not tried again
    assert drv.calls == ["cuMemUnmap"] * 3 + ["cuMemRelease"] * 3
    vmm.close()


def test_vmm_unmap_below_frees_only_allocations_wholly_below_the_offset() -> None:
    g = FakeDriver.GRAN
    drv, vmm = fake_range(6 * g, 6 * g, 2 * g)
    vmm.map_all()
    vmm.unmap_below(3 * g)  # what a level-1 sleep does once the first 3g bytes are copied out
    assert vmm.mapped_allocs == 2 and sorted(drv.mapped) == [vmm.ptr + 2 * g, vmm.ptr + 4 * g]
    assert drv.free == 2 * g
    vmm.unmap_below(6 * g)
    assert vmm.mapped_allocs == 0 and not drv.mapped and drv.free == 6 * g
    vmm.close()
