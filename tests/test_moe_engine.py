"""An MoE model through the engine on CPU: a dense draft serves an MoE target with the target's greedy
output; the batch-invariant mode gives a prompt's tokens and logprobs the same bits alone and batched with
an exact routing tie in every layer (ties to the lowest expert id), and in Triton's interpreter (the
grouped GEMMs); a level-1 sleep changes no bit. tests/test_batch_invariant_paths.py holds both MoE
families to every invariance case. The GPU twins are in tests/test_moe_cuda.py."""

from __future__ import annotations

import math
import random
import shutil
from array import array
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from inference.core import SamplingParams
from inference.engine.llm import LLM
from inference.layers.kernel_device import interpreted_on_cpu
from inference.models.tiny import make_tiny_model

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
CPU = {"device": "cpu", "dtype": "float32", "kv_cache_bytes": 4 << 20, "block_size": 4}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe-engine")
    return {"moe": make_tiny_model(root / "moe", "qwen3_moe", seed=2, num_layers=2),
            "mixtral": make_tiny_model(root / "mixtral", "mixtral", seed=2, num_layers=2),
            "dense": make_tiny_model(root / "dense", "qwen3", seed=4, num_layers=1)}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(4, 512) for _ in range(n)] for n in (3, 17, 8, 30, 5)]


def run(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], bytes]]:
    """Tokens and logprobs as their float64 bytes: equal only when every bit is."""
    return [(o.outputs[0].token_ids, array("d", o.outputs[0].logprobs).tobytes())
            for o in llm.generate(prompts, GREEDY)]


def test_a_dense_draft_serves_an_moe_target(dirs: dict[str, Path], prompts: list[list[int]]) -> None:
    want = [t for t, _ in run(LLM(dirs["moe"], **CPU), prompts)]
    spec = LLM(dirs["moe"], draft_model=str(dirs["dense"]), num_speculative_tokens=3, **CPU)
    assert [t for t, _ in run(spec, prompts)] == want


def test_level1_sleep_changes_no_bit(dirs: dict[str, Path], prompts: list[list[int]]) -> None:
    llm = LLM(dirs["moe"], **CPU)
    before = run(llm, prompts)
    llm.sleep(1)
    llm.wake_up()
    assert run(llm, prompts) == before


def tied_router(src: Path, dst: Path) -> Path:
    """src with every layer's router tied at the second place for every token (rows 1, 4 and 6 one vector,
    the others zero: tests/test_moe_layer.py's tied_block) and the experts that ties broken by the lowest
    expert id never pick (3, 5, 6, 7) set to NaN."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    for name, t in tensors.items():
        if name.endswith("mlp.gate.weight"):
            row = t[1].clone()
            t.zero_()
            t[[1, 4, 6]] = row
        elif ".experts." in name and int(name.split(".experts.")[1].split(".")[0]) in (3, 5, 6, 7):
            t.fill_(float("nan"))
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_an_exact_routing_tie_in_every_layer_goes_to_the_lowest_experts_bit_for_bit(
        dirs: dict[str, Path], prompts: list[list[int]], tmp_path: Path) -> None:
    llm = LLM(tied_router(dirs["moe"], tmp_path / "tied"), batch_invariant=True, **CPU)
    alone = []
    for p in prompts:
        llm.block_manager.reset_prefix_cache()
        alone += run(llm, [p])
    llm.block_manager.reset_prefix_cache()
    assert run(llm, prompts[::-1]) == alone[::-1]
    logprobs = array("d")
    for _, raw in alone:
        logprobs.frombytes(raw)
    assert all(math.isfinite(v) for v in logprobs)  # no NaN expert was ever taken


def test_in_tritons_interpreter_the_modes_kernels_give_a_prompt_the_same_bits(dirs: dict[str, Path],
                                                                             prompts: list[list[int]]) -> None:
    """The mode's kernels on CPU, fp16 (the interpreter's bf16 dot is wrong): the router and the linears in
    the invariant GEMM, the experts in the grouped GEMMs, norms, SiLU and the sampler's statistics in
    Triton. Three prompts, four tokens: the interpreter runs a step in seconds."""
    short = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2)
    three = prompts[:3]
    with interpreted_on_cpu():
        llm = LLM(dirs["moe"], batch_invariant=True, **{**CPU, "dtype": "float16"})
        alone = []
        for p in three:
            llm.block_manager.reset_prefix_cache()
            alone += [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate([p], short)]
        llm.block_manager.reset_prefix_cache()
        together = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(three[::-1], short)]
    assert together == alone[::-1]
