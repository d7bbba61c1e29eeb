"""scripts/bench_invariance.py on the tiny model (CPU, float32, few prompts): every engine mode, case and
sampling mode prints its JSON line; the comparison counts bit-level differences; the batch-invariant mode
is bitwise equal in every case; what the default engine guarantees on the CPU holds in the measured runs
(greedy tokens never depend on the batch, the cache, preemption or a draft; seeded tokens never depend on
the batch, the cache or preemption); the fp32 error lines measure each engine's logprobs against an fp32
forward of its weights; the speed lines time both modes. One torch thread (restored after):
the runs are the same, and much faster on a shared machine."""

from __future__ import annotations

import json
import math

import pytest
import torch

from inference.core import CompletionOutput, RequestOutput, SamplingParams
from inference.engine.llm import LLM
from inference.models.tiny import default_model_dir
from scripts import bench_invariance as bench
from scripts import bench_invariance_fp32 as fp32

ARGS = ["--shape", "tiny", "--prompts", "6", "--new", "16", "--prompt-max", "24", "--prefix-len", "16"]


def _out(tokens: list[int], logprobs: list[float]) -> RequestOutput:
    return RequestOutput("r", [1], [CompletionOutput(0, tokens, logprobs)], weight_version=0)


def test_compare_counts_bitwise_equality() -> None:
    one_ulp = math.nextafter(-0.5, 0.0)
    ref = bench.Run([_out([1, 2], [-0.5, -1.0]), _out([3], [-2.0]), _out([4, 5], [-0.1, -0.2]), None], 2.0)
    run = bench.Run([_out([1, 2], [-0.5, -1.0]), _out([3], [one_ulp * 4]), _out([4, 6], [-0.1, -9.0]),
                     _out([7], [0.0])], 2.0)
    got = bench.compare(ref, run)
    assert got["requests"] == 3  # the prompt ref did not generate is left out
    assert got["tokens_equal"] == round(2 / 3, 4) and got["logprobs_equal"] == round(1 / 3, 4)
    # over the positions before the first differing token only: |-2.0 - 4 * (-0.5 + ulp)|
    assert got["logprob_max_abs_diff"] == pytest.approx(abs(-2.0 - one_ulp * 4))
    assert got["tokens_per_s"] == 2.5  # 5 generated tokens in 2 s


def test_shuffled_groups_cover_every_prompt_once() -> None:
    groups = bench.shuffled_groups(64, seed=3)
    assert sorted(i for g in groups for i in g) == list(range(64)) and len(groups) > 1
    assert [i for g in groups for i in g] != list(range(64))


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread: None) -> None:
    """the conftest fixture, for every test of this module"""


@pytest.fixture(scope="module")
def all_lines() -> list[dict]:
    return bench.run_all(bench.parse_args(ARGS))


@pytest.fixture(scope="module")
def lines(all_lines: list[dict]) -> dict[tuple[str, str, str], dict]:
    return {(d["engine"], d["mode"], d["case"]): d for d in all_lines if d["bench"] == "invariance"}


def test_every_case_and_mode_is_measured(lines: dict[tuple[str, str, str], dict]) -> None:
    assert set(lines) == {(e, m, c) for e in bench.ENGINES for m in bench.MODES for c in bench.CASES}
    for (_engine, _mode, case), d in lines.items():
        assert d["shape"] == "tiny" and d["tokens_per_s"] > 0, d
        assert d["requests"] == (3 if case == "prefix_cached" else 6), d
        assert 0.0 <= d["logprobs_equal"] <= d["tokens_equal"] <= 1.0, d
        if case == "alone":
            assert d["tokens_equal"] == d["logprobs_equal"] == 1.0
        if case == "prefix_cached":
            assert d["cached_tokens"] == 3 * 16  # one cached block per sharing prompt
        if case == "preempted":
            assert d["preemptions"] >= 1  # the small KV cache really preempted
        if case == "batch":
            assert d["preemptions"] == 0


def test_the_batch_invariant_mode_is_bitwise_equal_in_every_case(lines: dict[tuple[str, str, str], dict]) -> None:
    for (engine, _mode, _case), d in lines.items():
        if engine == "invariant":
            assert d["tokens_equal"] == d["logprobs_equal"] == 1.0 and d["logprob_max_abs_diff"] == 0.0, d
    assert lines["invariant", "greedy", "draft"]["draft_acceptance"] > 0  # the draft really proposed


@pytest.mark.parametrize("mode,cases", [("greedy", ("batch", "shuffled", "prefix_cached", "preempted", "draft")),
                                        ("seeded", ("batch", "shuffled", "prefix_cached", "preempted"))])
def test_tokens_the_default_engine_guarantees_are_equal(lines: dict[tuple[str, str, str], dict], mode: str,
                                                        cases: tuple[str, ...]) -> None:
    for case in cases:
        d = lines["default", mode, case]
        assert d["tokens_equal"] == 1.0, d
        assert d["logprob_max_abs_diff"] < 1e-4, d  # float32 rounding only, never another distribution


def test_the_speed_lines_time_both_modes(all_lines: list[dict]) -> None:
    speed = {(d["engine"], d["batch"]): d for d in all_lines if d["bench"] == "invariance_speed"}
    assert set(speed) == {(e, b) for e in bench.ENGINES for b in (1, 8)}
    assert all(d["tokens_per_s"] > 0 and d["prompt_len"] == 16 for d in speed.values())
    costs = {d["batch"]: d for d in all_lines if d["bench"] == "invariance_cost"}
    assert set(costs) == {1, 8} and all(d["mode_over_default"] > 0 for d in costs.values())


def test_fp32_error_lines_cover_both_engines(all_lines: list[dict]) -> None:
    errors = {(d["engine"], d["mode"]): d for d in all_lines if d["bench"] == "invariance_fp32_error"}
    assert set(errors) == {(e, m) for e in bench.ENGINES for m in bench.MODES}
    alone = {(d["engine"], d["mode"]): d for d in all_lines if d["bench"] == "invariance" and d["case"] == "alone"}
    for key, d in errors.items():
        assert d["tokens"] == alone[key]["requests"] * 16, d  # every generated token of the alone case
        # the tiny model is float32: the fp32 forward differs from the engine's by summation order only
        assert math.isfinite(d["mean_abs"]) and 0.0 <= d["mean_abs"] <= d["max_abs"] < 5e-5, d
        assert d["mean_abs"] < 1e-5, d
    cmps = {d["mode"]: d for d in all_lines if d["bench"] == "invariance_fp32_error_cmp"}
    assert set(cmps) == set(bench.MODES)
    for mode, d in cmps.items():
        assert d["mode_mean_abs"] == errors["invariant", mode]["mean_abs"], d
        assert d["default_mean_abs"] == errors["default", mode]["mean_abs"], d
        assert d["tolerance"] > 0 and isinstance(d["within"], bool), d


def test_fp32_error_of_a_bf16_engine_is_its_rounding() -> None:
    """On bf16 weights the reference is the exact upcast, and the engine's bf16 error shows (the fp32
    engine's is under 1e-5, above): the measurement sees what it is meant to."""
    llm = LLM(default_model_dir(), device="cpu", dtype="bfloat16", max_model_len=128)
    try:
        src = dict(llm.worker.models["target"].named_parameters())
        copy = fp32.fp32_copy(llm)
        assert all(p.dtype == torch.float32 and torch.equal(p, src[n].float()) for n, p in copy.named_parameters())
        outs = llm.generate([[5, 6, 7, 8, 9, 10], [11, 12, 13]],
                            [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)] * 2)
        errs = fp32.abs_errors(llm, outs, 128)
        assert errs.numel() == 32 and 1e-3 < errs.mean().item() < 0.1, errs
    finally:
        llm.worker.shutdown()


def test_fp32_cmp_allows_noise_but_not_a_worse_mode() -> None:
    base = torch.full((1000,), 0.02, dtype=torch.float64)
    assert fp32.cmp_line("greedy", base * 1.04, base)["within"]  # inside the 5% floor
    assert not fp32.cmp_line("greedy", base * 1.2, base)["within"]
    noisy = torch.tensor([0.0, 0.04] * 5, dtype=torch.float64)  # 10 tokens: a large standard error
    assert fp32.cmp_line("seeded", noisy * 1.2, noisy)["within"]


def test_main_prints_one_json_line_per_case(capsys: pytest.CaptureFixture[str]) -> None:
    bench.main([*ARGS, "--modes", "greedy", "--cases", "alone,batch", "--engines", "invariant", "--speed-batches", "0"])
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(d["engine"], d["mode"], d["case"]) for d in printed[:2]] == [("invariant", "greedy", "alone"),
                                                                            ("invariant", "greedy", "batch")]
    # one engine: its fp32 error line, no comparison line
    assert [(d["bench"], d["engine"], d["mode"]) for d in printed[2:]] == [
        ("invariance_fp32_error", "invariant", "greedy")]


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(SystemExit):
        bench.parse_args([*ARGS, "--cases", "batch"])  # no reference
    with pytest.raises(SystemExit):
        bench.parse_args([*ARGS, "--modes", "sampled"])
    with pytest.raises(SystemExit):
        bench.parse_args([*ARGS, "--engines", "fast"])
