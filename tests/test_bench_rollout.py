"""scripts/bench_rollout.py on CPU with the tiny model: the smoke mode the H200 run shares its code with."""

from __future__ import annotations

import gc
import json

import pytest
import torch

from inference.engine.llm import LLM
from scripts.bench_rollout import ModelCost, draw_workload, main, parse_args, submit

SMOKE = ["--shapes", "tiny", "--prompts", "4", "--samples", "2", "--prompt-min", "8", "--prompt-max", "24",
         "--len-median", "6", "--len-cap", "16"]


def test_default_workload_is_the_issue_24_batch() -> None:
    work = draw_workload(parse_args([]), vocab=151936, seed=0)
    assert len(work.prompts) == 64 and work.num_samples == 512
    assert all(128 <= len(p) <= 512 for p in work.prompts)
    lengths = [n for lens in work.lengths for n in lens]
    assert max(lengths) == 2048 and 440 < work.num_tokens / 512 < 490  # lognormal mean ~466, capped
    assert draw_workload(parse_args([]), vocab=151936, seed=0) == work  # a fixed RNG


def test_each_sample_generates_exactly_its_drawn_length() -> None:
    args = parse_args(SMOKE)
    llm = LLM(None, device="cpu", max_model_len=64)
    work = draw_workload(args, llm.model_config.vocab_size, seed=3)
    submit(llm, work, "seeded")
    got: dict[str, list[int]] = {}
    while llm.has_unfinished():
        for out in llm.step():
            got[out.request_id] = [len(c.token_ids) for c in out.outputs]
    assert [got[k] for k in sorted(got, key=lambda r: int(r.split("-")[1]))] == work.lengths


def test_smoke_run_prints_one_row_per_mode(capsys: pytest.CaptureFixture[str]) -> None:
    rows = main(SMOKE)
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert printed == rows and [r["mode"] for r in rows] == ["greedy", "sampled", "seeded"]
    work = draw_workload(parse_args(SMOKE), 512, seed=0)
    for r in rows:
        assert r["shape"] == "tiny" and r["sequences"] == 8 and r["generated_tokens"] == work.num_tokens
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
    assert gc.get_freeze_count() == 0  # unfrozen before the engine was dropped: its cycles stay collectable


def test_gc_freeze_off_times_the_unfrozen_heap(capsys: pytest.CaptureFixture[str]) -> None:
    (row,) = main([*SMOKE, "--modes", "greedy", "--gc-freeze", "off"])
    assert row["gc_frozen"] is False and row["gc_full_collect_ms"] is None
    assert gc.get_freeze_count() == 0


def test_profile_writes_a_kernel_table_per_window(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = main([*SMOKE, "--modes", "seeded", "--profile", str(tmp_path), "--profile-steps", "0,8",
                 "--profile-length", "4"])
    capsys.readouterr()
    assert rows[0]["profiled"]
    tables = sorted(p.name for p in tmp_path.iterdir())
    assert tables == ["tiny_seeded_step0.txt", "tiny_seeded_step8.txt"]
    text = (tmp_path / "tiny_seeded_step8.txt").read_text()
    assert text.startswith("4 steps from step 8") and "Name" in text


def test_model_cost_counts_the_tiny_model() -> None:
    llm = LLM(None, device="cpu")
    mc, cost = llm.model_config, ModelCost.of(llm)
    h, kv, d = mc.hidden_size, mc.num_kv_heads, mc.head_dim
    per_layer = h * (mc.num_heads + 2 * kv) * d + mc.num_heads * d * h + 3 * h * mc.intermediate_size
    assert cost.matmul_params == mc.num_layers * per_layer
    assert cost.kv_bytes_per_token == 2 * mc.num_layers * kv * d * 4  # float32 on CPU
    assert cost.attn_flops_per_pair == 4 * mc.num_heads * d * mc.num_layers
    params = sum(p.numel() * 4 for p in llm.worker.models["target"].parameters())
    embed = 0 if mc.tie_word_embeddings else mc.vocab_size * h * 4
    assert cost.weight_bytes == params - embed


def test_a_draft_speculates_on_the_tail_only(capsys: pytest.CaptureFixture[str]) -> None:
    """--draft-layers with --spec-max-batch 2: some steps speculate (the drained tail), not all of them,
    and the tokens generated are the workload's."""
    (row,) = main([*SMOKE, "--modes", "greedy", "--draft-layers", "1", "--k", "2", "--spec-max-batch", "2"])
    work = draw_workload(parse_args(SMOKE), 512, seed=0)
    assert row["generated_tokens"] == work.num_tokens and row["spec_max_batch"] == 2
    assert 0 < row["spec_steps"] < row["steps"] and row["spec_acceptance"] is not None


def test_tail_scale_damps_only_the_layers_beyond_the_draft() -> None:
    """--tail-scale: o_proj and down_proj of the target's layers past the draft's scale; nothing else moves."""
    from scripts.bench_rollout import damp_tail

    model = LLM(None, device="cpu").worker.models["target"]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    damp_tail(model, 1, 0.5)
    for name, p in model.named_parameters():
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else -1
        damped = layer >= 1 and name.endswith(("o_proj.weight", "down_proj.weight"))
        torch.testing.assert_close(p, before[name] * 0.5 if damped else before[name], rtol=0, atol=0)
    assert any(n.endswith("o_proj.weight") and ".1." in n for n in before)  # the tiny model has a layer 1
    damp_tail(model, 1, 1.0)  # the default leaves the weights alone
    torch.testing.assert_close(dict(model.named_parameters())["model.norm.weight"], before["model.norm.weight"])
