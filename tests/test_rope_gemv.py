"""Rotary in the qkv GEMV's epilogue (norm_gemv with rope) gives the same bits as the projection followed
by rotary_qk, and a decoder with it the same hidden states as one without (Triton's interpreter on CPU;
Qwen2-0.5B shapes under `cuda`)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from inference.config import RopeConfig
from inference.layers import fused
from inference.layers import gemv as gemv_mod
from inference.layers.gemv import GemvConfig, RopeOperands, norm_gemv, use_rope_gemv
from inference.layers.rotary import RotaryEmbedding
from tests.helpers_models import ToyPager
from tests.test_norm_gemv import EPS, _operands, _tiny_model


@pytest.fixture(autouse=True)
def _force(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gemv_mod, "FORCE_ON_CPU", True)
    monkeypatch.setattr(gemv_mod, "ENABLED", True)
    monkeypatch.setattr(gemv_mod, "NORM_ENABLED", True)
    monkeypatch.setattr(gemv_mod, "ROPE_ENABLED", True)
    monkeypatch.setattr(fused, "FORCE_ON_CPU", True)


def check_equals_rotary_qk(m: int, heads: int, kv_heads: int, head_dim: int, k: int, dtype: torch.dtype,
                           config: GemvConfig | None, device: str = "cpu") -> None:
    n = (heads + 2 * kv_heads) * head_dim
    ops = _operands(m, n, k, dtype, device)
    table = RotaryEmbedding(head_dim, 4096, RopeConfig(), device).cos_sin_cache
    positions = torch.randperm(4096, generator=torch.Generator().manual_seed(m))[:m].to(device)
    rope = RopeOperands(positions, table, (heads + kv_heads) * head_dim)
    args = (ops["x"], ops["residual"], ops["norm_weight"], EPS, ops["weight"], ops["bias"])
    got, res = norm_gemv(*args, config=config, rope=rope)
    plain, plain_res = norm_gemv(*args, config=config)
    q, kk, v = plain.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
    q_rot, k_rot = fused.rotary_qk(q.reshape(m, heads, head_dim), kk.reshape(m, kv_heads, head_dim), positions,
                                   table)
    want = torch.cat([q_rot.reshape(m, -1), k_rot.reshape(m, -1), v], dim=1)
    assert torch.equal(got, want)
    assert torch.equal(res, plain_res)
    assert not torch.equal(got, plain)  # the rotation did something


@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize(("kind", "block_n"), [("lanes", 2), ("lanes", 4), ("reduce", 8), ("dot", 16)])
def test_rope_gemv_equals_projection_then_rotary(m: int, kind: str, block_n: int) -> None:
    # fp16 for "dot": Triton 3.x's interpreter gets bf16 tl.dot wrong
    dtype = torch.float16 if kind == "dot" else torch.bfloat16
    check_equals_rotary_qk(m, 4, 2, 16, 112, dtype, GemvConfig(block_n=block_n, block_k=32, kind=kind))


def test_use_rope_gemv_guards(monkeypatch: pytest.MonkeyPatch) -> None:
    table = torch.zeros(64, 16)
    x, w = torch.zeros(1, 40, dtype=torch.bfloat16), torch.zeros(64, 40, dtype=torch.bfloat16)
    rope = RopeOperands(torch.zeros(1, dtype=torch.long), table, 48)
    assert use_rope_gemv(x, w, rope)
    assert not use_rope_gemv(x, w, RopeOperands(torch.zeros(2, dtype=torch.long), table, 48))  # one position a row
    assert not use_rope_gemv(x, w, RopeOperands(rope.positions, table.half(), 48))  # the fp32 table only
    assert not use_rope_gemv(x, w[:56], rope)  # rows not whole heads
    long_k = torch.zeros(1, 5000, dtype=torch.bfloat16)  # 16 row blocks and a long K: split-K, sums come later
    assert not use_rope_gemv(long_k, torch.zeros(32, 5000, dtype=torch.bfloat16),
                             RopeOperands(rope.positions, table, 16))
    monkeypatch.setattr(gemv_mod, "ROPE_ENABLED", False)
    assert not use_rope_gemv(x, w, rope)


@pytest.mark.parametrize("lens", [[1], [1, 1, 1]])
def test_decoder_with_rope_gemv_equals_without(lens: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill then two decode steps: hidden states equal bit for bit with rotary in the qkv GEMV on and
    off; when on, no step launches a separate rotary (every step here has <= 8 rows: all on the GEMV)."""
    rotations: list[int] = []
    counted = fused._rotary_launch
    monkeypatch.setattr(fused, "_rotary_launch", lambda *a: rotations.append(1) or counted(*a))
    outs, launched = [], []
    for on in (True, False):
        monkeypatch.setattr(gemv_mod, "ROPE_ENABLED", on)
        model, pager = _tiny_model(torch.bfloat16), ToyPager(8, 4)
        steps = [{i: [3 + i, 7, 9 + i][: 3 - i] for i in range(len(lens))}]
        steps += [{i: [11 + i + s] for i in range(len(lens))} for s in range(2)]
        hidden = []
        rotations.clear()
        with torch.no_grad():
            for step in steps:
                input_ids, positions, meta = pager.step(step)
                hidden.append(model(input_ids, positions, meta))
        outs.append(hidden)
        launched.append(len(rotations))
    assert launched == [0, 2 * 3]  # off: one rotary launch per layer and step
    for fused_h, plain_h in zip(*outs):
        assert torch.equal(fused_h, plain_h)


# ---- on the GPU: Qwen2-0.5B and 7B qkv shapes ---------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize(("heads", "kv_heads", "hidden"), [(14, 2, 896), (28, 4, 3584)])
def test_rope_gemv_real_shapes_cuda(m: int, heads: int, kv_heads: int, hidden: int) -> None:
    n = (heads + 2 * kv_heads) * 64
    x, w = torch.zeros(m, hidden, dtype=torch.bfloat16, device="cuda"), torch.zeros(n, hidden, device="cuda")
    rope = RopeOperands(torch.zeros(m, dtype=torch.long, device="cuda"), torch.zeros(8, 64, device="cuda"), 1)
    if not use_rope_gemv(x, w.bfloat16(), rope):
        pytest.skip(f"the default config for M={m} splits K: no fused rotary there")
    check_equals_rotary_qk(m, heads, kv_heads, 64, hidden, torch.bfloat16, None, "cuda")
