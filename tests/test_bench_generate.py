"""scripts/bench/generate.py on CPU with the tiny MoE shape (the A3B's structure), run as a user runs it: ours
against transformers' Qwen3MoeForCausalLM generate on the same weights, and the decode step against its
active-weight roofline."""

from __future__ import annotations

import pytest

from tests.helpers_bench import bench_lines, refused

BENCH = "scripts.bench.generate"
# qwen3-moe-tiny: hidden 64, 2 layers, 4 heads and 2 KV heads of 16, 8 experts of 32 (2 a token), vocab 512
H, LAYERS, HEADS, KV, D, E, K, INTER, V = 64, 2, 4, 2, 16, 8, 2, 32, 512


@pytest.mark.slow
def test_the_moe_shape_against_transformers_at_batch_1_and_4() -> None:
    rows = bench_lines(BENCH, "--shape", "qwen3-moe-tiny", "--device", "cpu", "--batch", "1", "4",
                       "--prompt-len", "12", "--new-tokens", "10", "--peers", "plain")
    assert [r["batch"] for r in rows] == [1, 4]
    for r in rows:
        assert r["shape"] == "qwen3-moe-tiny" and r["layers"] == LAYERS and r["device"] == "cpu"
        assert r["ours_tok_s"] > 0 and r["hf_plain_tok_s"] > 0 and "hf_plain_error" not in r
        # the peer ran on our weights (transformers' own init, copied into ours): its tokens are comparable
        assert 0 <= r["hf_plain_greedy_prefix_match"] <= 1 and r["hf_experts"]
        assert r["best_hf"] == "plain" and r["ratio_vs_best_hf"] == r["ratio_vs_plain"] > 0
        assert r["decode_step_how"] == "step_wall" and r["decode_step_rows"] == r["batch"]
        assert r["step_over_roofline"] == pytest.approx(r["decode_step_ms"] / r["roofline_ms"], rel=1e-2)
        assert K <= r["experts_touched"] <= E
    one = rows[0]
    # batch 1 reads k experts a layer (top-k ids are distinct), so the step's bytes are the dense weights
    # but the untied embedding (gathered by row), plus k experts in each layer; bf16
    dense_layer = H * (HEADS + 2 * KV) * D + HEADS * D * H + 2 * H + 2 * D + E * H  # attention, norms, router
    expert = 3 * INTER * H
    assert one["experts_touched"] == K
    assert one["step_bytes"] == 2 * (LAYERS * (dense_layer + K * expert) + H + V * H)


def test_an_unknown_peer_is_refused() -> None:
    assert "--peers" in refused(BENCH, "--peers", "vllm")
    assert "--hf-experts" in refused(BENCH, "--shape", "qwen2-0.5b", "--hf-experts", "eager")
