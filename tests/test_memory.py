"""Sleep and wake: arenas, adoption of parameters, the tag state machine (CPU), the VMM chunk logic
against a fake driver (CPU), and address stability, graphs, freed memory and wake OOM (CUDA)."""

from __future__ import annotations

import enum
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from inference.core import InvalidRequestError, StateError
from inference.memory import (
    ArenaFullError,
    ArenaState,
    WakeError,
    parameters_nbytes,
)
from inference.sleep import MemoryManager


class TinyLM(nn.Module):
    """Embedding tied to the lm_head, a linear, a norm and a rotary-like buffer."""

    def __init__(self, vocab: int = 32, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.proj = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.embed.weight
        self.register_buffer("rope", torch.linspace(-1.0, 1.0, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.proj(self.embed(ids)) * self.rope
        return self.lm_head(self.norm(h))


IDS = torch.tensor([[1, 5, 9, 30]])


def build(device: str = "cpu", kv: bool = True) -> tuple[MemoryManager, TinyLM]:
    torch.manual_seed(0)
    model = TinyLM().to(device)
    mgr = MemoryManager(device)
    mgr.adopt_module("weights", model)
    if kv:
        mgr.create_arena("kv_cache", 4096).alloc((2, 8, 16), torch.float32).fill_(7.0)
    return mgr, model


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# ---- adoption -------------------------------------------------------------------------------
def test_adopt_keeps_identity_values_and_ties_one_slot() -> None:
    torch.manual_seed(0)
    model = TinyLM()
    params = dict(model.named_parameters())
    before = snapshot(model)
    out = model(IDS)
    mgr = MemoryManager("cpu")
    arena = mgr.adopt_module("weights", model)
    assert dict(model.named_parameters()) == params  # the same Parameter objects
    for name, p in model.named_parameters():
        assert arena.owns(p) and torch.equal(p, before[name]), name
    assert model.lm_head.weight is model.embed.weight
    assert arena.used_bytes == parameters_nbytes(params.values())  # the tied weight is stored once
    assert len({p.data_ptr() for p in params.values()}) == len(params)
    assert not arena.owns(model.rope)  # buffers stay outside the arenas
    assert torch.equal(model(IDS), out)
    assert mgr.contents_valid("weights")
    mgr.check_ready()


def test_draft_sharing_a_target_parameter_is_not_copied() -> None:
    mgr, target = build(kv=False)
    draft = nn.Linear(16, 32, bias=False)
    draft.weight = target.lm_head.weight  # a draft that borrows the target's lm_head
    arena = mgr.adopt_module("draft_weights", draft)
    assert arena.used_bytes == 0 and mgr.arena("weights").owns(draft.weight)


def test_meta_parameters_are_not_valid_until_loaded() -> None:
    with torch.device("meta"):
        model = TinyLM()
    mgr = MemoryManager("cpu")
    mgr.adopt_module("weights", model)
    assert model.proj.weight.device.type == "cpu"
    with pytest.raises(StateError, match="no valid weights"):
        mgr.check_ready()
    mgr.mark_loaded("weights")
    mgr.check_ready()


# ---- levels ---------------------------------------------------------------------------------
def test_level1_cycle_is_bit_identical() -> None:
    mgr, model = build()
    params, before, out = dict(model.named_parameters()), snapshot(model), model(IDS)
    stats = mgr.sleep(1)
    assert mgr.is_sleeping and mgr.state("weights") == ArenaState.ASLEEP_MIRRORED
    assert stats.bytes_by_tag == {
        "kv_cache": mgr.arena("kv_cache").nbytes,
        "weights": mgr.arena("weights").nbytes,
    }
    with pytest.raises(StateError, match="call wake_up"):
        mgr.check_ready()
    stats = mgr.wake_up()
    assert not mgr.is_sleeping and stats.op == "wake" and stats.freed_bytes is None
    assert dict(model.named_parameters()) == params
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    assert torch.equal(model(IDS), out)
    mgr.check_ready()


def test_level2_drops_weights_until_marked_loaded() -> None:
    mgr, model = build()
    before, out = snapshot(model), model(IDS)
    mgr.sleep(2)
    assert mgr.state("weights") == ArenaState.ASLEEP_EMPTY
    mgr.wake_up()
    assert not mgr.contents_valid("weights")
    with pytest.raises(StateError, match="'weights' is awake but holds no valid weights"):
        mgr.check_ready()
    assert all(torch.isnan(p).all() for p in model.parameters())  # poisoned, never the old bytes
    with torch.no_grad():  # what a weight sync does: write in place
        for name, p in model.named_parameters():
            p.copy_(before[name])
    mgr.mark_loaded("weights")
    mgr.check_ready()
    assert torch.equal(model(IDS), out)


@pytest.mark.parametrize("level", [1, 2])
def test_buffers_survive_and_kv_cache_is_dropped(level: int) -> None:
    mgr, model = build()
    kv = mgr.arena("kv_cache").view(0, torch.float32, (2, 8, 16))
    rope = model.rope.clone()
    mgr.sleep(level)
    assert mgr.state("kv_cache") == ArenaState.ASLEEP_EMPTY
    assert not mgr.arena("kv_cache").has_host_mirror
    mgr.wake_up()
    assert torch.equal(model.rope, rope)
    assert not (kv == 7.0).any()


def test_weights_only_wake_leaves_kv_asleep() -> None:
    mgr, _ = build()
    draft = nn.Linear(16, 16)
    mgr.adopt_module("draft_weights", draft)
    mgr.sleep(1)
    stats = mgr.wake_up(["weights"])
    assert set(stats.bytes_by_tag) == {"weights", "draft_weights"}
    assert mgr.state("kv_cache") == ArenaState.ASLEEP_EMPTY and mgr.is_sleeping
    mgr.check_ready(["weights", "draft_weights"])
    with pytest.raises(StateError, match="'kv_cache' is asleep_empty"):
        mgr.check_ready()
    # Already-awake tags are skipped, so a repeated or broader wake just finishes the job.
    assert mgr.wake_up(["weights"]).skipped_tags == ["weights", "draft_weights"]
    assert mgr.wake_up().bytes_by_tag == {"kv_cache": mgr.arena("kv_cache").nbytes}
    mgr.check_ready()


def test_sleep_while_partly_awake_releases_the_awake_arenas() -> None:
    mgr, _ = build()
    mgr.sleep(1)
    mgr.wake_up(["weights"])
    stats = mgr.sleep(2)
    assert stats.bytes_by_tag.keys() == {"weights"} and stats.skipped_tags == ["kv_cache"]
    assert mgr.state("weights") == ArenaState.ASLEEP_EMPTY


# ---- wrong transitions ----------------------------------------------------------------------
def test_wrong_transitions_raise_clear_errors() -> None:
    mgr, _ = build()
    with pytest.raises(StateError, match="nothing is asleep"):
        mgr.wake_up()
    for level in (0, 3, "1", True):
        with pytest.raises(InvalidRequestError, match="sleep level must be 1 or 2"):
            mgr.sleep(level)  # type: ignore[arg-type]
    with pytest.raises(StateError, match="already exists"):
        mgr.create_arena("weights", 16)
    with pytest.raises(InvalidRequestError, match="unknown tag 'activations'"):
        mgr.create_arena("activations", 16)
    with pytest.raises(ArenaFullError, match="do not fit"):
        mgr.arena("kv_cache").alloc(4096, torch.uint8)
    mgr.sleep(1)
    with pytest.raises(StateError, match="already asleep"):
        mgr.sleep(1)
    with pytest.raises(InvalidRequestError, match="unknown tag 'draft'"):
        mgr.wake_up(["draft"])
    with pytest.raises(InvalidRequestError, match="list of tags"):
        mgr.wake_up("weights")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="empty list"):
        mgr.wake_up([])
    with pytest.raises(StateError, match="cannot mark loaded while asleep"):
        mgr.mark_loaded("weights")
    with pytest.raises(StateError, match="cannot view while asleep"):
        mgr.arena("weights").view(0, torch.float32, (4,))
    with pytest.raises(StateError, match="only copy"):
        mgr.arena("weights").release_host_mirror()
    with pytest.raises(InvalidRequestError, match="no arena 'draft_weights'"):
        mgr.state("draft_weights")
    assert mgr.is_sleeping  # none of the refused calls changed anything
    mgr.wake_up()
    mgr.check_ready()


# ---- the VMM chunk logic against a fake driver ----------------------------------------------
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
    from inference.memory_cuda import VmmRange

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
    from inference.memory_cuda import VmmError

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
    from inference.memory_cuda import VmmError

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


def test_manager_rejects_bad_sizes() -> None:
    for kwargs, name in (({"chunk_bytes": 0}, "chunk_bytes"), ({"alloc_bytes": 0}, "alloc_bytes")):
        with pytest.raises(InvalidRequestError, match="must be >= 1") as err:
            MemoryManager("cpu", **kwargs)
        assert err.value.field == name


# ---- CUDA -----------------------------------------------------------------------------------
@pytest.mark.cuda
def test_cuda_views_keep_their_address_and_level1_is_bit_identical() -> None:
    mgr, model = build("cuda")
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    out, before = model(IDS.cuda()), snapshot(model)
    for level in (1, 2):
        mgr.sleep(level)
        mgr.wake_up()
        assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs
        if level == 2:
            with torch.no_grad():
                for name, p in model.named_parameters():
                    p.copy_(before[name])
            mgr.mark_loaded("weights")
        assert torch.equal(model(IDS.cuda()), out)
    mgr.close()


@pytest.mark.cuda
def test_cuda_graph_replays_after_wake_without_recapture() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(64, 64, bias=False).cuda()
    mgr = MemoryManager("cuda")
    mgr.adopt_module("weights", lin)
    x = torch.randn(8, 64, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        lin(x)  # warm-up outside the capture, as torch.cuda.graph requires
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        out = lin(x)
    graph.replay()
    expected = out.clone()
    mgr.sleep(1)
    mgr.wake_up()
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)
    mgr.sleep(2)
    mgr.wake_up()
    with torch.no_grad():
        lin.weight.copy_(torch.eye(64, device="cuda") * 2)  # a weight sync writes in place
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, x * 2)
    mgr.close()


@pytest.mark.cuda
@pytest.mark.parametrize("level", [1, 2])
@pytest.mark.parametrize("alloc_bytes", [None, 256 << 20])
def test_cuda_sleep_frees_the_arena(level: int, alloc_bytes: int | None) -> None:
    mgr = MemoryManager("cuda", chunk_bytes=96 << 20, alloc_bytes=alloc_bytes)  # copies straddle allocations
    arena = mgr.create_arena("weights", 1 << 30)
    assert len(arena.vmm.allocs) == (1 if alloc_bytes is None else 4)
    arena.base.copy_(torch.randint(0, 256, (arena.nbytes,), dtype=torch.uint8, device="cuda"))
    expected, ptr = arena.base.clone(), arena.base.data_ptr()
    mgr.mark_loaded("weights")
    for _ in range(2):
        stats = mgr.sleep(level)
        assert stats.freed_bytes is not None and stats.freed_bytes >= 0.95 * arena.nbytes
        assert arena.vmm.mapped_allocs == 0
        stats = mgr.wake_up()
        assert stats.freed_bytes is not None and -stats.freed_bytes >= 0.95 * arena.nbytes
        assert arena.base.data_ptr() == ptr
        if level == 1:
            assert torch.equal(arena.base, expected)
        arena.base.copy_(expected)  # a level-2 wake is followed by a weight sync
        mgr.mark_loaded("weights")
    mgr.close()


@pytest.mark.cuda
def test_cuda_wake_oom_fails_cleanly_and_succeeds_after_the_hog_is_freed() -> None:
    # Four allocations, so the failure lands after some of them were mapped and must be rolled back.
    mgr = MemoryManager("cuda", chunk_bytes=256 << 20, alloc_bytes=256 << 20)
    arena = mgr.create_arena("weights", 1 << 30)
    arena.base.copy_(torch.randint(0, 256, (arena.nbytes,), dtype=torch.uint8, device="cuda"))
    expected = arena.base.clone()
    mgr.mark_loaded("weights")
    mgr.sleep(1)
    torch.cuda.empty_cache()  # so the wake's own empty_cache cannot free anything and skew the figures
    free, _ = torch.cuda.mem_get_info()
    hog = torch.empty(free - (400 << 20), dtype=torch.uint8, device="cuda")  # leaves < 1 GiB free
    free_before = torch.cuda.mem_get_info()[0]
    with pytest.raises(WakeError, match=f"needs 1.00 GiB \\({arena.nbytes} bytes\\)") as err:
        mgr.wake_up()
    assert err.value.needed_bytes == arena.nbytes and err.value.free_bytes < arena.nbytes
    assert arena.state == ArenaState.ASLEEP_MIRRORED and arena.vmm.mapped_allocs == 0
    assert abs(torch.cuda.mem_get_info()[0] - free_before) < (64 << 20)  # no partial mapping leaked
    del hog
    torch.cuda.empty_cache()
    mgr.wake_up()
    assert torch.equal(arena.base, expected)
    mgr.close()
