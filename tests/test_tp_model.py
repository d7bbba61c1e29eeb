"""Tensor parallelism: TP=2 over gloo (two CPU processes) gives the same logits as TP=1, on every
rank, for llama, for qwen2 with tied embeddings and a vocabulary that needs padding (301), and for the
MoE families (experts split over the intermediate dimension)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from inference.parallel import TPInfo
from tests.helpers_models import ToyPager, load_ours, make_hf_checkpoint, our_logits, random_prompts
from tests.helpers_tp import free_port, gloo_tp

pytestmark = pytest.mark.slow  # every test here starts real processes or runs for seconds

# The MoE families split every expert's intermediate dimension over the ranks.
CASES = {"llama": {}, "qwen2": {"vocab_size": 301}, "qwen3_moe": {}, "mixtral": {}}
TP = 2


def _run_steps(model: torch.nn.Module) -> list[torch.Tensor]:
    """A prefill of prompts of different lengths, then one decode step; the logits of each step."""
    vocab = model.config.vocab_size
    pager = ToyPager(num_blocks=32, block_size=4, seed=1)
    prompts = random_prompts([7, 3, 10], vocab)
    prefill = our_logits(model, pager, dict(enumerate(prompts)))
    decode = our_logits(model, pager, dict(enumerate(random_prompts([1, 1, 1], vocab, seed=5))))
    return [torch.cat(list(prefill.values())), torch.cat(list(decode.values()))]


def _worker(rank: int, port: int, root: str) -> None:
    with gloo_tp(rank, TP, port) as tp:
        for case in CASES:
            model = load_ours(Path(root) / case, tp=tp, num_blocks=32)
            torch.save(_run_steps(model), Path(root) / f"{case}.rank{rank}.pt")


@pytest.fixture(scope="module")
def tp_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tp")
    for case, overrides in CASES.items():
        make_hf_checkpoint(case, root / case, seed=3, **overrides)
    mp.spawn(_worker, args=(free_port(), str(root)), nprocs=TP, join=True)
    return root


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.slow
def test_tp2_logits_equal_tp1_on_every_rank(tp_root: Path, case: str) -> None:
    with torch.no_grad():
        expected = _run_steps(load_ours(tp_root / case, num_blocks=32))
    vocab = expected[0].shape[-1]
    assert vocab == CASES[case].get("vocab_size", 300)
    for rank in range(TP):
        got = torch.load(tp_root / f"{case}.rank{rank}.pt")
        for step, (g, e) in enumerate(zip(got, expected)):
            assert g.shape == e.shape, (rank, step)
            torch.testing.assert_close(g, e, atol=1e-5, rtol=0, msg=f"{case} rank {rank} step {step}")


def test_tp_shards_hold_disjoint_slices(tp_root: Path) -> None:
    """Each rank's fused qkv holds its own heads' rows; the vocab shards are padded with zeros."""
    full = load_ours(tp_root / "qwen2")
    shards = [load_ours(tp_root / "qwen2", tp=TPInfo(r, TP, group=object())) for r in range(TP)]
    w = dict(full.named_parameters())
    s = [dict(m.named_parameters()) for m in shards]
    emb = "model.embed_tokens.weight"
    assert [tuple(p[emb].shape) for p in s] == [(151, 64), (151, 64)]
    torch.testing.assert_close(torch.cat([s[0][emb], s[1][emb][:150]]), w[emb], atol=0, rtol=0)
    assert bool((s[1][emb][150] == 0).all())
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    q, k, v = w[qkv].split([64, 32, 32])
    for r in range(TP):
        q_r, k_r, v_r = s[r][qkv].split([32, 16, 16])
        torch.testing.assert_close(q_r, q[32 * r:32 * (r + 1)], atol=0, rtol=0)
        torch.testing.assert_close(k_r, k[16 * r:16 * (r + 1)], atol=0, rtol=0)
        torch.testing.assert_close(v_r, v[16 * r:16 * (r + 1)], atol=0, rtol=0)
