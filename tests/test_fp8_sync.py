"""Weight syncs into an FP8 rank: each tensor quantized by the rule as it lands; the audit checks the
received bytes AND the installed FP8 values and scales, naming tensor and rank; greedy output after a
sync equals an engine loaded from the same weights quantized offline. The sender's expected installed
digests: each TP rank's share, cut by the rule every TP rank's layers install by, and laid out in the
sync's section so that every rank of every TP size finds its own."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from checksum import ChecksumMismatch, digest_tensors
from inference.config import EngineConfig
from inference.core import InvalidRequestError, SamplingParams
from inference.engine.llm import LLM
from inference.engine.worker import Worker
from inference.quant.fp8 import quantize_rows
from inference.quant.installed import installed_items, installed_records
from tests.helpers_fault import flip_held_after_landing, flipped_on_arrival
from tests.helpers_weight_update import Q1, RANK, Link, perturbed, tiny_model_dirs

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPTS = [[5, 17, 33, 2, 9], [100, 3], list(range(40, 60))]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return tiny_model_dirs(tmp_path_factory.mktemp("fp8_models"))


def fp8_worker(dirs: dict[str, Path]) -> Worker:
    worker = Worker(EngineConfig(model=str(dirs["target"]), draft_model=str(dirs["draft"]), device="cpu",
                                 dtype="float32", quantization="fp8"))
    worker.init_device()
    worker.load_model()
    return worker


def test_installed_bytes_are_the_rule_of_the_received_tensor(dirs: dict[str, Path]) -> None:
    worker = fp8_worker(dirs)
    link = Link(worker)
    state = perturbed(dirs["target"], 70)
    result = link.sync(state, 1)
    assert result.report.ok and worker.weights.versions["target"] == 1
    qkv = worker.models["target"].model.layers[1].self_attn.qkv_proj
    held_q, held_scale = qkv.installed_region("q")
    q, scale = quantize_rows(state[Q1], Q1)
    assert torch.equal(held_q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(held_scale, scale)
    # what the trainer computes with the rule module alone is what the rank holds (TP=1)
    expected = installed_records([(Q1, state[Q1])])
    assert expected == digest_tensors(installed_items(Q1, held_q, held_scale))
    # the draft is FP8 too (draft_quantization follows quantization) and syncs the same way
    draft_state = perturbed(dirs["draft"], 71)
    assert link.sync(draft_state, 1, which="draft").report.ok
    assert worker.models["draft"].model.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn


@pytest.mark.parametrize("where", ["weight", "scale"])
def test_a_flipped_installed_byte_fails_the_audit_naming_tensor_and_rank(
        dirs: dict[str, Path], where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    worker = fp8_worker(dirs)
    link = Link(worker)
    qkv = worker.models["target"].model.layers[1].self_attn.qkv_proj
    flip_held_after_landing(monkeypatch, worker.weights, qkv.weight if where == "weight" else qkv.weight_scale)
    with pytest.raises(ChecksumMismatch) as err:
        link.sync(perturbed(dirs["target"], 72), 1)
    first = err.value.report.first_tensor
    suffix = ":fp8" if where == "weight" else ":scale"
    assert (first.kind, first.tensor, first.rank) == ("digest", Q1 + suffix, RANK)
    assert Q1 + suffix in str(err.value) and RANK in str(err.value)
    assert worker.weights.torn["target"] and worker.weights.versions["target"] == 0
    monkeypatch.undo()
    assert link.sync(perturbed(dirs["target"], 73), 2).report.ok  # a good sync heals it


def test_a_flipped_received_byte_still_fails_on_the_received_digest(dirs: dict[str, Path]) -> None:
    worker = fp8_worker(dirs)
    link = Link(worker)
    with flipped_on_arrival(Q1), pytest.raises(ChecksumMismatch) as err:
        link.sync(perturbed(dirs["target"], 74), 1)
    first = err.value.report.first_tensor
    assert (first.kind, first.tensor, first.rank) == ("digest", Q1, RANK)


def test_a_non_finite_synced_tensor_is_refused_naming_tensor_and_rank(dirs: dict[str, Path]) -> None:
    worker = fp8_worker(dirs)
    link = Link(worker)
    state = perturbed(dirs["target"], 75)
    state[Q1][2, 3] = float("inf")
    with pytest.raises(InvalidRequestError) as err:
        link.sync(state, 1)
    assert err.value.field == Q1 and RANK in str(err.value) and "non-finite" in str(err.value)
    assert worker.weights.torn["target"]


@pytest.mark.slow
def test_sync_then_greedy_equals_the_offline_quantized_engine(dirs: dict[str, Path], tmp_path: Path) -> None:
    from tests.test_fp8_engine import dequantized_copy

    state = perturbed(dirs["target"], 76)
    trained = tmp_path / "trained"
    trained.mkdir()
    for f in dirs["target"].iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            (trained / f.name).write_bytes(f.read_bytes())
    save_file({n: t.contiguous() for n, t in state.items()}, str(trained / "model.safetensors"))
    kw = dict(device="cpu", dtype="float32", block_size=4, kv_cache_bytes=4 << 20)
    synced = LLM(dirs["target"], quantization="fp8", **kw)
    assert Link(synced.worker).sync(state, 1).report.ok
    offline = LLM(dequantized_copy(trained, tmp_path / "deq"), **kw)
    got = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in synced.generate(PROMPTS, GREEDY)]
    want = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in offline.generate(PROMPTS, GREEDY)]
    assert got == want


def test_sleep_levels_keep_or_restore_fp8_weights_and_scales(dirs: dict[str, Path]) -> None:
    """Level 1 keeps the FP8 bytes (to host and back), the scales with them; level 2 drops the weights,
    and a sync of the same bf16 tensors installs the same FP8 bytes and scales: the same tokens."""
    from inference.models.loader import iter_hf_tensors

    llm = LLM(dirs["target"], quantization="fp8", device="cpu", dtype="float32", block_size=4,
              kv_cache_bytes=2 << 20)
    link = Link(llm.worker)
    run = lambda: [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(PROMPTS, GREEDY)]
    before = run()
    llm.sleep(1)
    llm.wake_up()
    assert run() == before
    llm.sleep(2)
    llm.wake_up()
    assert link.sync(dict(iter_hf_tensors(dirs["target"])), 1).report.ok
    assert run() == before


@pytest.mark.parametrize("case", ["llama", "qwen2", "qwen3", "mistral"])
def test_the_trainers_name_rule_selects_exactly_the_engines_fp8_layers(case: str, tmp_path: Path) -> None:
    from inference.models.build import build_model
    from inference.models.hf_config import read_model_config
    from inference.models.naming import expected_hf_tensors, param_to_hf
    from inference.parallel import TPInfo
    from inference.quant.installed import is_fp8_linear
    from inference.weights.installed import fp8_layers
    from tests.helpers_models import make_hf_checkpoint

    make_hf_checkpoint(case, tmp_path)
    config = read_model_config(tmp_path)
    model = build_model(config, TPInfo(), torch.float32, "meta", quantization="fp8")
    engine = {hf for param in fp8_layers(model) for hf, _ in param_to_hf(param, config)}
    assert engine == {name for name in expected_hf_tensors(config) if is_fp8_linear(name)} and engine


@pytest.mark.parametrize("case", ["llama", "qwen2", "qwen3", "mistral"])
def test_the_senders_share_of_each_tp_rank_is_what_that_ranks_layers_install(case: str, tmp_path: Path) -> None:
    """`tp_share` (the sender's expected installed digests, `sidecar audit --checkpoint`) cuts out of the
    rule's whole output exactly what each TP rank's FP8 layers install from the full tensor: the rows of
    q, k, v, gate, up (values and scales), the columns of o and down (their scales whole)."""
    from inference.models.build import build_model
    from inference.models.hf_config import read_model_config
    from inference.models.loader import iter_hf_tensors, load_weights
    from inference.models.naming import hf_to_param
    from inference.parallel import TPInfo
    from inference.quant.installed import is_fp8_linear, tp_share
    from inference.weights.installed import fp8_layers
    from tests.helpers_models import make_hf_checkpoint

    make_hf_checkpoint(case, tmp_path)
    config = read_model_config(tmp_path)
    full = {n: t for n, t in iter_hf_tensors(tmp_path) if is_fp8_linear(n)}
    for rank in range(2):
        model = build_model(config, TPInfo(rank, 2, group=object()), torch.float32, "cpu", quantization="fp8")
        load_weights(model, tmp_path)  # never runs: the placeholder group is never used
        layers = fp8_layers(model)
        for name, w in full.items():
            param, shard_id = hf_to_param(name, config)
            held_q, held_scale = layers[param].installed_region(shard_id)
            q, scale = quantize_rows(w, name)
            assert torch.equal(held_q.view(torch.uint8), tp_share(q, name, "fp8", 2, rank).view(torch.uint8)), name
            assert torch.equal(held_scale, tp_share(scale, name, "scale", 2, rank)), name


def test_the_section_gives_every_rank_of_every_tp_size_its_own_share(dirs: dict[str, Path]) -> None:
    """A group with TP=1 and TP=2 FP8 ranks (a fleet): one section, each rank's entries its own share's
    digests, on send (the payload) as on receive (quantized by the sender)."""
    from checksum import ALGORITHM
    from inference.transfer.fp8_payload import payload_tensors
    from inference.transfer.installed_digests import (
        ExpectedShares,
        SharesLayout,
        fp8_linears,
        rank_expectation,
        receiver_values,
        sender_values,
    )
    from inference.transfer.plan import TensorSpec

    state = perturbed(dirs["target"], 77)
    specs = [TensorSpec.of(n, t) for n, t in state.items()]
    names = fp8_linears(specs)
    asked = [max(v) for v in zip(receiver_values(1), receiver_values(2), receiver_values(None), sender_values(True))]
    layout = SharesLayout.agreed(specs, asked)
    assert layout.sizes == (1, 2) and len(names) == 14 and layout.size == 1 + 16 * 2 * 14 * 3
    assert SharesLayout.agreed(specs, [max(v) for v in zip(receiver_values(2), sender_values(False))]).size == 0
    assert SharesLayout.agreed(specs, [max(v) for v in zip(receiver_values(None), sender_values(True))]).size == 0
    shares = ExpectedShares()
    try:
        for items in (list(state.items()), payload_tensors(list(state.items()))):
            section = shares.start(layout, items, ALGORITHM).result(timeout=60)
            assert len(section) == layout.size
            for tp_size, tp_rank in ((1, 0), (2, 0), (2, 1)):
                want = {r.name: r.digest for r in installed_records(state.items(), ALGORITHM, tp_size, tp_rank)}
                got = rank_expectation(section, layout, tp_size, tp_rank)
                assert got.missing is None and got.digests == want
        assert rank_expectation(section, layout, 4, 3).missing is not None  # nobody asked for TP=4
    finally:
        shares.close()
