"""The engine on CUDA: fp32 greedy equals transformers, bf16 logits close to transformers' bf16, and a
Qwen2-0.5B-shape model generates."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from inference.core import FinishReason, SamplingParams
from inference.engine.llm import LLM
from inference.models.tiny import make_tiny_model
from tests.helpers_models import make_hf_checkpoint, random_prompts

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen2-cuda")
    make_hf_checkpoint("qwen2", path, initializer_range=0.2)
    return path


def test_fp32_greedy_equals_transformers_on_cuda(qwen2_dir: Path) -> None:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(qwen2_dir, dtype=torch.float32).cuda().eval()
    hf.generation_config.eos_token_id = None
    llm = LLM(qwen2_dir, device="cuda", dtype="float32", kv_cache_bytes=64 << 20)
    prompts = random_prompts([3, 17, 9, 30], llm.model_config.vocab_size, seed=1)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt], device="cuda")
        ref = hf.generate(ids, max_new_tokens=32, do_sample=False, pad_token_id=0,
                          attention_mask=torch.ones_like(ids))[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == ref


def test_bf16_logprobs_close_to_transformers_bf16(qwen2_dir: Path) -> None:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(qwen2_dir, dtype=torch.bfloat16).cuda().eval()
    llm = LLM(qwen2_dir, device="cuda", dtype="bfloat16", kv_cache_bytes=64 << 20)
    prompt = random_prompts([24], llm.model_config.vocab_size, seed=2)[0]
    (c,) = llm.generate([prompt], SamplingParams(temperature=1.0, seed=3, max_tokens=16, ignore_eos=True))[0].outputs
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + c.token_ids], device="cuda")).logits[0].float()
    tokens = torch.tensor(c.token_ids, device="cuda")[:, None]
    ref = torch.log_softmax(logits, -1)[len(prompt) - 1:-1].gather(-1, tokens)
    torch.testing.assert_close(torch.tensor(c.logprobs, device="cuda"), ref.squeeze(-1), atol=0.1, rtol=0)


def test_qwen2_05b_shape_generates_in_bf16(tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path / "q05", family="qwen2", hidden_size=896, num_layers=24, num_heads=14,
                           num_kv_heads=2, intermediate_size=4864, vocab_size=151936, dtype="bfloat16",
                           max_position_embeddings=4096)
    llm = LLM(path, device="cuda", dtype="bfloat16", gpu_memory_utilization=0.5)
    outs = llm.generate([[1, 2, 3, 4, 5]] * 8 + [list(range(10, 200))],
                        SamplingParams(temperature=0.8, seed=0, max_tokens=32, ignore_eos=True))
    assert all(len(c.token_ids) == 32 and c.finish_reason is FinishReason.LENGTH for o in outs for c in o.outputs)
    assert all(o.weight_version == 0 for o in outs)
    assert llm.worker.num_blocks > 1000  # sized from free device memory
