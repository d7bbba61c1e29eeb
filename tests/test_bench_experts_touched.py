"""scripts/bench/experts_touched.py: the experts a step touched, as the MoE rooflines charge them, against a
plain count over the same positions."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from scripts.bench.experts_touched import StepSpans, touched_per_layer, touched_per_step

E, LAYERS, K = 16, 3, 4


def routing(tokens: int, seed: int) -> np.ndarray:
    """[tokens, layers, k] of distinct expert ids per token and layer (as top-k gives them)."""
    rng = np.random.default_rng(seed)
    return np.stack([[rng.permutation(E)[:K] for _ in range(LAYERS)] for _ in range(tokens)]).astype(np.uint8)


def test_a_step_is_charged_each_layer_expert_pair_its_positions_reached_once() -> None:
    seqs = [SimpleNamespace(request_id="r0", index=0), SimpleNamespace(request_id="r0", index=1),
            SimpleNamespace(request_id="r1", index=0)]
    sample_of = {("r0", 0): 0, ("r0", 1): 1, ("r1", 0): 2}
    routings = [routing(9, 0), routing(7, 1), routing(5, 2)]
    spans = [StepSpans((seqs[0], seqs[2]), [0, 0], [6, 4]),  # prefill chunks
             StepSpans(tuple(seqs), [6, 6, 4], [1, 1, 1]),  # one decode token each (sample 1 hit the cache)
             StepSpans((seqs[0],), [7], [2])]  # a sequence alone, two positions (a recompute, say)
    got = touched_per_step(spans, sample_of, routings, E)
    want = []
    for s in spans:
        pairs = {(layer, int(e)) for seq, c, m in zip(s.seqs, s.starts, s.counts)
                 for row in routings[sample_of[seq.request_id, seq.index]][c:c + m]
                 for layer in range(LAYERS) for e in row[layer]}
        want.append(len(pairs))
    assert got.tolist() == want
    # a lone token reaches exactly k experts in every layer
    lone = touched_per_step([StepSpans((seqs[2],), [3], [1])], sample_of, routings, E)
    assert lone.tolist() == [LAYERS * K]
    assert touched_per_layer(routings[2][3:4], E).tolist() == [K] * LAYERS


def test_a_position_past_the_samples_routing_names_the_sample() -> None:
    seq = SimpleNamespace(request_id="r7", index=1)
    with pytest.raises(RuntimeError, match=r"sample 0 \(r7, 1\), whose routing has 5 rows"):
        touched_per_step([StepSpans((seq,), [4], [2])], {("r7", 1): 0}, [routing(5, 0)], E)
