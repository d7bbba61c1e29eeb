"""LoRA served unmerged over an FP8 base (`--quantization fp8 --lora DIR`): the adapter is held in the model
dtype, never FP8; the base product runs as the FP8 linear does and the adapter's term is added as over a bf16
base. Greedy tokens and logprobs equal an engine loaded with the FP8-dequantized base plus the same adapter
(bitwise on CPU: the FP8 path there IS dequantize-then-F.linear), in the batch-invariant mode a prompt's bits do
not depend on its batch, TP=2 over gloo serves TP=1's tokens, a draft serves its own adapter over its own
quantization, adapter-only syncs (full or delta) into an FP8 rank and an FP8 `sidecar launch` are audited (a
flipped adapter byte names tensor and rank) and a level-2 sleep's base is quantized again on receive. On CUDA
(`cuda`): captured graphs equal eager, and the invariant mode holds. Tiny fp32 Qwen2 (tied, qkv bias) target,
Llama draft."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from checksum import ChecksumMismatch
from inference.core import InvalidRequestError, SamplingParams
from inference.parallel import TPInfo
from tests.helpers_lora import TARGETS, peft_model
from tests.helpers_tp import free_port, gloo_tp
from tests.helpers_weight_update import DIMS, RANK, Link
from tests.test_fp8_engine import dequantized_copy

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [20, 21, 22, 23]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
TP = 2


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny target and draft, an adapter of each, and the target's base as an FP8 rank computes with it."""
    from tests.helpers_weight_update import tiny_model_dirs

    root = tmp_path_factory.mktemp("lora-fp8")
    out = tiny_model_dirs(root)
    peft_model(out["target"]).save_pretrained(str(root / "adapter"))
    peft_model(out["draft"], rank=2).save_pretrained(str(root / "draft-adapter"))
    return {**out, "root": root, "adapter": root / "adapter", "draft_adapter": root / "draft-adapter",
            "dequantized": dequantized_copy(out["target"], root / "dequantized")}


def _llm(model_dir: Path, dtype: str = "float32", **options: Any) -> Any:
    from inference.engine.llm import LLM

    return LLM(str(model_dir), device="cpu", dtype=dtype, block_size=4, kv_cache_bytes=4 << 20, **options)


def _greedy(llm: Any, prompts: list[list[int]] = PROMPTS) -> list[tuple[list[int], list[float]]]:
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, GREEDY)]


def _slots(model: torch.nn.Module) -> list[Any]:
    from inference.layers.lora import LoRASlot

    return [m for m in model.modules() if isinstance(m, LoRASlot)]


def _adapted(base: Path, adapter: Path, dtype: torch.dtype, quantization: str, tp: TPInfo | None = None) -> Any:
    from inference.models.build import build_model
    from inference.models.hf_config import read_model_config
    from inference.models.loader import load_weights
    from inference.models.lora_adapter import attach_adapter, load_adapter, read_adapter

    config = read_model_config(base)
    model = build_model(config, tp or TPInfo(), dtype, "cpu", quantization=quantization)
    load_weights(model, base)
    attach_adapter(model, config, read_adapter(adapter))
    load_adapter(model, adapter)
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_adapter_over_an_fp8_base_is_held_and_computed_in_the_model_dtype(dirs: dict[str, Path],
                                                                              dtype: torch.dtype) -> None:
    """Every adapted layer of an FP8 model holds its adapter in the model dtype and gives, for the same input,
    the bits of the same layer over the dequantized base weights with the same adapter."""
    fp8 = _adapted(dirs["target"], dirs["adapter"], dtype, "fp8")
    plain = _adapted(dirs["dequantized"], dirs["adapter"], dtype, "none")
    slots = _slots(fp8)
    assert len(slots) == 4 * DIMS["num_layers"]  # qkv (q, v), o, gate_up (gate), down
    assert all(b.dtype == dtype for s in slots for b in s.buffers())
    g = torch.Generator().manual_seed(0)
    for name, layer in fp8.named_modules():
        if getattr(layer, "lora", None) is None:
            continue
        assert layer.weight.dtype == torch.float8_e4m3fn and layer.compute_dtype == dtype, name
        x = torch.randn(5, layer.weight.shape[1], generator=g).to(dtype)
        with torch.no_grad():
            got, want = layer(x), plain.get_submodule(name)(x)
            assert got.dtype == dtype and torch.equal(got, want), name
            assert not torch.equal(got, layer.product(x, layer.bias, False)), name  # the adapter adds something


def test_tp2_fp8_layer_terms_sum_to_the_tp1_layer(dirs: dict[str, Path]) -> None:
    """Each rank's FP8 slices and adapter slices, without processes: the column-parallel outputs are TP=1's
    columns; the row-parallel partials (FP8 base and adapter, before the one all-reduce) sum to TP=1's."""
    one = _adapted(dirs["target"], dirs["adapter"], torch.float32, "fp8")
    shards = [_adapted(dirs["target"], dirs["adapter"], torch.float32, "fp8", TPInfo(r, TP, group=object()))
              for r in range(TP)]
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    h = torch.randn(5, 96, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        qkv = "model.layers.0.self_attn.qkv_proj"
        want = one.get_submodule(qkv)(x).split([64, 32, 32], dim=-1)
        got = [s.get_submodule(qkv)(x).split([32, 16, 16], dim=-1) for s in shards]
        for i, part in enumerate(want):
            torch.testing.assert_close(torch.cat([g[i] for g in got], dim=-1), part, atol=1e-5, rtol=0)
        down = "model.layers.1.mlp.down_proj"
        total = sum(layer.lora(hr, layer.product(hr, None, False))
                    for layer, hr in zip((s.get_submodule(down) for s in shards), h.chunk(TP, dim=-1)))
        torch.testing.assert_close(total, one.get_submodule(down)(h), atol=1e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp8_engine_with_adapter_equals_the_dequantized_base_with_it(dirs: dict[str, Path], dtype: str) -> None:
    served = _greedy(_llm(dirs["target"], dtype, quantization="fp8", lora=str(dirs["adapter"])))
    assert served == _greedy(_llm(dirs["dequantized"], dtype, lora=str(dirs["adapter"])))
    # the adapter changes the outputs: the comparison can fail
    assert [t for t, _ in served] != [t for t, _ in _greedy(_llm(dirs["target"], dtype, quantization="fp8"))]


@pytest.mark.slow
def test_fp8_with_adapter_stays_batch_invariant(dirs: dict[str, Path]) -> None:
    llm = _llm(dirs["target"], quantization="fp8", lora=str(dirs["adapter"]), batch_invariant=True)
    together = _greedy(llm)
    assert [_greedy(llm, [p])[0] for p in PROMPTS] == together
    # fp32 on CPU: the invariant GEMM's tokens are the plain mode's
    assert [t for t, _ in together] == [t for t, _ in _greedy(_llm(dirs["dequantized"], lora=str(dirs["adapter"])))]


def _fp8_worker(dirs: dict[str, Path], dtype: str = "float32") -> Any:
    from inference.config import EngineConfig
    from inference.engine.worker import Worker

    worker = Worker(EngineConfig(model=str(dirs["target"]), device="cpu", dtype=dtype, quantization="fp8",
                                 lora=str(dirs["adapter"])))
    worker.init_device()
    worker.load_model()
    return worker


def test_adapter_only_sync_into_an_fp8_rank_is_audited_and_a_flipped_byte_names_it(dirs: dict[str, Path]) -> None:
    """The adapter lands in the model dtype and is audited on its received digests (no FP8 install: the base is
    untouched); a flipped adapter byte fails naming tensor and rank and tears the model; the base sent beside
    the adapter is quantized on receive and both audits pass."""
    from inference.models.loader import iter_hf_tensors
    from inference.models.lora_adapter import adapter_regions
    from inference.quant.fp8 import quantize_rows
    from tests.helpers_fault import flipped_on_arrival
    from tests.helpers_weight_update import Q1
    from trainer_hooks.sources import peft_adapter_weights

    worker = _fp8_worker(dirs)
    model = worker.models["target"]
    qkv = model.model.layers[1].self_attn.qkv_proj
    base_q = qkv.weight.detach().clone()
    link = Link(worker)
    with torch.no_grad():
        named = {n: t + 0.01 for n, t in peft_adapter_weights(peft_model(dirs["target"]))}
    assert len(named) == 2 * len(TARGETS) * DIMS["num_layers"]
    assert link.sync(named, 1).report.ok
    held = adapter_regions(model)
    assert all(torch.equal(held[n].held, t) for n, t in named.items())
    assert torch.equal(qkv.weight.view(torch.uint8), base_q.view(torch.uint8))  # an adapter sync leaves the base

    bad = "model.layers.1.mlp.down_proj.lora_B.weight"
    with flipped_on_arrival(bad), pytest.raises(ChecksumMismatch) as e:
        link.sync(named, 2)
    first = e.value.report.first_tensor
    assert (first.tensor, first.rank) == (bad, RANK) and bad in str(e.value) and RANK in str(e.value)
    with pytest.raises(InvalidRequestError, match="base weights are not intact"):
        link.sync(named, 3)
    base = dict(iter_hf_tensors(dirs["target"]))
    assert link.sync({**base, **named}, 3).report.ok
    q, scale = quantize_rows(base[Q1], Q1)
    held_q, held_scale = qkv.installed_region("q")
    assert torch.equal(held_q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(held_scale, scale)


def test_a_delta_session_moves_adapter_deltas_and_full_fp8_bases(dirs: dict[str, Path]) -> None:
    """The adapter is held whole in the sent dtype, so an adapter-only sync after the first moves a delta;
    an FP8 base has no region a delta applies into (it is quantized on receive), so a sync with it is full."""
    from inference.models.loader import iter_hf_tensors
    from inference.models.lora_adapter import adapter_regions
    from trainer_hooks.sources import peft_adapter_weights

    worker = _fp8_worker(dirs)
    link = Link(worker, delta=True)
    named = dict(peft_adapter_weights(peft_model(dirs["target"])))
    modes = []
    for version in (1, 2):
        with torch.no_grad():
            named = {n: t + 0.01 * version for n, t in named.items()}
        assert link.sync(named, version).report.ok
        modes.append(link.sender.last_sync["mode"])
    assert link.sync({**dict(iter_hf_tensors(dirs["target"])), **named}, 3).report.ok
    assert [*modes, link.sender.last_sync["mode"]] == ["full", "delta", "full"]
    held = adapter_regions(worker.models["target"])
    assert all(torch.equal(held[n].held, t) for n, t in named.items())


def test_a_bf16_fp8_rank_takes_its_adapter_in_bf16(dirs: dict[str, Path]) -> None:
    """The adapter's dtype on the wire is the model's (bf16), not the FP8 weights': a bf16 adapter is held
    as sent and audited from where it is held; an fp32 one is refused naming bfloat16 unless cast."""
    from trainer_hooks.sources import peft_adapter_weights

    worker = _fp8_worker(dirs, "bfloat16")
    link = Link(worker)
    named = dict(peft_adapter_weights(peft_model(dirs["target"])))
    with pytest.raises(InvalidRequestError, match="the target model's adapter bfloat16"):
        link.sync(named, 1)
    assert link.sync({n: t.bfloat16() for n, t in named.items()}, 1).report.ok
    assert link.sync(named, 2, allow_cast=True).report.ok  # digested as sent (fp32), held in bf16


@pytest.mark.slow
def test_fp8_sleep_levels_keep_the_adapter_and_level_2_requantizes_the_base(dirs: dict[str, Path]) -> None:
    from inference.models.loader import iter_hf_tensors
    from trainer_hooks.sources import peft_adapter_weights

    llm = _llm(dirs["target"], quantization="fp8", lora=str(dirs["adapter"]))
    before = _greedy(llm)
    llm.sleep(1)
    llm.wake_up()
    assert _greedy(llm) == before
    llm.sleep(2)
    llm.wake_up()
    link = Link(llm.worker)
    with pytest.raises(InvalidRequestError, match="base weights are not intact"):
        link.sync(dict(peft_adapter_weights(peft_model(dirs["target"]))), 1)
    assert link.sync(dict(iter_hf_tensors(dirs["target"])), 1).report.ok  # quantized as it lands, both audits
    assert _greedy(llm) == before


@pytest.mark.slow
@pytest.mark.parametrize("draft_quantization", ["none", "fp8"])
def test_the_draft_serves_its_own_adapter_over_its_own_quantization(dirs: dict[str, Path],
                                                                     draft_quantization: str) -> None:
    """An FP8 target with its adapter and a draft with its own (bf16-side or FP8 base): speculation keeps the
    target's greedy tokens, and an adapter-only draft sync changes the acceptance, never the tokens."""
    from trainer_hooks.sources import peft_adapter_weights

    want = _greedy(_llm(dirs["target"], quantization="fp8", lora=str(dirs["adapter"])))
    llm = _llm(dirs["target"], quantization="fp8", lora=str(dirs["adapter"]), draft_model=str(dirs["draft"]),
               draft_lora=str(dirs["draft_adapter"]), draft_quantization=draft_quantization,
               num_speculative_tokens=3)
    draft = llm.worker.models["draft"]
    down = draft.model.layers[0].mlp.down_proj
    assert down.weight.dtype == (torch.float8_e4m3fn if draft_quantization == "fp8" else torch.float32)
    assert all(b.dtype == torch.float32 for s in _slots(draft) for b in s.buffers())
    assert [t for t, _ in _greedy(llm)] == [t for t, _ in want] and llm.spec_stats.proposed > 0
    with torch.no_grad():
        named = {n: t + 0.5 for n, t in peft_adapter_weights(peft_model(dirs["draft"], rank=2))}
    assert Link(llm.worker).sync(named, 1, which="draft").report.ok
    assert torch.equal(down.lora.b(0), named["model.layers.0.mlp.down_proj.lora_B.weight"])
    assert [t for t, _ in _greedy(llm)] == [t for t, _ in want]


def _rank(rank: int, port: int, root: str) -> None:
    from inference.engine.llm import LLM

    with gloo_tp(rank, TP, port) as tp:
        kw = dict(device="cpu", dtype="float32", tp=tp, quantization="fp8", lora=str(Path(root) / "adapter"),
                  block_size=4, kv_cache_bytes=4 << 20)
        base = str(Path(root) / "target")
        out: dict[str, Any] = {"plain": _greedy(LLM(base, **kw))}
        llm = LLM(base, batch_invariant=True, **kw)
        out["together"] = _greedy(llm)
        out["alone"] = [_greedy(llm, [p])[0] for p in PROMPTS]
        torch.save(out, Path(root) / f"lora-fp8.rank{rank}.pt")


@pytest.mark.slow
def test_tp2_fp8_engine_with_adapter_serves_tp1s_tokens(dirs: dict[str, Path]) -> None:
    """Each rank quantizes the full rows and holds its slices, the adapter sharded as W; fp32 on CPU: only the
    reduction order differs from TP=1, and the invariant mode keeps a prompt's bits alone and in a batch."""
    want = [t for t, _ in _greedy(_llm(dirs["target"], quantization="fp8", lora=str(dirs["adapter"])))]
    mp.spawn(_rank, args=(free_port(), str(dirs["root"])), nprocs=TP, join=True)
    for rank in range(TP):
        got = torch.load(dirs["root"] / f"lora-fp8.rank{rank}.pt")
        assert [t for t, _ in got["plain"]] == want, f"rank {rank}"
        assert got["alone"] == got["together"], f"rank {rank}: the invariant mode depends on the batch"
        assert [t for t, _ in got["together"]] == want, f"rank {rank}"


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_adapter_only_sync_into_an_fp8_sidecar_launch(dirs: dict[str, Path], tmp_path: Path, tp: int) -> None:
    """`sidecar launch --quantization fp8 --lora DIR` starts (nothing refused); the first sync flips a byte of
    an adapter tensor on one rank: the audit names the tensor and the rank, and the base comes with the next
    sync (quantized on receive); a PEFT model trained a step syncs adapter-only, another step after a level-2
    sleep sends the base again; the rollouts are what an fp32 engine on the dequantized base with the
    trained adapter predicts."""
    from tests.helpers_fault import flip_env
    from tests.helpers_sidecar import launch
    from trainer_hooks import AuditError, SidecarClient, WeightSyncHook

    model = peft_model(dirs["target"])
    bad, bad_rank = "model.layers.0.self_attn.q_proj.lora_B.weight", f"dp0:pp0:tp{tp - 1}"
    server = launch("--model", str(dirs["target"]), "--lora", str(dirs["adapter"]), "--dtype", "float32",
                    "--quantization", "fp8", "--tp", str(tp), env=flip_env(bad, rank=bad_rank, times=1))
    try:
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        batch = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10]])
        with SidecarClient(server.url, timeout=120) as client, \
                WeightSyncHook(client, model, adapter_only=True, log_path=server.log_path) as hook:
            before = [o.outputs[0].token_ids for o in client.generate(PROMPTS, GREEDY)]
            with_base: list[bool] = []  # per sync: whether the base went with the adapter
            real_sync = client.sync_weights

            def recording(sender: Any, named: Any, version: int, **kw: Any) -> Any:
                named = list(named)
                with_base.append(any(".lora_" not in name for name, _ in named))
                return real_sync(sender, named, version, **kw)

            client.sync_weights = recording  # type: ignore[method-assign]
            with pytest.raises(AuditError) as failed:
                hook.sync()
            assert f"'{bad}' on rank {bad_rank}" in str(failed.value), failed.value
            assert all(r["torn"]["target"] for r in client.state()["ranks"])
            hook.sync()  # the base beside the adapter: each rank quantizes it as it lands
            assert hook.stats["audit"] == "ok"
            for level in (1, 2):
                hook.sleep_level = level
                with hook.training():
                    model.train()
                    model(input_ids=batch, labels=batch).loss.backward()
                    optimizer.step()
                    optimizer.zero_grad()
                    model.eval()
                    hook.after_optimizer_step()
                assert hook.stats["audit"] == "ok"
                hook.wake()  # as rollouts() does: the next step's sleep is a real one, at its level
            assert with_base == [False, True, False, True]  # flipped, torn + base, level 1, level 2 + base
            out = hook.rollouts(PROMPTS, GREEDY)
            served = [o.outputs[0].token_ids for o in out]
            assert all(o.weight_version == hook.version for o in out)
    finally:
        assert server.stop() == 0, server.log
    model.save_pretrained(str(tmp_path / "trained"))
    predicted = [t for t, _ in _greedy(_llm(dirs["dequantized"], lora=str(tmp_path / "trained")))]
    assert served == predicted
    assert predicted != before  # the trained adapter changed what the sidecar serves


# ---- on the GPU (the lead runs these: pytest -m cuda tests/test_lora_fp8.py) --------------------------------

@pytest.mark.cuda
def test_cuda_fp8_with_adapter_graphs_equal_eager(dirs: dict[str, Path]) -> None:
    """12 prompts: the decode steps cross the FP8 GEMV's rows (at most 8) into _scaled_mm, with the adapter's
    bf16 GEMMs captured in the same graphs (tokens equal, logprobs within bf16 rounding: a padded graph batch
    may pick other GEMM tiles); the graphs read the adapter where a sync writes it: zeroed in place, they give
    what eager gives with it zeroed, which is not what the adapter gave."""
    from inference.engine.llm import LLM
    from inference.models.hf_config import read_model_config
    from inference.models.lora_adapter import adapter_regions
    from tests.helpers_models import random_prompts

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    prompts = random_prompts([3 + 2 * i for i in range(12)], read_model_config(dirs["target"]).vocab_size, seed=1)
    kw = dict(device="cuda", dtype="bfloat16", quantization="fp8", lora=str(dirs["adapter"]),
              kv_cache_bytes=64 << 20, max_num_seqs=16)
    llms = [LLM(str(dirs["target"]), enforce_eager=eager, **kw) for eager in (True, False)]
    assert llms[1].worker.runner.graphs is not None and llms[1].worker.runner.graphs.graphs
    assert llms[1].worker.models["target"].model.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    assert all(b.dtype == torch.bfloat16 for s in _slots(llms[1].worker.models["target"]) for b in s.buffers())

    def same(eager: list, graphs: list) -> None:
        assert [t for t, _ in eager] == [t for t, _ in graphs]
        for (_, a), (_, b) in zip(eager, graphs):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=5e-2, rtol=0)

    adapted = [_greedy(llm, prompts) for llm in llms]
    same(*adapted)
    for llm in llms:
        for t in adapter_regions(llm.worker.models["target"]).values():
            t.held.zero_()
    zeroed = [_greedy(llm, prompts) for llm in llms]
    same(*zeroed)
    assert [t for t, _ in zeroed[0]] != [t for t, _ in adapted[0]]


@pytest.mark.cuda
def test_cuda_fp8_with_adapter_batch_invariant(dirs: dict[str, Path]) -> None:
    from inference.engine.llm import LLM

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    llm = LLM(str(dirs["target"]), device="cuda", dtype="bfloat16", quantization="fp8", lora=str(dirs["adapter"]),
              batch_invariant=True, kv_cache_bytes=64 << 20)
    together = _greedy(llm)
    assert [_greedy(llm, [p])[0] for p in PROMPTS] == together
