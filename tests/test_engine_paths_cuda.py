"""On the GPU, the attention paths agree: the reference path (the oracle, exact in fp32),
the Triton kernels eagerly, and the Triton kernels replayed from CUDA graphs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from inference.core import SamplingParams
from inference.engine.llm import LLM
from tests.helpers_models import make_hf_checkpoint, random_prompts

pytestmark = pytest.mark.cuda

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module", params=["qwen2", "mistral"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp(request.param)
    make_hf_checkpoint(request.param, path, initializer_range=0.2, max_position_embeddings=512)
    return path


def run(path: Path, dtype: str, **kw) -> list:
    llm = LLM(path, device="cuda", dtype=dtype, kv_cache_bytes=64 << 20, max_num_seqs=16, **kw)
    prompts = random_prompts([3, 17, 9, 30, 64, 5, 12], llm.model_config.vocab_size, seed=1)
    outs = llm.generate(prompts, GREEDY)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], llm


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_reference_triton_and_graphs_agree(model_dir: Path, dtype: str) -> None:
    ref, _ = run(model_dir, dtype, attention_backend="reference", enforce_eager=True)
    eager, _ = run(model_dir, dtype, attention_backend="triton", enforce_eager=True)
    graphs, llm = run(model_dir, dtype, attention_backend="triton")
    assert llm.worker.runner.graphs is not None and llm.worker.runner.graphs.graphs
    # bf16 random models have near-ties that rounding flips between the fp32 reference attention and
    # the bf16 tensor-core kernels; the kernel-level bf16 comparison lives in test_triton_attention.py
    tol, tol_ref = (1e-4, 1e-4) if dtype == "float32" else (5e-2, None)
    for a, b, c in zip(ref, eager, graphs):
        # the graph path replays the eager Triton kernels: same tokens in every dtype
        assert b[0] == c[0]
        torch.testing.assert_close(torch.tensor(b[1]), torch.tensor(c[1]), atol=tol, rtol=0)
        if dtype == "float32":  # the oracle agrees exactly where rounding cannot flip a near-tie
            assert a[0] == b[0]
            torch.testing.assert_close(torch.tensor(a[1]), torch.tensor(b[1]), atol=tol_ref, rtol=0)


def test_graphs_survive_a_neighbour_freeing_cublas_workspaces(model_dir: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """torch.compile's CUDA graph trees (transformers' static-cache generate, a compiled reward model in the
    same process) free every cuBLAS workspace. Decode graphs at batches past the GEMV rows run cuBLAS
    GEMMs: afterwards they must neither write into memory the allocator has handed out again (the
    fillers) nor into unmapped memory (an illegal address), and they still give the same tokens."""
    a = torch.ones(64, 64, dtype=torch.bfloat16, device="cuda")
    for _ in range(64):  # a GEMM on every stream of torch's pool (32 a priority): none is fresh any more
        with torch.cuda.stream(torch.cuda.Stream()):
            torch.mm(a, a)
    torch.cuda.synchronize()
    llm = LLM(model_dir, device="cuda", dtype="bfloat16", kv_cache_bytes=64 << 20, max_num_seqs=32)
    assert "no stream of our own" not in caplog.text  # the captures ran on streams of their own
    prompts = random_prompts([12] * 32, llm.model_config.vocab_size, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()  # what torch.compile's graph trees do before each recording
    fillers = [torch.full((mib << 18,), 7, dtype=torch.int32, device="cuda") for mib in (1, 4, 8, 32, 64)]
    after = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    torch.cuda.synchronize()
    assert all(bool((f == 7).all()) for f in fillers)
    del fillers
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()  # the freed workspaces go back to the driver
    again = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    torch.cuda.synchronize()
    assert before == after == again


def test_capture_survives_a_dead_engine_collected_meanwhile(model_dir: Path) -> None:
    """An engine that became cyclic garbage (a test's or a notebook's) may be collected at any allocation;
    destroying its graphs while a new engine captures would void the capture (seen on the H200). With
    the collector set to run at every allocation, a new engine still captures and matches the first."""
    import gc

    want, first = run(model_dir, "bfloat16")
    cycle: list = [first]
    cycle.append(cycle)
    del first, cycle
    threshold = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    try:
        got, llm = run(model_dir, "bfloat16")
    finally:
        gc.set_threshold(*threshold)
    assert llm.worker.runner.graphs is not None and llm.worker.runner.graphs.graphs
    assert got == want
