"""The engine in FP8 mode (EngineConfig.quantization = "fp8"): greedy output equal to an engine loaded from
the same bf16 weights quantized offline; on CUDA (`cuda`), the FP8 GEMV and _scaled_mm against
dequantize-then-matmul, CUDA graphs equal to eager, and a level-2 sleep restored by a sync."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from inference.core import SamplingParams
from inference.engine.llm import LLM
from inference.quant.fp8 import dequantize_rows, quantize_rows
from tests.helpers_models import make_hf_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 17, 33, 2, 9], [100, 3], list(range(40, 70))]


def dequantized_copy(src: Path, dst: Path) -> Path:
    """The checkpoint at src with every decoder linear weight replaced by the rule's dequantized values:
    what an FP8 engine computes with, written as a plain checkpoint."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
            continue
        tensors = load_file(str(f))
        for name, t in tensors.items():
            if name.startswith("model.layers.") and name.endswith("_proj.weight"):
                tensors[name] = dequantize_rows(*quantize_rows(t, name), t.dtype)
        save_file(tensors, str(dst / f.name), metadata={"format": "pt"})
    return dst


def _greedy(llm: LLM) -> list[tuple[list[int], list[float]]]:
    outs = llm.generate(PROMPTS, GREEDY)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.mark.slow
def test_fp8_engine_equals_the_offline_quantized_engine(tmp_path: Path) -> None:
    make_hf_checkpoint("qwen2", tmp_path / "hf", initializer_range=0.2)
    kw = dict(device="cpu", dtype="float32", block_size=4, kv_cache_bytes=4 << 20)
    fp8 = LLM(tmp_path / "hf", quantization="fp8", **kw)
    offline = LLM(dequantized_copy(tmp_path / "hf", tmp_path / "deq"), **kw)
    assert _greedy(fp8) == _greedy(offline)
    assert fp8.worker.models["target"].model.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
