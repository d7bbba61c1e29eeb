"""Sleep and wake: arenas, adoption of parameters, the tag state machine (CPU), and address stability,
graphs, freed memory and wake OOM (CUDA). The VMM chunk logic against a fake driver: test_memory_vmm.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from inference.core import InvalidRequestError, StateError
from inference.memory.arenas import (
    ArenaFullError,
    ArenaState,
    WakeError,
    parameters_nbytes,
)
from inference.memory.sleep import MemoryManager


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
