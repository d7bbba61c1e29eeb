"""The batch-invariant mode at tensor-parallel size 2 (gloo, two processes on CPU), dense and MoE.

At TP 2 the mode sums the ranks' partial products in rank order (TPInfo.all_reduce_ordered) rather than
in the collective's own order, which follows the message size and so the batch. TP 2 has its own fixed
order (it need not agree with TP 1, docs/invariance.md): within it, every case holds bit for bit on
both ranks, greedy and seeded: alone against one batch and calls of other sizes, shuffled, prefix-cache
hits, preemption with chunked prefill, a draft model (sharded as the target is) and the mode's own draft.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from inference.engine.llm import LLM
from inference.models.tiny import first_layers, make_tiny_model
from inference.parallel import TPInfo
from tests.helpers_invariance import (
    CPU,
    MODES,
    SELF_DRAFT,
    alone,
    base_params,
    batched,
    drafted,
    make_prompts,
    preempted,
    prefix_cached,
    self_drafted,
    shuffled,
    tight_options,
)
from tests.helpers_tp import free_port, gloo_tp

pytestmark = pytest.mark.slow  # two processes, a dozen engines each
TP = 2
FAMILIES = ("qwen2", "qwen3_moe")
DIMS = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)


def _cases(root: Path, family: str, tp: TPInfo) -> dict[str, Any]:
    """Every case of tests/helpers_invariance.py on this rank, per sampling mode."""
    prompts = make_prompts()
    params = base_params
    main = LLM(root / family, batch_invariant=True, tp=tp, **CPU)
    tight = LLM(root / family, batch_invariant=True, tp=tp, **{**CPU, **tight_options(main, prompts)})
    spec = LLM(root / family, batch_invariant=True, tp=tp, draft_model=str(root / f"{family}-draft"),
               num_speculative_tokens=3, **CPU)
    own = LLM(root / family, batch_invariant=True, tp=tp, **{**CPU, **SELF_DRAFT})  # its all-reduces: the default's
    out: dict[str, Any] = {}
    for mode in MODES:
        out[mode] = {"alone": alone(main, prompts, params, mode),
                     "batched": batched(main, prompts, params, mode),
                     "shuffled": shuffled(main, prompts, params, mode),
                     "prefix_cached": prefix_cached(main, prompts, params, mode),
                     "preempted": preempted(tight, prompts, params, mode),
                     "drafted": drafted(spec, prompts, params, mode),
                     "self_drafted": self_drafted(own, prompts, params, mode)}
    return out


def _rank(rank: int, port: int, root: str) -> None:
    torch.set_num_threads(1)  # the mode's promise is per thread count; one keeps two ranks off each other
    with gloo_tp(rank, TP, port, timeout_s=120) as tp:
        got = {family: _cases(Path(root), family, tp) for family in FAMILIES}
        (Path(root) / f"cases.rank{rank}.pkl").write_bytes(pickle.dumps(got))


def test_every_case_holds_bit_for_bit_at_tp2(tmp_path: Path) -> None:
    for family in FAMILIES:
        target = make_tiny_model(tmp_path / family, family=family, seed=3, **DIMS)
        first_layers(target, tmp_path / f"{family}-draft", 1)
    mp.spawn(_rank, args=(free_port(), str(tmp_path)), nprocs=TP, join=True)
    ranks = [pickle.loads((tmp_path / f"cases.rank{r}.pkl").read_bytes()) for r in range(TP)]
    assert ranks[0] == ranks[1], "the ranks disagree"
    for family in FAMILIES:
        for mode in MODES:
            cases = ranks[0][family][mode]
            lone = cases.pop("alone")
            for got in cases.pop("batched"):
                assert got == lone, (family, mode, "batched")
            for case, got in cases.items():
                assert got == {i: lone[i] for i in got}, (family, mode, case)
