"""LoRA served unmerged under tensor parallelism (TP=2 over gloo on CPU): each rank holds its slices of the
adapter as of the base weights; a TP=2 engine's greedy tokens equal TP=1's with the adapter and the merged
model's (fp32), and the batch-invariant mode keeps a prompt's tokens alone and in a batch; an adapter-only
sync into a TP=2 `sidecar launch` changes the outputs as the merged model predicts, and a flipped adapter
byte fails the audit naming the tensor and the rank. Tiny fp32 Qwen2 (tied, qkv bias)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from inference.core import SamplingParams
from inference.parallel import TPInfo
from tests.helpers_lora import merged_dir, peft_model
from tests.helpers_tp import free_port, gloo_tp

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

TP = 2
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [20, 21, 22, 23]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from tests.helpers_weight_update import tiny_model_dirs

    root = tmp_path_factory.mktemp("lora-tp")
    base = tiny_model_dirs(root)["target"]
    model = peft_model(base)
    model.save_pretrained(str(root / "adapter"))
    return {"base": base, "adapter": root / "adapter", "merged": merged_dir(model, base, root / "merged"),
            "root": root}


def _model(base: Path, adapter: Path, tp: TPInfo) -> torch.nn.Module:
    from inference.models.hf_config import read_model_config
    from inference.models.lora_adapter import attach_adapter, load_adapter, read_adapter
    from tests.helpers_models import load_ours

    model = load_ours(base, tp=tp)
    attach_adapter(model, read_model_config(base), read_adapter(adapter))
    load_adapter(model, adapter)
    return model


def test_each_rank_holds_its_slices_of_the_adapter(dirs: dict[str, Path]) -> None:
    """Column-parallel layers (fused qkv with k unadapted, gate_up with up unadapted): A whole, each part's B
    by that part's rows; row-parallel layers (o_proj, down_proj): A by input columns, B whole."""
    from safetensors.torch import load_file

    from inference.models.lora_adapter import WEIGHTS_FILE, adapter_regions
    from inference.models.naming import peft_to_hf

    full = {peft_to_hf(k): t for k, t in load_file(str(dirs["adapter"] / WEIGHTS_FILE)).items()}
    ranks = [adapter_regions(_model(dirs["base"], dirs["adapter"], TPInfo(r, TP, group=object()))) for r in range(TP)]
    assert all(held.keys() == full.keys() for held in ranks)
    for name, tensor in full.items():
        row = ".o_proj." in name or ".down_proj." in name
        dim = (1 if row else None) if ".lora_A." in name else (None if row else 0)
        assert all(held[name].dim == dim and held[name].full_shape == tuple(tensor.shape) for held in ranks), name
        pieces = [held[name].held for held in ranks]
        if dim is None:
            assert all(torch.equal(p, tensor) for p in pieces), name
        else:
            assert all(p.shape[dim] == tensor.shape[dim] // TP for p in pieces), name
            assert torch.equal(torch.cat(pieces, dim), tensor), name


def test_tp2_layer_terms_sum_to_the_tp1_layer(dirs: dict[str, Path]) -> None:
    """The math without processes: each rank's column-parallel output is its columns of TP=1's, and the
    row-parallel partials (base and adapter, before the one all-reduce) sum to TP=1's output."""
    one = _model(dirs["base"], dirs["adapter"], TPInfo())
    shards = [_model(dirs["base"], dirs["adapter"], TPInfo(r, TP, group=object())) for r in range(TP)]
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    h = torch.randn(5, 96, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for path, sizes in (("model.layers.0.self_attn.qkv_proj", [64, 32, 32]), ("model.layers.1.mlp.gate_up_proj",
                                                                                   [96, 96])):
            want = one.get_submodule(path)(x).split(sizes, dim=-1)
            got = [shard.get_submodule(path)(x).split([n // TP for n in sizes], dim=-1) for shard in shards]
            for i, part in enumerate(want):
                torch.testing.assert_close(torch.cat([g[i] for g in got], dim=-1), part, atol=1e-5, rtol=0)
        down = "model.layers.1.mlp.down_proj"
        total = sum(layer.lora(hr, layer.product(hr, None, False))
                    for layer, hr in zip((s.get_submodule(down) for s in shards), h.chunk(TP, dim=-1)))
        torch.testing.assert_close(total, one.get_submodule(down)(h), atol=1e-5, rtol=0)
        assert not torch.allclose(one.get_submodule(down)(h), one.get_submodule(down).product(h, None, False))


def _greedy(base: Path, tp: TPInfo | None = None, **options: Any) -> list[list[int]]:
    from inference.engine.llm import LLM

    llm = LLM(str(base), device="cpu", dtype="float32", tp=tp, **options)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def _rank(rank: int, port: int, root: str) -> None:
    from inference.engine.llm import LLM

    with gloo_tp(rank, TP, port) as tp:
        base, adapter = Path(root) / "target", str(Path(root) / "adapter")
        out: dict[str, Any] = {"plain": _greedy(base, tp, lora=adapter)}
        llm = LLM(str(base), device="cpu", dtype="float32", tp=tp, lora=adapter, batch_invariant=True)
        out["together"] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
        out["alone"] = [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in PROMPTS]
        torch.save(out, Path(root) / f"lora.rank{rank}.pt")


@pytest.mark.slow
def test_tp2_engine_with_adapter_equals_tp1_and_the_merged_model(dirs: dict[str, Path]) -> None:
    served = _greedy(dirs["base"], lora=str(dirs["adapter"]))
    assert served == _greedy(dirs["merged"])
    assert served != _greedy(dirs["base"])  # the adapter changes the outputs: the test can fail
    mp.spawn(_rank, args=(free_port(), str(dirs["root"])), nprocs=TP, join=True)
    for rank in range(TP):
        got = torch.load(dirs["root"] / f"lora.rank{rank}.pt")
        assert got["plain"] == served, f"rank {rank}"
        assert got["alone"] == got["together"], f"rank {rank}: the invariant mode depends on the batch"
        assert got["together"] == served, f"rank {rank}"  # fp32: the invariant mode's tokens too


@pytest.mark.slow
def test_adapter_only_sync_into_a_tp2_sidecar(dirs: dict[str, Path], tmp_path: Path) -> None:
    """The first sync flips a byte of a row-sharded B on rank tp1 alone: the audit fails naming the tensor
    and that rank, and no rank goes live; the hook's next sync carries the base beside the adapter; then a
    PEFT model trained a step syncs adapter-only and serves what the merged model predicts."""
    from tests.helpers_fault import flip_env
    from tests.helpers_sidecar import launch
    from trainer_hooks import AuditError, SidecarClient, WeightSyncHook

    model = peft_model(dirs["base"])
    bad, bad_rank = "model.layers.0.self_attn.q_proj.lora_B.weight", "dp0:pp0:tp1"
    server = launch("--model", str(dirs["base"]), "--lora", str(dirs["adapter"]), "--dtype", "float32",
                    "--tp", str(TP), env=flip_env(bad, rank=bad_rank, times=1))
    try:
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        batch = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10]])
        with SidecarClient(server.url, timeout=120) as client, \
                WeightSyncHook(client, model, adapter_only=True, log_path=server.log_path) as hook:
            with pytest.raises(AuditError) as failed:
                hook.sync()
            assert f"'{bad}' on rank {bad_rank}" in str(failed.value), failed.value
            assert "on rank dp0:pp0:tp0" not in str(failed.value), failed.value  # rank tp0's copy passed
            assert all(r["torn"]["target"] for r in client.state()["ranks"])
            hook.sync()  # the base comes with the adapter: the torn ranks take no adapter-only sync
            assert hook.stats["audit"] == "ok"
            with hook.training():
                model.train()
                model(input_ids=batch, labels=batch).loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                model.eval()
                hook.after_optimizer_step()
            assert hook.stats["audit"] == "ok"
            out = hook.rollouts(PROMPTS, GREEDY)
            served = [o.outputs[0].token_ids for o in out]
            assert all(o.weight_version == hook.version for o in out)
        expected = _greedy(merged_dir(model, dirs["base"], tmp_path / "merged"))
        assert served == expected
        assert expected != _greedy(dirs["merged"])  # the step changed what the adapter predicts
    finally:
        assert server.stop() == 0, server.log
