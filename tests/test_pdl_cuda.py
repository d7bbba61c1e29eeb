"""On the GPU: programmatic dependent launch changes scheduling, never results. The same bf16 model
gives the same greedy tokens and logprobs, bit for bit, with PDL on and off (SIDECAR_PDL, read at each
launch), eagerly and from CUDA graphs (a kernel reading before its wait would show up here as a
difference or a hang)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from inference.core import SamplingParams
from inference.engine.llm import LLM
from inference.layers import pdl
from tests.helpers_models import make_hf_checkpoint, random_prompts

pytestmark = pytest.mark.cuda

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("pdl")
    make_hf_checkpoint("qwen2", path, initializer_range=0.2, max_position_embeddings=512)
    return path


def generate(path: Path, on: bool, monkeypatch: pytest.MonkeyPatch, **kw: object) -> list:
    monkeypatch.setenv("SIDECAR_PDL", "1" if on else "0")
    llm = LLM(path, device="cuda", dtype="bfloat16", kv_cache_bytes=64 << 20, max_num_seqs=8, **kw)
    prompts = random_prompts([1, 7, 30, 12], llm.model_config.vocab_size, seed=3)
    outs = [llm.generate([p], GREEDY)[0] for p in prompts[:2]]  # batch 1: the GEMV path
    outs += llm.generate(prompts, GREEDY)
    torch.cuda.synchronize()
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="PDL needs sm_90 or newer")
@pytest.mark.parametrize("eager", [True, False])
def test_pdl_does_not_change_results(model_dir: Path, eager: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    off = generate(model_dir, False, monkeypatch, enforce_eager=eager)
    on = generate(model_dir, True, monkeypatch, enforce_eager=eager)
    assert pdl.use_pdl(torch.empty(1, device="cuda"))  # the last run's setting: on
    for a, b in zip(off, on):
        assert a[0] == b[0]
        assert a[1] == b[1]
