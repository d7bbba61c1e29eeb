"""Sleep and wake of a whole engine on the GPU: a level-2 sleep hands back (nearly) all the memory the
engine took beyond the CUDA context, a level-1 cycle keeps tokens and logprobs bit-identical through
the captured CUDA graphs, and after a level-2 wake generation waits for a weight sync."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from inference.core import SamplingParams, StateError
from inference.engine.llm import LLM

pytestmark = pytest.mark.cuda

# A Qwen2.5-7B layer shape with 6 layers: ~5.9 GB of bf16 weights, untied embeddings, qkv biases.
SHAPE = {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 6, "num_attention_heads": 28,
         "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False}
PARAMS = SamplingParams(temperature=1.0, seed=3, max_tokens=24, ignore_eos=True)
PROMPTS = [list(range(100 + i, 160 + i)) for i in range(8)]


def _config_dir(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "rms_norm_eps": 1e-6,
           "rope_theta": 1000000.0, "max_position_embeddings": 4096, "torch_dtype": "bfloat16", **SHAPE}
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def _free() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def _run(llm: LLM) -> list[tuple[list[int], list[float]]]:
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(PROMPTS, PARAMS)]


def test_cuda_engine_sleep_frees_its_memory_and_level1_is_bit_identical(tmp_path: Path) -> None:
    torch.zeros(1, device="cuda")  # the CUDA context exists before the baseline
    free_before = _free()
    llm = LLM(_config_dir(tmp_path / "m"), device="cuda", dtype="bfloat16", load_format="dummy",
              max_num_seqs=32, max_model_len=1024, kv_cache_bytes=4 << 30)
    want = _run(llm)
    free_awake = _free()
    used = free_before - free_awake

    llm.sleep(level=1)
    freed = _free() - free_awake
    llm.wake_up()
    assert _run(llm) == want, "tokens or logprobs changed across a level-1 sleep"

    llm.sleep(level=2)
    freed = min(freed, _free() - free_awake)
    print(f"engine used {used / 1e9:.2f} GB beyond the context; sleep freed {freed / 1e9:.2f} GB "
          f"({freed / used:.1%})")
    held = (f"torch reserves {torch.cuda.memory_reserved()} bytes, {torch.cuda.memory_allocated()} allocated, "
            f"{llm.worker.runner.graphs is not None and len(llm.worker.runner.graphs.graphs)} graphs")
    assert freed >= 0.95 * used, f"sleep freed {freed} of the {used} bytes the engine holds; {held}"
    llm.wake_up()
    with pytest.raises(StateError, match="sync"):
        llm.generate(PROMPTS, PARAMS)
