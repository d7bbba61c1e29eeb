"""The engine end to end on CPU (fp32): outputs equal transformers', sampling rules, errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from inference.core import FinishReason, InvalidRequestError, SamplingParams
from inference.engine.llm import LLM
from tests.helpers_models import CASES, make_hf_checkpoint, random_prompts

GREEDY32 = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
LENGTHS = [3, 17, 9, 30]


def hf_greedy(hf_model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    hf_model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                                pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module", params=sorted(CASES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp(request.param)
    hf = make_hf_checkpoint(request.param, path, initializer_range=0.2)
    return path, hf


def small_llm(path: Path, **kw) -> LLM:
    kw.setdefault("block_size", 4)
    kw.setdefault("kv_cache_bytes", 4 << 20)
    return LLM(path, device="cpu", dtype="float32", **kw)


@pytest.mark.slow
def test_greedy_equals_transformers(family: tuple[Path, torch.nn.Module]) -> None:
    path, hf = family
    llm = small_llm(path)
    prompts = random_prompts(LENGTHS, llm.model_config.vocab_size, seed=1)
    outs = llm.generate(prompts, GREEDY32)
    for prompt, out in zip(prompts, outs):
        assert out.prompt_token_ids == prompt
        (c,) = out.outputs
        assert c.token_ids == hf_greedy(hf, prompt, 32)
        assert c.finish_reason is FinishReason.LENGTH
        assert out.weight_version == 0


def test_logprobs_equal_reference_log_softmax(family: tuple[Path, torch.nn.Module]) -> None:
    path, hf = family
    llm = small_llm(path)
    prompt = random_prompts([11], llm.model_config.vocab_size, seed=2)[0]
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True, logprobs=3)
    (c,) = llm.generate([prompt], params)[0].outputs
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + c.token_ids])).logits[0].float()
    ref = torch.log_softmax(logits, dim=-1)[len(prompt) - 1:-1]
    expected = ref.gather(-1, torch.tensor(c.token_ids)[:, None]).squeeze(-1)
    torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-4, rtol=0)
    assert c.top_logprobs is not None and len(c.top_logprobs) == 12
    top_ref = ref[0].topk(3)
    assert list(c.top_logprobs[0]) == top_ref.indices.tolist()


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen2-engine")
    make_hf_checkpoint("qwen2", path, initializer_range=0.2)
    return path


@pytest.mark.slow
def test_same_seed_same_sample_regardless_of_batch(qwen2: Path) -> None:
    llm = small_llm(qwen2)
    prompt = random_prompts([8], llm.model_config.vocab_size, seed=3)[0]
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate([prompt], params)[0].outputs[0].token_ids
    others = random_prompts([5, 13], llm.model_config.vocab_size, seed=4)
    batched = llm.generate([others[0], prompt, others[1]],
                           [SamplingParams(temperature=1.0, max_tokens=16), params,
                            SamplingParams(temperature=0.7, max_tokens=9)])
    assert batched[1].outputs[0].token_ids == alone
    other_seed = llm.generate([prompt], SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=99,
                                                       max_tokens=16, ignore_eos=True))
    assert other_seed[0].outputs[0].token_ids != alone


def test_n_samples_share_the_prompt_blocks(qwen2: Path) -> None:
    llm = small_llm(qwen2)
    prompt = random_prompts([22], llm.model_config.vocab_size, seed=5)[0]  # 5 full blocks of 4
    out = llm.generate([prompt], SamplingParams(n=4, temperature=1.0, seed=0, max_tokens=8, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert out.num_cached_tokens == 3 * 20  # samples 1..3 hit the leader's 5 full blocks
    assert llm.block_manager.stats.hit_blocks >= 15
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # the samples differ


@pytest.mark.slow
def test_preemption_under_a_tiny_kv_budget_gives_the_same_greedy_output(qwen2: Path) -> None:
    roomy = small_llm(qwen2)
    prompts = random_prompts([6, 10, 14, 7, 12, 9], roomy.model_config.vocab_size, seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params)]
    bytes_per_block = roomy.worker.runner.kv_bytes_per_block(4)
    tight = small_llm(qwen2, kv_cache_bytes=12 * bytes_per_block, max_num_batched_tokens=16)
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params)]
    assert tight.scheduler.preempted > 0
    assert got == expected
    assert tight.block_manager.num_free_blocks == tight.block_manager.num_blocks


def test_stop_token_ids_and_max_tokens(qwen2: Path) -> None:
    llm = small_llm(qwen2)
    prompt = random_prompts([5], llm.model_config.vocab_size, seed=8)[0]
    free_run = llm.generate([prompt], GREEDY32)[0].outputs[0].token_ids
    stop_at = free_run[5]
    first = free_run.index(stop_at)
    c = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True,
                                              stop_token_ids=(stop_at,)))[0].outputs[0]
    assert c.token_ids == free_run[:first + 1]
    assert c.finish_reason is FinishReason.STOP and c.stop_reason == stop_at


@pytest.mark.parametrize(("prompt", "params", "field"), [
    ([1, 2, 10_000], {}, "prompts[1]"),
    ([], {}, "prompts[1]"),
    (list(range(1, 300)), {}, "prompts[1]"),
    ([1, 2], {"temperature": -1.0}, "sampling_params.temperature"),
    ([1, 2], {"top_p": 0.0}, "sampling_params.top_p"),
    ([1, 2], {"n": 0}, "sampling_params.n"),
    ([1, 2], {"max_tokens": 0}, "sampling_params.max_tokens"),
    ([1, 2], {"stop_token_ids": (10_000,)}, "sampling_params.stop_token_ids"),
    ([1, 2], {"max_tokens": 255}, "sampling_params.max_tokens"),  # 2 + 255 > max_model_len 256
    ([1, 2], {"n": 2, "sample_max_tokens": (3,)}, "sampling_params.sample_max_tokens"),  # one per sample
    ([1, 2], {"n": 2, "max_tokens": 4, "sample_max_tokens": (3, 5)}, "sampling_params.sample_max_tokens"),
])
@pytest.mark.slow
def test_bad_input_is_rejected_by_name_and_others_keep_running(
        qwen2: Path, prompt: list[int], params: dict, field: str) -> None:
    # SamplingParams refuse a bad value when built (inference/core.py), so each call builds its own
    llm = small_llm(qwen2, max_model_len=256)
    good = random_prompts([6], llm.model_config.vocab_size, seed=9)[0]
    in_flight = llm.add_request(good, GREEDY32)
    llm.step()
    with pytest.raises(InvalidRequestError) as err:
        llm.generate([good, prompt], [GREEDY32, SamplingParams(**params)])
    assert err.value.field.startswith(field)
    with pytest.raises(InvalidRequestError):
        llm.add_request(prompt, SamplingParams(**params))
    finished = []
    while llm.has_unfinished():
        finished += llm.step()
    assert [o.request_id for o in finished] == [in_flight]
    assert len(finished[0].outputs[0].token_ids) == 32


def test_each_sample_of_a_group_stops_at_its_own_max_tokens(qwen2: Path) -> None:
    llm = small_llm(qwen2)
    prompt = random_prompts([7], llm.model_config.vocab_size, seed=4)[0]
    params = SamplingParams(n=3, temperature=0.0, max_tokens=20, sample_max_tokens=[5, 20, 1], ignore_eos=True)
    out = llm.generate([prompt], params)[0]
    assert [len(c.token_ids) for c in out.outputs] == [5, 20, 1]
    full = out.outputs[1].token_ids  # greedy: every sample is a prefix of the longest
    assert all(c.token_ids == full[:len(c.token_ids)] and c.finish_reason is FinishReason.LENGTH
               for c in out.outputs)


@pytest.mark.slow
def test_string_prompts_and_stop_strings(tmp_path: Path) -> None:
    from inference.models.tiny import make_tiny_model

    path = make_tiny_model(tmp_path / "tiny", family="qwen2", seed=0)
    llm = LLM(path, device="cpu", dtype="float32", kv_cache_bytes=4 << 20)
    out = llm.generate(["The quick brown fox"], GREEDY32)[0]
    text = out.outputs[0].text
    assert out.prompt == "The quick brown fox"
    assert text == llm.tokenizer.decode(out.outputs[0].token_ids)
    assert len(text) > 4
    stop = text[2:4]
    c = llm.generate(["The quick brown fox"], SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True,
                                                             stop=(stop,)))[0].outputs[0]
    assert c.finish_reason is FinishReason.STOP and c.stop_reason == stop
    assert c.text == text[:text.index(stop)]
