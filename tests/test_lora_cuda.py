"""LoRA served unmerged on a GPU: the captured decode graphs replay the adapter's GEMMs (graph output equals
eager output), a sync written into the adapter in place is seen by the graphs, and the unmerged model's
greedy tokens equal the merged model's in fp32, at TP=1 and at TP=2 over NCCL."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from inference.core import SamplingParams
from tests.helpers_models import random_prompts

pytestmark = pytest.mark.cuda
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from tests.helpers_lora import merged_dir, peft_model
    from tests.helpers_weight_update import tiny_model_dirs

    root = tmp_path_factory.mktemp("lora-cuda")
    base = tiny_model_dirs(root)["target"]
    model = peft_model(base, rank=8)
    model.save_pretrained(str(root / "adapter"))
    return {"base": base, "adapter": root / "adapter", "merged": merged_dir(model, base, root / "merged")}


def run(path: Path, dtype: str, **kw: Any) -> tuple[list, Any]:
    from inference.engine.llm import LLM

    llm = LLM(path, device="cuda", dtype=dtype, kv_cache_bytes=64 << 20, max_num_seqs=16, **kw)
    prompts = random_prompts([3, 17, 9, 30, 64, 5, 12], llm.model_config.vocab_size, seed=1)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, GREEDY)], llm


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graphs_replay_the_adapter(dirs: dict[str, Path], dtype: str) -> None:
    eager, _ = run(dirs["base"], dtype, lora=str(dirs["adapter"]), enforce_eager=True)
    graphs, llm = run(dirs["base"], dtype, lora=str(dirs["adapter"]))
    assert llm.worker.runner.graphs is not None and llm.worker.runner.graphs.graphs
    for a, b in zip(eager, graphs):
        assert a[0] == b[0]
        torch.testing.assert_close(torch.tensor(a[1]), torch.tensor(b[1]), atol=1e-4 if dtype == "float32" else 5e-2,
                                   rtol=0)
    if dtype == "float32":
        merged, _ = run(dirs["merged"], dtype)
        assert [m[0] for m in merged] == [g[0] for g in graphs]


def test_an_adapter_written_in_place_is_seen_by_the_graphs(dirs: dict[str, Path]) -> None:
    """Zeroing the adapter in place (as a sync writes it) gives the base model's outputs through the graphs."""
    from inference.models.lora_adapter import adapter_regions

    base, _ = run(dirs["base"], "float32", enforce_eager=True)
    _, llm = run(dirs["base"], "float32", lora=str(dirs["adapter"]))
    for t in adapter_regions(llm.worker.models["target"]).values():
        t.held.zero_()
    prompts = random_prompts([3, 17, 9, 30, 64, 5, 12], llm.model_config.vocab_size, seed=1)
    again = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert again == [b[0] for b in base]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tp2_over_nccl_with_graphs_serves_the_merged_models_tokens(dirs: dict[str, Path]) -> None:
    """The row-parallel layers' adapter terms ride the base's NCCL all-reduce, inside the captured graphs."""
    from sidecar.client import SidecarClient
    from tests.helpers_sidecar import launch

    merged, llm = run(dirs["merged"], "float32")
    prompts = random_prompts([3, 17, 9, 30, 64, 5, 12], llm.model_config.vocab_size, seed=1)  # run()'s prompts
    del llm
    server = launch("--model", str(dirs["base"]), "--lora", str(dirs["adapter"]), "--device", "cuda", "--tp", "2",
                    "--dtype", "float32")
    try:
        with SidecarClient(server.url, timeout=120) as c:
            got = [o.outputs[0].token_ids for o in c.generate(prompts, GREEDY)]
    finally:
        assert server.stop() == 0, server.log
    assert got == [m[0] for m in merged]
