"""scripts/bench/rollout.py on CPU with the tiny model, run as a user runs it: the smoke mode the device run
shares its code with, held to the JSON lines it prints."""

from __future__ import annotations

from pathlib import Path

import pytest

from inference.engine.llm import LLM
from tests.helpers_bench import bench_lines, refused

BENCH = "scripts.bench.rollout"
SMOKE = ["--shapes", "tiny", "--prompts", "4", "--samples", "2", "--prompt-min", "8", "--prompt-max", "24",
         "--len-median", "6", "--len-cap", "16"]


@pytest.fixture(scope="module")
def smoke_workload() -> dict:
    (line,) = bench_lines(BENCH, *SMOKE, "--dry-run")
    return line


@pytest.fixture(scope="module")
def smoke_rows() -> list[dict]:
    return bench_lines(BENCH, *SMOKE)


@pytest.mark.slow
def test_default_workload_is_the_grpo_batch() -> None:
    line, again = (bench_lines(BENCH, "--shapes", "qwen2-0.5b", "--dry-run") for _ in range(2))
    assert line == again  # a fixed RNG
    (w,) = line
    assert w["bench"] == "rollout_workload" and w["prompts"] == 64 and w["sequences"] == 512
    assert 128 <= w["prompt_len_min"] <= w["prompt_len_max"] <= 512
    assert w["longest"] == 2048 and 440 < w["mean_len"] < 490  # lognormal mean ~466, capped


@pytest.mark.slow
def test_smoke_run_prints_one_row_per_mode(smoke_rows: list[dict], smoke_workload: dict) -> None:
    assert [r["mode"] for r in smoke_rows] == ["greedy", "sampled", "seeded"]
    for r in smoke_rows:
        # the run fails unless every sample generated exactly its drawn length
        assert r["shape"] == "tiny" and r["sequences"] == 8 and r["longest"] == smoke_workload["longest"]
        assert r["generated_tokens"] == smoke_workload["generated_tokens"]
        assert r["steps"] >= r["longest"] and r["tok_s"] > 0 and r["ms_per_step"] > 0
        assert 0 <= r["tail_share"] <= 1 and 1 <= r["mean_running_batch"] <= 8
        assert r["max_num_seqs"] >= 256 and r["preempted"] == 0
        # per step the slower of bytes and FLOPs: between the larger sum and the two sums together
        assert max(r["roofline_bytes_s"], r["roofline_flops_s"]) <= r["roofline_s"] * 1.001
        assert r["roofline_s"] <= (r["roofline_bytes_s"] + r["roofline_flops_s"]) * 1.001
        assert r["time_over_roofline"] > 0 and r["hbm_gbps"] > 0 and r["matmul_tflops"] > 0
        # by running batch: every step in one range, each range's times positive
        assert sum(n for n, _, _ in r["by_batch"].values()) == r["steps"] and not r["profiled"]
        assert all(ms > 0 and roof > 0 for _, ms, roof in r["by_batch"].values())
        assert set(r["by_batch"]) <= {"1-8", "9-32", "33-128", "129-512", "513+"}
        # the timed run follows a freeze of the warm heap (as the sidecar's rank), which measured a collection
        assert r["gc_frozen"] is True and r["gc_full_collect_ms"] > 0


def test_the_roofline_counts_the_tiny_model(smoke_rows: list[dict]) -> None:
    llm = LLM(None, device="cpu")
    try:
        mc = llm.model_config
        h, kv, d = mc.hidden_size, mc.num_kv_heads, mc.head_dim
        per_layer = h * (mc.num_heads + 2 * kv) * d + mc.num_heads * d * h + 3 * h * mc.intermediate_size
        params = sum(p.numel() * 4 for p in llm.worker.models["target"].parameters())
        embed = 0 if mc.tie_word_embeddings else mc.vocab_size * h * 4
        assert smoke_rows[0]["model_cost"] == {
            "weight_bytes": params - embed, "kv_bytes_per_token": 2 * mc.num_layers * kv * d * 4,  # float32 on CPU
            "matmul_params": mc.num_layers * per_layer, "head_params": mc.vocab_size * h,
            "attn_flops_per_pair": 4 * mc.num_heads * d * mc.num_layers, "expert_bytes": 0,
            "expert_params_per_token": 0, "experts_per_token": 0}
    finally:
        llm.worker.shutdown()


@pytest.mark.slow
def test_gc_freeze_off_times_the_unfrozen_heap() -> None:
    (row,) = bench_lines(BENCH, *SMOKE, "--modes", "greedy", "--gc-freeze", "off")
    assert row["gc_frozen"] is False and row["gc_full_collect_ms"] is None


@pytest.mark.slow
def test_profile_writes_a_kernel_table_per_window(tmp_path: Path) -> None:
    (row,) = bench_lines(BENCH, *SMOKE, "--modes", "seeded", "--profile", str(tmp_path), "--profile-steps", "0,8",
                         "--profile-length", "4")
    assert row["profiled"]
    tables = sorted(p.name for p in tmp_path.iterdir())
    assert tables == ["tiny_seeded_step0.txt", "tiny_seeded_step8.txt"]
    text = (tmp_path / "tiny_seeded_step8.txt").read_text()
    assert text.startswith("4 steps from step 8") and "Name" in text


@pytest.mark.slow
def test_a_draft_speculates_on_the_tail_only(smoke_workload: dict) -> None:
    """--draft-layers with --spec-max-batch 2: some steps speculate (the drained tail), not all of them,
    and the tokens generated are the workload's."""
    (row,) = bench_lines(BENCH, *SMOKE, "--modes", "greedy", "--draft-layers", "1", "--k", "2",
                         "--spec-max-batch", "2")
    assert row["generated_tokens"] == smoke_workload["generated_tokens"] and row["spec_max_batch"] == 2
    assert 0 < row["spec_steps"] < row["steps"]
    assert row["tail_scale"] == 1.0 and row["spec_acceptance"] < 1  # a draft of the undamped target's first layer


@pytest.mark.slow
def test_tail_scale_zero_makes_the_draft_agree_on_every_token() -> None:
    """--tail-scale damps o_proj and down_proj of the target's layers beyond the draft's: at 0 those layers
    add nothing to the residual stream, so the target computes what its first layers (the draft) compute."""
    (row,) = bench_lines(BENCH, *SMOKE, "--modes", "greedy", "--draft-layers", "1", "--k", "2",
                         "--spec-max-batch", "0", "--tail-scale", "0")
    assert row["tail_scale"] == 0.0 and row["spec_steps"] > 0 and row["spec_acceptance"] == 1.0


@pytest.mark.slow
def test_quantization_bf16_fp8_adds_the_fp8_column_with_its_roofline_and_gap() -> None:
    rows = bench_lines(BENCH, *SMOKE, "--modes", "greedy", "--quantization", "bf16,fp8")
    base, fp8, line = rows
    assert (base["quantization"], fp8["quantization"]) == ("bf16", "fp8")
    assert fp8["generated_tokens"] == base["generated_tokens"]  # the same schedule
    # the linears' weight bytes drop to a quarter of fp32's (CPU), plus their scales
    assert fp8["model_cost"]["weight_bytes"] < 0.5 * base["model_cost"]["weight_bytes"]
    assert fp8["weight_roofline_ms"] < base["weight_roofline_ms"]
    assert line["bench"] == "rollout_fp8" and line["fp8_over_bf16"] == pytest.approx(fp8["tok_s"] / base["tok_s"],
                                                                                     rel=1e-3)
    assert 0 <= line["greedy_choice_differs"] <= 1 and line["mean_abs_logprob_gap"] >= 0
    assert 0 <= line["identical_samples"] <= 1


def test_lora_rank_runs_the_shape_merged_and_lora_served_in_one_run() -> None:
    rows = bench_lines(BENCH, *SMOKE, "--modes", "greedy", "--lora-rank", "4")
    merged, lora, line = rows
    assert (merged["lora_rank"], lora["lora_rank"]) == (0, 4)
    assert merged["generated_tokens"] == lora["generated_tokens"]
    assert line["bench"] == "rollout_lora" and line["lora_rank"] == 4 and line["lora_over_merged"] > 0
    assert line["lora_over_merged"] == round(merged["tok_s"] / lora["tok_s"], 4)


# the A3B's structure at a tiny size (scripts/bench/generate.py SHAPES): 2 MoE layers of 8 experts, 2 per token
MOE = ["--shapes", "qwen3-moe-tiny", "--prompts", "4", "--samples", "2", "--prompt-min", "8", "--prompt-max", "24",
       "--len-median", "6", "--len-cap", "16"]
TINY_MOE = {"layers": 2, "experts": 8, "k": 2, "hidden": 64, "inter": 32}


@pytest.mark.slow
def test_an_moe_shape_times_the_rollout_with_routing_against_without() -> None:
    """An MoE shape's mode: a row without routing, a row with it (every request returns its routing), the
    same workload generated exactly by both; their rooflines charge each step only the experts it touched;
    the rollout_routing line is the routing run's wall time over the plain one's. Async scheduling, as on a
    GPU: the steps' positions are read at launch, and each must lie in its sample's routing."""
    plain, routed, line = bench_lines(BENCH, *MOE, "--modes", "seeded", "--async-scheduling", "on")
    assert (plain["return_routing"], routed["return_routing"]) == (False, True)
    assert plain["generated_tokens"] == routed["generated_tokens"] == 54 and plain["async_scheduling"]
    m = TINY_MOE
    expert = 3 * m["inter"] * m["hidden"] * 2  # gate, up and down of one expert, bf16
    for row in (plain, routed):
        assert row["shape"] == "qwen3-moe-tiny" and row["layers"] == m["layers"] and row["preempted"] == 0
        cost = row["model_cost"]
        assert cost["expert_bytes"] == expert
        assert cost["expert_params_per_token"] == m["k"] * m["layers"] * expert // 2
        assert cost["experts_per_token"] == m["k"] * m["layers"]
        # the batch-1 floor: the dense weights and k experts a layer
        one_token = cost["weight_bytes"] + m["k"] * m["layers"] * expert
        assert row["weight_roofline_ms"] == pytest.approx(one_token / (row["hbm_gbps"] * 1e6), rel=2e-2)
        # a step's tokens reach at least k of a layer's experts and at most all of them
        assert m["k"] <= row["experts_touched_mean"] <= m["experts"]
        assert row["roofline_s"] > 0 and row["time_over_roofline"] > 0
    assert line["bench"] == "rollout_routing" and line["runs"] == "AB" and line["mode"] == "seeded"
    assert line["routing_over_plain"] == pytest.approx(routed["wall_s"] / plain["wall_s"], rel=2e-3)
    assert line["plain_tok_s"] == pytest.approx(plain["tok_s"], rel=2e-3)
    # uint8 ids of every token the engine computed (prompt + completion - 1 per sample), per layer and slot
    rows_computed = 2 * plain["prompt_tokens"] + plain["generated_tokens"] - plain["sequences"]
    assert line["routing_bytes"] == rows_computed * m["layers"] * m["k"]


@pytest.mark.slow
def test_routing_repeats_alternate_the_runs_and_a_lone_decode_reads_k_experts_a_layer() -> None:
    """--routing-repeats 2 runs A B B A. One sample of 12 tokens: one prefill step (its prompt reaches at
    most all 8 experts of a layer), then 11 decode steps of one token, each reading exactly k = 2."""
    *rows, line = bench_lines(BENCH, "--shapes", "qwen3-moe-tiny", "--prompts", "1", "--samples", "1",
                              "--prompt-min", "16", "--prompt-max", "16", "--len-median", "12", "--len-sigma", "0",
                              "--len-cap", "12", "--modes", "greedy", "--routing-repeats", "2")
    assert [r["return_routing"] for r in rows] == [False, True, True, False] and line["runs"] == "ABBA"
    for r in rows:
        assert r["steps"] == 12 and r["prefill_steps"] == 1
        assert 2 < r["experts_touched_mean"] <= (8 + 11 * 2) / 12
    assert line["plain_wall_s"] == pytest.approx(rows[0]["wall_s"] + rows[3]["wall_s"], abs=2e-4)


def test_an_moe_shape_refuses_what_its_rows_do_not_measure() -> None:
    err = refused(BENCH, "--shapes", "qwen3-moe-tiny", "--draft-layers", "1")
    assert "qwen3-moe-tiny" in err and "--draft-layers" in err
    assert "--layers" in refused(BENCH, "--shapes", "tiny", "--layers", "2")


@pytest.mark.slow
def test_the_modes_own_draft_runs_where_asked(smoke_workload: dict) -> None:
    """--batch-invariant --self-draft: the mode's own draft speculates on the tail (--k, --spec-max-batch) and
    every row says so; without it the mode runs a token a step. The same workload either way."""
    (own,) = bench_lines(BENCH, *SMOKE, "--modes", "greedy", "--batch-invariant", "--self-draft", "--k", "3",
                         "--spec-max-batch", "2")
    (plain,) = bench_lines(BENCH, *SMOKE, "--modes", "greedy", "--batch-invariant", "--no-self-draft")
    assert own["batch_invariant"] and own["self_draft"] and (own["k"], own["spec_max_batch"]) == (3, 2)
    assert 0 < own["spec_steps"] < own["steps"] and own["spec_acceptance"] > 0
    assert plain["batch_invariant"] and not plain["self_draft"] and plain["k"] is None
    assert own["generated_tokens"] == plain["generated_tokens"] == smoke_workload["generated_tokens"]
