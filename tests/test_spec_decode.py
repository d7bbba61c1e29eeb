"""Speculative decoding on CPU (fp32, tiny models): lossless against target-only decoding.

Greedy output is identical with and without a draft (a different random draft rejects, the target as
its own draft accepts everything); sampled tokens follow the target's distribution; stop tokens,
stop strings and max_tokens inside an accepted run cut it; preemption and sleep recompute both
caches; a draft-only weight sync changes the acceptance rate and never the target's outputs.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from inference.core import FinishReason, SamplingParams
from inference.engine.llm import LLM
from inference.models.loader import iter_hf_tensors
from inference.models.tiny import make_tiny_model
from inference.speculative.decoder import SpecDecoder
from tests.helpers_models import make_hf_checkpoint, random_prompts
from tests.helpers_weight_update import Link

VOCAB = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
PROMPT_LENGTHS = [3, 9, 5, 12]


def perturb_checkpoint(src: Path, dst: Path, scale: float, seed: int = 0) -> Path:
    """A copy of src whose weights carry seeded noise: a draft that agrees with src often."""
    shutil.copytree(src, dst)
    gen = torch.Generator().manual_seed(seed)
    state = {n: (t + scale * torch.randn(t.shape, generator=gen)).contiguous() for n, t in iter_hf_tensors(src)}
    save_file(state, str(dst / "model.safetensors"))
    return dst


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("spec")
    target = root / "target"
    hf = make_hf_checkpoint("llama", target, seed=0, vocab_size=VOCAB, initializer_range=0.2)
    del hf
    other = root / "other"
    make_hf_checkpoint("llama", other, seed=1, vocab_size=VOCAB, initializer_range=0.2, num_hidden_layers=1)
    return {"target": target, "other": other, "same": target,
            "close": perturb_checkpoint(target, root / "close", 0.02)}


def engine(target: Path, draft: Path | None = None, k: int = 4, **kw: object) -> LLM:
    kw.setdefault("block_size", 4)
    kw.setdefault("kv_cache_bytes", 2 << 20)
    extra = {"draft_model": str(draft), "num_speculative_tokens": k} if draft is not None else {}
    return LLM(target, device="cpu", dtype="float32", **extra, **kw)


def token_ids(outs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def greedy_ref(models: dict[str, Path]) -> tuple[list[list[int]], list[list[int]]]:
    prompts = random_prompts(PROMPT_LENGTHS, VOCAB, seed=1)
    return prompts, token_ids(engine(models["target"]).generate(prompts, GREEDY))


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("draft", ["other", "close", "same"])
@pytest.mark.slow
def test_greedy_output_is_identical_with_a_draft(models: dict[str, Path], greedy_ref: tuple, draft: str,
                                                 k: int) -> None:
    prompts, ref = greedy_ref
    llm = engine(models["target"], models[draft], k)
    outs = llm.generate(prompts, GREEDY)
    assert token_ids(outs) == ref
    stats = llm.spec_stats
    assert stats.proposed > 0
    rates = [o.metrics["spec_acceptance_rate"] for o in outs]
    if draft == "same":
        assert stats.accepted == stats.proposed and rates == [1.0] * len(prompts)
    else:
        assert stats.accepted < stats.proposed and all(0.0 <= r < 1.0 for r in rates)
    if draft == "other":
        assert stats.acceptance_rate < 0.5


@pytest.mark.slow
def test_greedy_logprobs_are_the_targets(models: dict[str, Path], greedy_ref: tuple) -> None:
    prompts, _ = greedy_ref
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    ref = engine(models["target"]).generate(prompts, params)
    got = engine(models["target"], models["close"], 3).generate(prompts, params)
    for r, g in zip(ref, got):
        assert g.outputs[0].token_ids == r.outputs[0].token_ids
        torch.testing.assert_close(g.outputs[0].logprobs, r.outputs[0].logprobs, rtol=1e-4, atol=1e-4)
        assert [sorted(d) for d in g.outputs[0].top_logprobs] == [sorted(d) for d in r.outputs[0].top_logprobs]


def exact_marginals(target: Path, prompt: list[int], temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Target-only distributions of the 2nd and 3rd completion tokens, by enumerating the first two."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32)
    with torch.no_grad():
        p1 = torch.softmax(hf(torch.tensor([prompt])).logits[0, -1] / temperature, -1)
        seqs1 = torch.tensor([[*prompt, t] for t in range(VOCAB)])
        p2_given = torch.softmax(hf(seqs1).logits[:, -1] / temperature, -1)  # [t1, t2]
        seqs2 = torch.tensor([[*prompt, a, b] for a in range(VOCAB) for b in range(VOCAB)])
        p3_given = torch.softmax(hf(seqs2).logits[:, -1] / temperature, -1).view(VOCAB, VOCAB, VOCAB)
    joint12 = p1[:, None] * p2_given
    return joint12.sum(0), (joint12[..., None] * p3_given).sum((0, 1))


@pytest.mark.slow
def test_sampled_tokens_follow_the_target_distribution(models: dict[str, Path]) -> None:
    """Token 2 comes from a verified proposal (accepted or resampled from the residual), token 3 often
    from the bonus draw: both marginals must match target-only sampling. Deterministic (engine seed)."""
    prompt = random_prompts([6], VOCAB, seed=5)[0]
    temperature = 1.3
    p2, p3 = exact_marginals(models["target"], prompt, temperature)
    llm = engine(models["target"], models["other"], 2, seed=3, max_num_seqs=512, kv_cache_bytes=8 << 20)
    params = SamplingParams(n=1000, temperature=temperature, max_tokens=3, ignore_eos=True)
    outs = llm.generate([prompt] * 4, params)
    tokens = torch.tensor([c.token_ids for o in outs for c in o.outputs])
    assert tokens.shape == (4000, 3)
    stats = llm.spec_stats
    assert 0.2 < stats.acceptance_rate < 0.9  # both the accept and the residual paths ran
    for col, exact in ((1, p2), (2, p3)):
        empirical = torch.bincount(tokens[:, col], minlength=VOCAB).double() / len(tokens)
        tv = 0.5 * (empirical - exact.double()).abs().sum().item()
        assert tv < 0.06, (col, tv)
    # the test has teeth: the draft's own distribution is far from the target's
    q2 = exact_marginals(models["other"], prompt, temperature)[0]
    assert 0.5 * (q2 - p2).abs().sum().item() > 0.15


@pytest.mark.slow
def test_seeded_sampling_is_reproducible_whatever_the_batch(models: dict[str, Path]) -> None:
    prompts = random_prompts([4, 7, 10], VOCAB, seed=9)
    seeded = SamplingParams(temperature=1.0, seed=11, max_tokens=15, ignore_eos=True)
    alone = engine(models["target"], models["close"], 3).generate([prompts[1]], seeded)
    other = SamplingParams(temperature=0.7, max_tokens=9, ignore_eos=True)
    mixed = engine(models["target"], models["close"], 3, seed=4).generate(
        prompts, [other, seeded, other])
    assert mixed[1].outputs[0].token_ids == alone[0].outputs[0].token_ids
    # logits of a larger batch may differ in the last bits (other matmul shapes); the tokens may not
    torch.testing.assert_close(mixed[1].outputs[0].logprobs, alone[0].outputs[0].logprobs, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_stop_token_and_max_tokens_cut_an_accepted_run(models: dict[str, Path], greedy_ref: tuple) -> None:
    prompts, ref = greedy_ref
    ref0 = ref[0]
    stop = ref0[5]
    cut = ref0.index(stop) + 1
    llm = engine(models["target"], models["same"], 4)  # every proposal accepted: runs of 5 tokens
    (c,) = llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                                                     stop_token_ids=(stop,)))[0].outputs
    assert c.token_ids == ref0[:cut] and c.finish_reason is FinishReason.STOP and c.stop_reason == stop
    assert len(c.logprobs) == cut
    for max_tokens in (1, 2, 3, 6, 7):
        (c,) = llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                         ignore_eos=True))[0].outputs
        assert c.token_ids == ref0[:max_tokens] and c.finish_reason is FinishReason.LENGTH


@pytest.mark.slow
def test_stop_string_inside_a_run_truncates_like_target_only(tmp_path: Path) -> None:
    dims = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=96)
    target = make_tiny_model(tmp_path / "t", "qwen2", **dims)
    base = engine(target)
    prompt = "The miller listened"
    free = base.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))[0]
    text = free.outputs[0].text
    assert text and len(text) > 8
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=(stop,))
    ref = base.generate([prompt], params)[0].outputs[0]
    got = engine(target, target, 4).generate([prompt], params)[0].outputs[0]
    assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == (
        ref.token_ids, ref.text, ref.finish_reason, ref.stop_reason)
    assert got.finish_reason is FinishReason.STOP and len(got.logprobs) == len(got.token_ids)


@pytest.mark.slow
def test_preemption_recomputes_both_caches(models: dict[str, Path], greedy_ref: tuple) -> None:
    prompts, ref = greedy_ref
    llm = engine(models["target"], models["close"], 4, block_size=2)
    # a budget of 24 blocks of 2 tokens for four sequences of up to 32 tokens: preemption is certain
    small = engine(models["target"], models["close"], 4, block_size=2,
                   kv_cache_bytes=24 * llm.worker.kv_bytes_per_block(2))
    assert small.block_manager.num_blocks == 24
    outs = small.generate(prompts, GREEDY)
    assert small.scheduler.preempted > 0
    assert token_ids(outs) == ref


@pytest.mark.slow
def test_n_samples_share_the_prompt_and_stay_greedy_identical(models: dict[str, Path], greedy_ref: tuple) -> None:
    prompts, ref = greedy_ref
    params = SamplingParams(n=3, temperature=0.0, max_tokens=20, ignore_eos=True)
    (out,) = engine(models["target"], models["close"], 2).generate([prompts[3]], params)
    assert [c.token_ids for c in out.outputs] == [ref[3]] * 3
    assert out.num_cached_tokens > 0  # samples 1..n-1 hit sample 0's prompt blocks (draft KV included)


@pytest.mark.slow
def test_sleep_and_wake_drop_and_recompute_the_draft_cache(models: dict[str, Path], greedy_ref: tuple) -> None:
    prompts, ref = greedy_ref
    llm = engine(models["target"], models["same"], 3)
    assert token_ids(llm.generate(prompts, GREEDY)) == ref
    llm.sleep(level=1)
    llm.wake_up()
    outs = llm.generate(prompts, GREEDY)  # prefix-cache entries were dropped: no poisoned draft KV hit
    assert token_ids(outs) == ref
    assert [o.metrics["spec_acceptance_rate"] for o in outs] == [1.0] * len(prompts)
    assert all(o.metrics["draft_tokens_accepted"] == o.metrics["draft_tokens_proposed"] > 0 for o in outs)


@pytest.mark.slow
def test_draft_sync_changes_acceptance_not_target_outputs(tmp_path: Path) -> None:
    dims = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=96)
    target = make_tiny_model(tmp_path / "target", "llama", **dims)
    draft = make_tiny_model(tmp_path / "draft", "llama", seed=1, **dims)
    llm = engine(target, draft, 3, kv_cache_bytes=4 << 20)
    prompts = random_prompts([5, 8], llm.model_config.vocab_size, seed=2)
    sampled = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    before = llm.generate(prompts, sampled)
    assert all(o.metrics["spec_acceptance_rate"] < 0.5 for o in before)
    target_digests = llm.worker.weights.checksums("target")

    link = Link(llm.worker)
    state = dict(iter_hf_tensors(target))  # draft := the target's weights
    llm.start_draft_weight_update(1, link.sender.manifest(state, 1))
    result = llm.finish_weight_update(link.transfer(state))
    assert result.model == "draft" and llm.worker.weights.versions == {"target": 0, "draft": 1}

    after = llm.generate(prompts, sampled)
    assert [o.outputs[0].token_ids for o in after] == [o.outputs[0].token_ids for o in before]
    assert [o.metrics["spec_acceptance_rate"] for o in after] == [1.0, 1.0]
    assert llm.worker.weights.checksums("target") == target_digests
    assert llm.weight_version == 0 and all(o.weight_version == 0 for o in after)


@pytest.mark.parametrize("limited_model", ["target", "draft"])
def test_more_verify_rows_than_the_attention_backend_handles_are_refused(models: dict[str, Path],
                                                                         limited_model: str) -> None:
    """A verify launch holds k + 1 decode rows of one sequence; a backend whose kernel takes other rows'
    new keys from the inputs only for tiles.decode_max_rows of them must not be given more."""
    llm = engine(models["target"], models["other"], k=2)
    runner, draft = llm.worker.runner, llm.worker.models["draft"]
    limited = SimpleNamespace(name="limited", tiles=SimpleNamespace(decode_max_rows=4))
    (runner.model if limited_model == "target" else draft).set_attention_backend(limited)
    assert SpecDecoder(runner, draft, 3).k == 3
    with pytest.raises(ValueError, match=r"num_speculative_tokens: 4 needs 5 decode rows.*limited.*at most 4"):
        SpecDecoder(runner, draft, 4)


@pytest.mark.slow
def test_speculation_runs_on_the_tail_only_and_stays_lossless(models: dict[str, Path], greedy_ref: tuple) -> None:
    """spec_max_batch=2 (issue 24): while more than two sequences decode, their steps carry no draft
    tokens (the draft only mirrors them); once the batch drains to two, speculation starts, on the
    tail, and greedy output is target-only's, token for token."""
    prompts, _ = greedy_ref
    lengths = [4, 8, 16, 28]  # a long-tailed batch: the longest sample decodes alone at the end
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    ref = token_ids(engine(models["target"]).generate(prompts, params))
    llm = engine(models["target"], models["close"], 3, spec_max_batch=2)
    seen: list[tuple[int, int]] = []  # (decodes in the step, draft tokens proposed in it)
    execute = llm.worker.execute_model

    def counting(batch: object, overlap: bool = False) -> object:
        decodes = sum(1 for n in batch.num_new_tokens if n == 1)
        seen.append((decodes, sum(batch.num_lookahead)))
        return execute(batch, overlap)

    llm.worker.execute_model = counting
    assert token_ids(llm.generate(prompts, params)) == ref
    assert any(proposed for _, proposed in seen), seen
    assert all(proposed == 0 for decodes, proposed in seen if decodes > 2), seen
    assert all(proposed > 0 for decodes, proposed in seen if 0 < decodes <= 2), seen
    assert llm.spec_stats.proposed > 0
    always = engine(models["target"], models["close"], 3, spec_max_batch=0)
    assert token_ids(always.generate(prompts, params)) == ref
    assert always.spec_stats.proposed > llm.spec_stats.proposed  # 0: every batch size speculates


def test_spec_max_batch_below_zero_is_refused_naming_it(models: dict[str, Path]) -> None:
    from inference.core import InvalidRequestError

    with pytest.raises(InvalidRequestError) as bad:
        engine(models["target"], models["close"], 3, spec_max_batch=-1)
    assert bad.value.field == "scheduler.spec_max_batch"


@pytest.mark.slow
def test_async_steps_with_a_draft_that_follows_them(models: dict[str, Path], greedy_ref: tuple) -> None:
    """async_scheduling=True with a draft: the full batch's steps launch asynchronously and the draft
    follows each (its KV of the same tokens), the tail speculates synchronously. The target as its
    own draft accepts every token only if the draft's cache is complete: the followed positions,
    prefix-cache hits of n samples, and recomputes after preemption included. Greedy output is
    target-only's."""
    prompts, _ = greedy_ref
    lengths = [6, 10, 18, 30]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    ref = token_ids(engine(models["target"]).generate(prompts, params))
    per_block = engine(models["target"], models["same"], 3, block_size=2).worker.kv_bytes_per_block(2)
    for kw in ({}, {"block_size": 2, "kv_cache_bytes": 26 * per_block}):  # 26 blocks of 2: preemption
        llm = engine(models["target"], models["same"], 3, spec_max_batch=2, async_scheduling=True, **kw)
        kinds: list[str] = []
        execute = llm.worker.execute_model

        def counting(batch: object, overlap: bool = False, kinds: list[str] = kinds,
                     execute: object = execute) -> object:
            kinds.append("async" if overlap else "spec" if any(batch.num_lookahead) else "sync")
            return execute(batch, overlap)

        llm.worker.execute_model = counting
        outs = llm.generate(prompts, params)
        assert token_ids(outs) == ref, kw
        assert "async" in kinds and "spec" in kinds, kinds
        assert llm.spec_stats.proposed > 0 and llm.spec_stats.accepted == llm.spec_stats.proposed, kw
    assert llm.scheduler.preempted > 0  # the small cache of the second run
    n_params = SamplingParams(n=4, temperature=0.0, max_tokens=16, ignore_eos=True)
    llm = engine(models["target"], models["same"], 3, spec_max_batch=2, async_scheduling=True)
    (out,) = llm.generate([prompts[3]], n_params)
    assert out.num_cached_tokens > 0 and llm.spec_stats.accepted == llm.spec_stats.proposed > 0
    assert [c.token_ids for c in out.outputs] == [token_ids(engine(models["target"]).generate([prompts[3]],
                                                                                              n_params))[0]] * 4
