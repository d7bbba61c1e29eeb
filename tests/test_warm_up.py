"""The start-up warm-up: it touches every compile class a rollout can hit, and leaves no trace.

On the GPU the LLM runs it at construction (scripts/bench/first_batch.py measures the first batch
against the second on an empty kernel cache); here the class coverage is checked against the very
functions the kernels' launches pick their tiles with, and the pass is run on a CPU engine to show
that it changes no output, leaves no request, no prefix-cache entry and no count behind.
"""

from __future__ import annotations

import pytest
import torch

from inference.core import SamplingParams
from inference.engine import warm_up
from inference.engine.llm import LLM
from inference.layers.triton_attention import _pow2_at_least
from inference.sample.sampler import row_chunks

VOCAB = 151_936  # the Qwen2 vocabulary: the sampler's chunking has many classes over it


@pytest.mark.parametrize("max_seqs", [1, 7, 16, 100, 1024])
def test_every_sequence_count_class_is_warmed(max_seqs: int) -> None:
    sizes = warm_up.batch_sizes(max_seqs)
    assert max(sizes) <= max_seqs and len(sizes) <= 2 * max_seqs.bit_length() + 1
    # the prefill attention's sequence tile (BLOCK_B) and the count's integer class, as Triton keys them
    covered = {(warm_up.int_class(n), _pow2_at_least(n)) for n in sizes}
    for n in range(1, max_seqs + 1):
        assert (warm_up.int_class(n), _pow2_at_least(n)) in covered, n


@pytest.mark.parametrize("invariant", [False, True])
@pytest.mark.parametrize("target", [16, 4 * 132])  # the interpreter's SMs; an H100's
def test_every_sampler_row_class_is_warmed(invariant: bool, target: int) -> None:
    rows = warm_up.sampler_rows(1024, VOCAB, target, invariant)
    covered = {(warm_up.int_class(n), row_chunks(1 if invariant else n, VOCAB, target)) for n in rows}
    for n in range(1, 1025):
        assert (warm_up.int_class(n), row_chunks(1 if invariant else n, VOCAB, target)) in covered, n
    assert len(rows) < 100  # classes, not every count
    names = {name for name, _, _ in warm_up.SAMPLER_PATHS}
    assert {"greedy", "seeded", "unseeded", "filtered", "processed", "top_logprobs"} <= names


def _batch(llm: LLM) -> list[list[tuple[list[int], list[float]]]]:
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]
    params = [SamplingParams(temperature=1.0, max_tokens=6, n=2, ignore_eos=True),  # unseeded: the runner's noise
              SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=6, logprobs=2, ignore_eos=True)]
    outs = llm.generate(prompts, params)
    return [[(c.token_ids, c.logprobs) for c in o.outputs] for o in outs]


@pytest.mark.slow  # ~12 s on the 2-core box: two engines and the pass
def test_the_warm_up_changes_no_output_and_leaves_nothing_behind() -> None:
    torch.manual_seed(0)
    kw = dict(device="cpu", dtype="float32", max_num_seqs=8, kv_cache_bytes=8 << 20)
    plain = LLM(None, **kw)
    assert plain.warm_up_s == 0.0  # on CPU the LLM skips it: nothing compiles
    warmed = LLM(None, **kw)
    seconds = warm_up.warm_up_engine(warmed)
    assert seconds > 0
    assert not warmed.has_unfinished() and warmed.take_finished() == []
    assert warmed.block_manager.num_free_blocks == warmed.block_manager.num_blocks  # every block back
    assert warmed.spec_stats.proposed == 0 and not warmed.worker.runner.eager_steps
    first = warmed.add_request([1, 2, 3], SamplingParams(max_tokens=1))
    assert first == plain.add_request([1, 2, 3], SamplingParams(max_tokens=1))  # request ids not consumed
    plain.generate([[4]], SamplingParams(max_tokens=1)), warmed.generate([[4]], SamplingParams(max_tokens=1))
    assert _batch(warmed) == _batch(plain)  # the unseeded rows' noise included
