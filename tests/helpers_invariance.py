"""The batch-invariance cases (docs/invariance.md, "What the mode covers"), shared by the tests that hold
each path of the engine to the mode's promise: a request's every bit is the same whatever runs beside it.

A case runs the prompts through an engine in one arrangement and returns, per prompt, all a user reads
of it (`result`: each sample's tokens, logprobs as float64 bytes, top logprobs, finish and stop reason):
- `alone`: each prompt by itself on an empty prefix cache (the reference every case equals);
- `batched`: all prompts in one call, then in calls of other sizes;
- `shuffled`: in a shuffled order, in calls of three sizes;
- `prefix_cached`: the prompts sharing a prefix, after a request that leaves the prefix in the cache;
- `preempted`: on a KV cache too small for the batch (preemption, recompute) with chunked prefill;
- `drafted`: beside a draft model (speculative decoding, some proposals accepted, some not).
"""

from __future__ import annotations

import random
from array import array
from collections.abc import Callable, Sequence
from typing import Any

from inference.core import RequestOutput, SamplingParams
from inference.engine.llm import LLM

NEW = 12
PREFIX = 12  # three blocks of 4: the shared prefix a cache hit covers
BLOCK = 4
LENGTHS = [5, 23, 9, 17, 3, 28, 14, 7]
MODES = ("greedy", "seeded")
SIZES = ([3, 5], [2, 2, 4], [1, 7])  # calls of other sizes than the whole batch
# self_draft off unless a case asks for it: on CUDA the mode drafts with its own default kernels by default,
# and "alone" is the mode's forward one token a step
CPU = {"device": "cpu", "dtype": "float32", "kv_cache_bytes": 4 << 20, "block_size": BLOCK, "self_draft": False}
SELF_DRAFT = {"self_draft": True, "num_speculative_tokens": 3}  # the mode's own draft (speculative/self_draft.py)

Sample = tuple[list[int], bytes, object, object, object, bytes | None]
Result = tuple[Sample, ...]
ParamsFor = Callable[[str, int], SamplingParams]  # (sampling mode, prompt index) -> that prompt's params


def make_prompts(vocab: int = 512, seed: int = 0) -> list[list[int]]:
    """Even-indexed prompts start with one shared prefix of PREFIX tokens."""
    rng = random.Random(seed)
    prefix = [rng.randrange(4, vocab) for _ in range(PREFIX)]
    own = [[rng.randrange(4, vocab) for _ in range(n)] for n in LENGTHS]
    return [prefix + p if i % 2 == 0 else p for i, p in enumerate(own)]


def base_params(mode: str, i: int, **extra: Any) -> SamplingParams:
    """Greedy, or seeded sampling (temperature, top-k, top-p, a seed per prompt, top logprobs)."""
    if mode == "greedy":
        return SamplingParams(**{"temperature": 0.0, "max_tokens": NEW, "ignore_eos": True, **extra})
    return SamplingParams(**{"temperature": 0.9, "top_k": 40, "top_p": 0.95, "seed": 100 + i, "max_tokens": NEW,
                             "ignore_eos": True, "logprobs": 2, **extra})


def result(out: RequestOutput) -> Result:
    """Every sample's tokens, logprobs as their float64 bytes, top logprobs, finish and stop reason, and
    the MoE routing it carries (its shape and bytes): two results are equal only when every bit is."""
    return tuple((c.token_ids, array("d", c.logprobs).tobytes(), c.top_logprobs, c.finish_reason, c.stop_reason,
                  None if c.routing is None else repr(c.routing.shape).encode() + c.routing.tobytes())
                 for c in out.outputs)


def logprobs_of(sample: Sample) -> list[float]:
    values = array("d")
    values.frombytes(sample[1])
    return list(values)


def run(llm: LLM, prompts: Sequence[list[int]], params: ParamsFor, mode: str, groups: Sequence[Sequence[int]],
        reset: bool = True) -> dict[int, Result]:
    """Each group of prompt indices in one call (on an empty prefix cache when `reset`)."""
    got: dict[int, Result] = {}
    for group in groups:
        if reset:
            llm.block_manager.reset_prefix_cache()
        outs = llm.generate([prompts[i] for i in group], [params(mode, i) for i in group])
        got.update((i, result(o)) for i, o in zip(group, outs))
    return got


def alone(llm: LLM, prompts: Sequence[list[int]], params: ParamsFor, mode: str) -> dict[int, Result]:
    return run(llm, prompts, params, mode, [[i] for i in range(len(prompts))])


def batched(llm: LLM, prompts: Sequence[list[int]], params: ParamsFor, mode: str) -> list[dict[int, Result]]:
    """The whole batch in one call, then cut into calls of each of SIZES."""
    everything = list(range(len(prompts)))
    out = [run(llm, prompts, params, mode, [everything])]
    for sizes in SIZES:
        starts = [sum(sizes[:j]) for j in range(len(sizes))]
        out.append(run(llm, prompts, params, mode, [everything[s:s + n] for s, n in zip(starts, sizes)]))
    return out


def shuffled(llm: LLM, prompts: Sequence[list[int]], params: ParamsFor, mode: str) -> dict[int, Result]:
    order = list(range(len(prompts)))
    random.Random(1).shuffle(order)
    return run(llm, prompts, params, mode, [order[:3], order[3:4], order[4:]])


def prefix_cached(llm: LLM, prompts: Sequence[list[int]], params: ParamsFor, mode: str) -> dict[int, Result]:
    """The even-indexed prompts (one shared prefix) after a request that leaves the prefix cached; each
    of them hits it."""
    sharing = list(range(0, len(prompts), 2))
    llm.block_manager.reset_prefix_cache()
    # the warming request asks for routing as the case does: only blocks that kept routing serve a hit
    # to a request that asks for it (docs/moe.md)
    routing = params(mode, 0).return_routing
    llm.generate([prompts[0][:PREFIX]], SamplingParams(temperature=0.0, max_tokens=1, return_routing=routing))
    outs = llm.generate([prompts[i] for i in sharing], [params(mode, i) for i in sharing])
    assert all(o.num_cached_tokens >= PREFIX * len(o.outputs) for o in outs), [o.num_cached_tokens for o in outs]
    return {i: result(o) for i, o in zip(sharing, outs)}


def tight_options(llm: LLM, prompts: Sequence[list[int]], samples: int = 1) -> dict[int, int]:
    """A KV cache that holds the longest request with a few blocks to spare, and 16-token steps: the batch
    preempts and the long prompts prefill in chunks."""
    longest = max(map(len, prompts)) + NEW
    blocks = samples * (-(-longest // BLOCK)) + 4
    return {"kv_cache_bytes": blocks * llm.worker.kv_bytes_per_block(BLOCK), "max_num_batched_tokens": 16}


def preempted(tight: LLM, prompts: Sequence[list[int]], params: ParamsFor, mode: str) -> dict[int, Result]:
    assert max(map(len, prompts)) > tight.config.scheduler.max_num_batched_tokens  # chunked prefill
    before = tight.scheduler.preempted
    got = run(tight, prompts, params, mode, [list(range(len(prompts)))])
    assert tight.scheduler.preempted > before, "the tight cache preempted nothing"
    return got


def drafted(spec: LLM, prompts: Sequence[list[int]], params: ParamsFor, mode: str,
            some_kept: bool = True) -> dict[int, Result]:
    """One batch beside a draft model: proposals were verified, some kept (unless `some_kept` is False:
    few rows speculate), some not."""
    before = (spec.spec_stats.proposed, spec.spec_stats.accepted)
    got = run(spec, prompts, params, mode, [list(range(len(prompts)))])
    proposed, accepted = spec.spec_stats.proposed - before[0], spec.spec_stats.accepted - before[1]
    assert (0 if some_kept else -1) < accepted < proposed, (accepted, proposed)
    return got


def self_drafted(llm: LLM, prompts: Sequence[list[int]], params: ParamsFor, mode: str) -> dict[int, Result]:
    """One batch through the mode's own draft (SELF_DRAFT): it proposed, and the verify kept proposals.
    The default kernels rarely disagree with the mode's on a tiny model, so no rejection is required."""
    before = (llm.spec_stats.proposed, llm.spec_stats.accepted)
    got = run(llm, prompts, params, mode, [list(range(len(prompts)))])
    proposed, accepted = llm.spec_stats.proposed - before[0], llm.spec_stats.accepted - before[1]
    assert 0 < accepted <= proposed, (accepted, proposed)
    return got
