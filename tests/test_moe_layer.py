"""The MoE layer (inference/layers/moe.py): routing picks the top-k with ties to the lowest expert (an exact
tie built into a router, alone and batched); the grouped Triton GEMMs (in Triton's interpreter on CPU)
equal the per-expert loop, read only the chosen experts, and give a token the same bits alone or in a
batch with the mode's fixed tiles, whatever number of pairs its expert got."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import nullcontext

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from inference.layers import moe
from inference.layers.activation import SiluAndMul
from inference.layers.kernel_device import interpreted_on_cpu

needs_triton = pytest.mark.skipif(moe.triton is None, reason="triton is not installed")
E, K, H, INTER = 6, 2, 48, 40  # H and INTER not multiples of the 64-wide tiles: the masks are exercised


@pytest.fixture
def force_triton() -> Iterator[None]:
    with interpreted_on_cpu():
        yield


def weights(seed: int = 0, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(E, 2 * INTER, H, generator=g) / H ** 0.5
    down = torch.randn(E, H, INTER, generator=g) / INTER ** 0.5
    return gate_up.to(dtype), down.to(dtype)


def routed(t: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, H, generator=g)
    w, ids = moe.route(torch.randn(t, E, generator=g), K, True)
    return x, ids, w


def test_routing_takes_the_top_k_and_breaks_ties_by_the_lowest_expert() -> None:
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0, 2.0, -1.0], [3.0, 3.0, 3.0, 3.0, 3.0, 3.0]])
    w, ids = moe.route(logits, 2, renormalize=False)
    assert ids.tolist() == [[1, 2], [0, 1]]
    probs = torch.softmax(logits, -1)
    torch.testing.assert_close(w, probs.gather(1, ids))
    w, _ = moe.route(logits, 2, renormalize=True)
    torch.testing.assert_close(w.sum(-1), torch.ones(2))


def test_aligned_pairs_cover_every_pair_once_in_their_experts_blocks() -> None:
    _, ids, _ = routed(13)
    sorted_pairs, block_expert = moe.align_pairs(ids, E, 4)
    flat = ids.reshape(-1)
    real = sorted_pairs[sorted_pairs < flat.numel()]
    assert sorted(real.tolist()) == list(range(flat.numel()))
    for b, e in enumerate(block_expert.tolist()):
        block = sorted_pairs[b * 4:(b + 1) * 4]
        block = block[block < flat.numel()].long()
        if e < 0:
            assert block.numel() == 0
        else:
            assert block.numel() > 0 and (flat[block] == e).all()
    # One token: its k experts get a block each and nothing else is launched to read weights.
    _, one, _ = routed(1)
    _, block_expert = moe.align_pairs(one, E, 16)
    assert sorted(e for e in block_expert.tolist() if e >= 0) == sorted(one[0].tolist())


@needs_triton
@pytest.mark.parametrize("tokens", [1, 5, 37])
def test_grouped_gemms_equal_the_per_expert_loop(force_triton: None, tokens: int) -> None:
    gate_up, down = weights()
    x, ids, w = routed(tokens)
    ref = moe.experts_reference(x, gate_up, down, ids, w, SiluAndMul())
    for block_m in (16, 32):
        got = moe.experts_grouped(x, gate_up, down, ids, w, block_m)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    # fp16 (Triton 3.x's interpreter computes bf16 tl.dot wrong; the GPU test covers bf16): the products
    # are rounded to fp16 as the torch loop's are.
    half = moe.experts_grouped(x.half(), gate_up.half(), down.half(), ids, w, 16)
    ref_half = moe.experts_reference(x.half().float(), gate_up.half().float(), down.half().float(), ids, w,
                                     SiluAndMul())
    torch.testing.assert_close(half.float(), ref_half, atol=5e-3, rtol=5e-3)


@needs_triton
def test_an_expert_whose_weights_are_garbage_is_never_read_unless_chosen(force_triton: None) -> None:
    gate_up, down = weights()
    x, ids, w = routed(3)
    unused = sorted(set(range(E)) - set(ids.reshape(-1).tolist()))
    assert unused
    clean = moe.experts_grouped(x, gate_up, down, ids, w, 16)
    gate_up[unused], down[unused] = float("nan"), float("nan")
    assert torch.equal(moe.experts_grouped(x, gate_up, down, ids, w, 16), clean)


@needs_triton
def test_a_token_has_the_same_bits_alone_and_in_a_batch(force_triton: None) -> None:
    gate_up, down = weights()
    x, ids, w = routed(40)
    full = moe.experts_grouped(x, gate_up, down, ids, w, moe.INVARIANT_BLOCK_M)
    for rows in (slice(0, 1), slice(7, 8), slice(3, 20)):
        alone = moe.experts_grouped(x[rows], gate_up, down, ids[rows], w[rows], moe.INVARIANT_BLOCK_M)
        assert torch.equal(alone, full[rows]), rows


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_modes_grouped_gemms_give_a_pair_the_same_bits_whatever_its_expert_got(force_triton: None,
                                                                                   dtype: torch.dtype) -> None:
    """Expert 0 gets 1, 15, 16, 17 or all 40 pairs (one row block, exactly one, one and a row, three), expert 1
    every token's second slot: each token's output equals its output alone, bit for bit. The mode's tiles
    never follow the pair count (the default's do, past 1024 pairs)."""
    gate_up, down = weights(dtype=dtype)
    g = torch.Generator().manual_seed(5)
    t = 40
    x = torch.randn(t, H, generator=g).to(dtype)
    w = torch.softmax(torch.randn(t, K, generator=g), -1)
    for count in (1, 15, 16, 17, t):
        ids = torch.tensor([[0 if j < count else 3, 1] for j in range(t)])
        full = moe.experts_grouped(x, gate_up, down, ids, w, moe.INVARIANT_BLOCK_M)
        for j in (0, count - 1, t - 1):
            alone = moe.experts_grouped(x[j:j + 1], gate_up, down, ids[j:j + 1], w[j:j + 1], moe.INVARIANT_BLOCK_M)
            assert torch.equal(alone[0], full[j]), (count, j)
    assert {moe.pick_block_m(n, invariant=True) for n in (1, 1024, 1025, 1 << 16)} == {moe.INVARIANT_BLOCK_M}
    assert moe.pick_block_m(1025, invariant=False) != moe.INVARIANT_BLOCK_M


TIED = (1, 4, 6)  # router rows equal to one vector w; the others are zero
NEVER = (3, 5, 6, 7)  # experts no token may get when ties go to the lowest expert id


def tied_block(dtype: torch.dtype, invariant: bool = True) -> moe.MoEBlock:
    """An MoE block of 8 experts, 2 per token, whose router ties every token at the second place: rows 1, 4,
    6 of the router are one vector w, the others zero. A token with x.w > 0 has 1, 4, 6 tied first (lowest
    ids: 1, 4); one with x.w < 0 has the five zero rows tied first (0, 2). The experts no token may get are
    NaN, so taking one poisons the output."""
    from inference.config import ModelConfig, RopeConfig
    from inference.parallel import TPInfo

    config = ModelConfig(family="qwen3_moe", vocab_size=32, hidden_size=H, intermediate_size=INTER, num_layers=1,
                         num_heads=2, num_kv_heads=1, head_dim=16, rms_norm_eps=1e-6, rope=RopeConfig(),
                         max_position_embeddings=64, tie_word_embeddings=False, qkv_bias=False, qk_norm=True,
                         num_experts=8, num_experts_per_tok=2, moe_intermediate_size=INTER)
    block = moe.MoEBlock(config, TPInfo(), dtype, "cpu", invariant)
    g = torch.Generator().manual_seed(9)
    router = torch.zeros(8, H)
    router[list(TIED)] = torch.randn(H, generator=g) / H ** 0.5
    block.gate.weight.data.copy_(router)
    block.experts.gate_up_proj.data.copy_(torch.randn(8, 2 * INTER, H, generator=g) / H ** 0.5)
    block.experts.down_proj.data.copy_(torch.randn(8, H, INTER, generator=g) / INTER ** 0.5)
    block.experts.gate_up_proj.data[list(NEVER)] = float("nan")
    block.experts.down_proj.data[list(NEVER)] = float("nan")
    return block


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_an_exact_routing_tie_goes_to_the_lowest_expert_ids_alone_or_batched(kernels: str) -> None:
    """The tie is exact (equal router logits, so equal probabilities): the block picks (1, 4) or (0, 2) for
    every token, never a NaN expert, and in the mode a token's output has the same bits alone and among
    40 (the torch loop on CPU; the grouped GEMMs and the invariant GEMM in Triton's interpreter, fp16)."""
    if kernels == "triton" and moe.triton is None:
        pytest.skip("triton is not installed")
    dtype = torch.float32 if kernels == "torch" else torch.float16
    block = tied_block(dtype)
    x = torch.randn(40, H, generator=torch.Generator().manual_seed(2)).to(dtype)
    with interpreted_on_cpu() if kernels == "triton" else nullcontext():
        logits = moe.invariant_linear(x, block.gate.weight)
        assert torch.equal(logits[:, 1], logits[:, 4]) and torch.equal(logits[:, 1], logits[:, 6])
        assert (logits[:, [0, 2, 3, 5, 7]] == 0).all()
        _, ids = moe.route(logits, 2, renormalize=True)
        assert {tuple(r) for r in ids.tolist()} == {(1, 4), (0, 2)}
        full = block(x)
        assert torch.isfinite(full).all()
        for j in (0, 17, 39):
            assert torch.equal(block(x[j:j + 1])[0], full[j]), j
