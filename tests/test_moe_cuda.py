"""The MoE layer and models on CUDA: the grouped Triton GEMMs equal the per-expert loop at the Qwen3-30B-A3B
layer shape (bf16) and give a token the same bits alone or batched with the mode's tiles, whatever number of
pairs its expert got; fp32 greedy equals
transformers; CUDA graphs equal eager; a level-1 sleep changes no bit; the batch-invariant mode's GPU path
(graphs, Triton) gives a prompt the same bits alone and batched."""

from __future__ import annotations

import random
from array import array
from pathlib import Path

import pytest
import torch

from inference.core import SamplingParams
from inference.engine.llm import LLM
from inference.layers import moe
from inference.layers.activation import SiluAndMul
from inference.models.tiny import make_tiny_model
from tests.helpers_models import make_hf_checkpoint, random_prompts

pytestmark = pytest.mark.cuda
A3B = {"experts": 128, "top_k": 8, "hidden": 2048, "inter": 768}  # one Qwen3-30B-A3B MoE layer
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
GPU = {"device": "cuda", "dtype": "bfloat16", "kv_cache_bytes": 64 << 20}


def a3b_layer(tokens: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    e, h, i = A3B["experts"], A3B["hidden"], A3B["inter"]
    gate_up = (torch.randn(e, 2 * i, h, device="cuda", generator=g) / h ** 0.5).bfloat16()
    down = (torch.randn(e, h, i, device="cuda", generator=g) / i ** 0.5).bfloat16()
    x = torch.randn(tokens, h, device="cuda", generator=g).bfloat16()
    w, ids = moe.route(torch.randn(tokens, e, device="cuda", generator=g), A3B["top_k"], True)
    return x, gate_up, down, ids, w


@pytest.mark.parametrize("tokens", [1, 7, 64, 1000])
def test_grouped_gemms_equal_the_loop_at_the_a3b_shape(tokens: int) -> None:
    x, gate_up, down, ids, w = a3b_layer(tokens)
    ref = moe.experts_reference(x.float(), gate_up.float(), down.float(), ids, w, SiluAndMul())
    got = moe.experts_grouped(x, gate_up, down, ids, w, moe.pick_block_m(ids.numel(), False))
    torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2)


def test_grouped_gemms_give_a_token_the_same_bits_alone_and_batched() -> None:
    x, gate_up, down, ids, w = a3b_layer(300)
    full = moe.experts_grouped(x, gate_up, down, ids, w, moe.INVARIANT_BLOCK_M)
    for rows in (slice(0, 1), slice(150, 151), slice(10, 74)):
        alone = moe.experts_grouped(x[rows], gate_up, down, ids[rows], w[rows], moe.INVARIANT_BLOCK_M)
        assert torch.equal(alone, full[rows]), rows


def test_the_modes_grouped_gemms_give_a_pair_the_same_bits_whatever_its_expert_got() -> None:
    """Expert 0 gets 1, 15, 16, 17 or 300 of the pairs (the other slots spread as routed): every token's
    output, the k slots' sum included, equals its output alone."""
    x, gate_up, down, ids, w = a3b_layer(300)
    for count in (1, 15, 16, 17, 300):
        forced = ids.clone()
        forced[:count, 0] = 0
        forced[count:, 0] = torch.where(forced[count:, 0] == 0, 1, forced[count:, 0])
        forced[:, 1:] = torch.where(forced[:, 1:] == 0, 2, forced[:, 1:])  # expert 0 once per token at most
        full = moe.experts_grouped(x, gate_up, down, forced, w, moe.INVARIANT_BLOCK_M)
        for j in (0, count - 1, 299):
            alone = moe.experts_grouped(x[j:j + 1], gate_up, down, forced[j:j + 1], w[j:j + 1],
                                        moe.INVARIANT_BLOCK_M)
            assert torch.equal(alone[0], full[j]), (count, j)


def test_the_layer_captures_in_a_cuda_graph_and_replays_equal() -> None:
    x, gate_up, down, ids, w = a3b_layer(8)
    eager = moe.experts_grouped(x, gate_up, down, ids, w, 16)
    static_x = x.clone()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe.experts_grouped(static_x, gate_up, down, ids, w, 16)
    graph.replay()
    assert torch.equal(out, eager)
    x2, *_ = a3b_layer(8, seed=1)
    static_x.copy_(x2)
    graph.replay()
    assert torch.equal(out, moe.experts_grouped(x2, gate_up, down, ids, w, 16))


@pytest.mark.parametrize("case", ["qwen3_moe", "mixtral"])
def test_fp32_greedy_equals_transformers_on_cuda(case: str, tmp_path: Path) -> None:
    import transformers

    make_hf_checkpoint(case, tmp_path, initializer_range=0.2)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).cuda().eval()
    llm = LLM(tmp_path, device="cuda", dtype="float32", kv_cache_bytes=64 << 20)
    prompts = random_prompts([3, 17, 9], llm.model_config.vocab_size, seed=1)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt], device="cuda")
        ref = hf.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0,
                          attention_mask=torch.ones_like(ids))[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == ref


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("moe-cuda") / "m", "qwen3_moe", seed=2, dtype="bfloat16")


def run(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], bytes]]:
    return [(o.outputs[0].token_ids, array("d", o.outputs[0].logprobs).tobytes())
            for o in llm.generate(prompts, GREEDY)]


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(4, 512) for _ in range(n)] for n in (3, 17, 8, 30, 5, 60, 1, 12)]


def test_graphs_equal_eager_and_sleep_changes_no_bit(moe_dir: Path) -> None:
    graphs = LLM(moe_dir, **GPU)
    want = run(graphs, prompts())
    eager = LLM(moe_dir, enforce_eager=True, **GPU)
    assert [t for t, _ in run(eager, prompts())] == [t for t, _ in want]
    del eager
    graphs.sleep(1)
    graphs.wake_up()
    assert run(graphs, prompts()) == want


def test_batch_invariant_mode_on_the_gpu(moe_dir: Path) -> None:
    llm = LLM(moe_dir, batch_invariant=True, **GPU)
    ps = prompts()
    alone = []
    for p in ps:
        llm.block_manager.reset_prefix_cache()
        alone += run(llm, [p])
    llm.block_manager.reset_prefix_cache()
    assert run(llm, ps) == alone
    llm.block_manager.reset_prefix_cache()
    assert run(llm, ps[::-1]) == alone[::-1]
