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


# ---- on the GPU (the lead runs these: pytest -m cuda tests/test_fp8_engine.py) ---------------------------

def _cuda_operands(m: int, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to("cuda", torch.bfloat16)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to("cuda", torch.bfloat16)
    q, scale = quantize_rows(w, "w")
    b = torch.randn(n, generator=g).to("cuda", torch.bfloat16)
    return x, q, scale, b


def _reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    w = dequantize_rows(q, scale, torch.float32)
    return torch.nn.functional.linear(x.float(), w, None if b is None else b.float())


@pytest.mark.cuda
@pytest.mark.parametrize(("n", "k"), [(4608, 3584), (3584, 18944), (37888, 3584), (1152, 896), (37, 70)])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_cuda_fp8_gemv_matches_dequantize_then_matmul(m: int, n: int, k: int) -> None:
    from inference.layers.fp8_linear import fp8_linear, use_fp8_gemv

    x, q, scale, b = _cuda_operands(m, n, k)
    assert use_fp8_gemv(x, q)
    got = fp8_linear(x, q, scale, b)
    torch.testing.assert_close(got.float(), _reference(x, q, scale, b), atol=3e-2, rtol=2 ** -6)


@pytest.mark.cuda
@pytest.mark.parametrize("m", [16, 64, 512])
def test_cuda_scaled_mm_matches_dequantize_then_matmul_within_activation_rounding(m: int) -> None:
    """Past the GEMV's rows x is quantized too (W8A8): within the e4m3 rounding of x (2^-4 relative)."""
    from inference.layers.fp8_linear import fp8_linear, use_fp8_gemv, use_scaled_mm

    x, q, scale, b = _cuda_operands(m, 4608, 3584)
    assert use_scaled_mm(x, q) and not use_fp8_gemv(x, q)
    got = fp8_linear(x, q, scale, b).float()
    want = _reference(x, q, scale, b)
    assert (got - want).abs().mean() < 0.02 * want.abs().mean()
    torch.testing.assert_close(got, want, atol=0.25, rtol=0.1)


@pytest.mark.cuda
def test_cuda_fp8_rule_on_device_is_bit_exact_with_cpu() -> None:
    w = torch.randn(4096, 4096, dtype=torch.bfloat16) * 0.02
    q, scale = quantize_rows(w, "w")
    qc, scalec = quantize_rows(w.cuda(), "w")
    assert torch.equal(qc.cpu().view(torch.uint8), q.view(torch.uint8)) and torch.equal(scalec.cpu(), scale)


@pytest.mark.cuda
def test_cuda_fp8_graphs_equal_eager(tmp_path: Path) -> None:
    make_hf_checkpoint("qwen2", tmp_path, initializer_range=0.2, max_position_embeddings=512)
    prompts = [list(range(3 + i, 20 + 3 * i)) for i in range(12)]  # 12 rows: the GEMV and _scaled_mm paths
    runs = []
    for eager in (True, False):
        llm = LLM(tmp_path, device="cuda", dtype="bfloat16", quantization="fp8", kv_cache_bytes=64 << 20,
                  max_num_seqs=16, enforce_eager=eager)
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
        runs.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs])
        if not eager:
            assert llm.worker.runner.graphs is not None and llm.worker.runner.graphs.graphs
        del llm
        torch.cuda.empty_cache()
    assert runs[0] == runs[1]


@pytest.mark.cuda
def test_cuda_fp8_batch_invariant_mode_runs_and_is_invariant(tmp_path: Path) -> None:
    make_hf_checkpoint("qwen2", tmp_path, initializer_range=0.2, max_position_embeddings=512)
    llm = LLM(tmp_path, device="cuda", dtype="bfloat16", quantization="fp8", batch_invariant=True,
              kv_cache_bytes=64 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], params)[0].outputs[0]
    together = llm.generate(PROMPTS, params)[0].outputs[0]
    assert (alone.token_ids, alone.logprobs) == (together.token_ids, together.logprobs)


@pytest.mark.cuda
def test_cuda_fp8_sleep_level2_is_restored_by_a_sync(tmp_path: Path) -> None:
    from inference.models.loader import iter_hf_tensors
    from tests.helpers_weight_update import Link

    make_hf_checkpoint("qwen2", tmp_path, initializer_range=0.2, max_position_embeddings=512)
    llm = LLM(tmp_path, device="cuda", dtype="bfloat16", quantization="fp8", kv_cache_bytes=64 << 20)
    link = Link(llm.worker)

    def run() -> list[tuple[list[int], list[float]]]:
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(PROMPTS, GREEDY)]

    before = run()
    llm.sleep(1)
    llm.wake_up()
    assert run() == before
    llm.sleep(2)
    llm.wake_up()
    state = {n: t.to("cuda", torch.bfloat16) for n, t in iter_hf_tensors(tmp_path)}
    assert link.sync(state, 1).report.ok  # quantized on the GPU as each tensor lands, both audits pass
    assert run() == before
