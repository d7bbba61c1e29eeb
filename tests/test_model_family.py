"""A model family is its class: a toy Llama variant whose checkpoint names its modules differently,
declared only as a ModelFamily subclass, is written, parsed, loaded, served, routed and checksummed
through the same code as the shipped families; a wrong declaration fails when the class is defined."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from safetensors.torch import load_file

from checksum import compare, manifest_from_tensors
from inference.config import ModelConfig
from inference.core import InvalidRequestError, SamplingParams
from inference.engine.llm import LLM
from inference.models import ModelFamily, build_model, register_family, unregister_family
from inference.models.hf_config import model_config_from_hf, read_model_config
from inference.models.llama import Llama
from inference.models.loader import load_weights
from inference.models.naming import expected_hf_tensors, hf_to_param, param_to_hf
from inference.models.tiny import make_tiny_model
from inference.parallel import TPInfo

RANK = "dp0:pp0:tp0"


class RenamedLlama(Llama):
    """Llama's math under other checkpoint names (as Meta's original Llama files spell them)."""

    name = "renamed_llama"
    architectures = ("RenamedLlamaForCausalLM",)
    model_type = "renamed_llama"
    hf_modules: ClassVar[Mapping[str, tuple[str, ...]]] = {
        "qkv_proj": ("wq", "wk", "wv"), "gate_up_proj": ("w1", "w3"), "down_proj": ("w2",), "o_proj": ("wo",)}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    """(toy checkpoint, the llama checkpoint drawn from the same seed: the same tensors, other names)."""
    register_family(RenamedLlama)
    try:
        root = tmp_path_factory.mktemp("family")
        yield (make_tiny_model(root / "toy", RenamedLlama.name, seed=5, num_layers=2),
               make_tiny_model(root / "llama", "llama", seed=5, num_layers=2))
    finally:
        unregister_family(RenamedLlama.name)


def _renamed(name: str) -> str:
    for ours, theirs in (("q_proj", "wq"), ("k_proj", "wk"), ("v_proj", "wv"), ("o_proj", "wo"),
                         ("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
        name = name.replace(f".{ours}.", f".{theirs}.")
    return name


def _load(path: Path) -> torch.nn.Module:
    model = build_model(read_model_config(path), TPInfo(), torch.float32, "cpu")
    load_weights(model, path)
    return model


def _held_by_hf_name(model: torch.nn.Module, config: ModelConfig) -> dict[str, torch.Tensor]:
    """Views of the model's parameters under the checkpoint's names (TP=1: fused parts stacked by rows)."""
    expected = expected_hf_tensors(config)
    out = {}
    for name, param in model.named_parameters():
        row = 0
        for hf_name, shard_id in param_to_hf(name, config):
            rows = expected[hf_name][0]
            out[hf_name] = param.detach() if shard_id is None else param.detach().narrow(0, row, rows)
            row += rows
    return out


def test_the_checkpoint_uses_the_family_names(dirs: tuple[Path, Path]) -> None:
    toy, llama = dirs
    toy_tensors, llama_tensors = load_file(str(toy / "model.safetensors")), load_file(str(llama / "model.safetensors"))
    assert "model.layers.1.self_attn.wk.weight" in toy_tensors and "model.layers.1.mlp.w2.weight" in toy_tensors
    assert not any("_proj." in name for name in toy_tensors)
    assert sorted(toy_tensors) == sorted(_renamed(n) for n in llama_tensors)
    for name, tensor in llama_tensors.items():
        assert torch.equal(toy_tensors[_renamed(name)], tensor), name
    config = read_model_config(toy)
    assert config.family == RenamedLlama.name and not config.qkv_bias and not config.qk_norm


def test_names_route_both_ways(dirs: tuple[Path, Path]) -> None:
    config = read_model_config(dirs[0])
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    assert hf_to_param("model.layers.0.self_attn.wv.weight", config) == (qkv, "v")
    assert hf_to_param("model.layers.0.mlp.w3.weight", config) == ("model.layers.0.mlp.gate_up_proj.weight", 1)
    assert hf_to_param("model.layers.0.mlp.w2.weight", config) == ("model.layers.0.mlp.down_proj.weight", None)
    model = build_model(config, TPInfo(), torch.float32, "cpu")
    covered = set()
    for name, _ in model.named_parameters():
        for hf_name, shard_id in param_to_hf(name, config):
            assert hf_to_param(hf_name, config) == (name, shard_id)
            covered.add(hf_name)
    assert covered == set(expected_hf_tensors(config))


@pytest.mark.slow
def test_loads_and_serves_as_the_llama_it_renames(dirs: tuple[Path, Path]) -> None:
    toy, llama = dirs
    toy_params, llama_params = dict(_load(toy).named_parameters()), dict(_load(llama).named_parameters())
    assert toy_params.keys() == llama_params.keys()
    for name, param in llama_params.items():
        assert torch.equal(toy_params[name], param), name
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = [LLM(path, device="cpu", dtype="float32", kv_cache_bytes=4 << 20).generate(["The river"], greedy)[0]
            for path in (toy, llama)]
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids


def test_checksums_name_the_checkpoint_tensor(dirs: tuple[Path, Path]) -> None:
    toy = dirs[0]
    config = read_model_config(toy)
    model = _load(toy)
    sent = manifest_from_tensors(load_file(str(toy / "model.safetensors")), model="target", weight_version=1, rank=RANK)
    held = _held_by_hf_name(model, config)
    assert compare(sent, manifest_from_tensors(held, model="target", weight_version=1, rank=RANK)).ok
    held["model.layers.1.self_attn.wk.weight"].view(-1)[3] += 1.0  # one element of the fused qkv_proj
    report = compare(sent, manifest_from_tensors(held, model="target", weight_version=1, rank=RANK))
    assert not report.ok
    assert report.first_tensor is not None and report.first_tensor.tensor == "model.layers.1.self_attn.wk.weight"


def test_the_weight_receiver_routes_it(dirs: tuple[Path, Path]) -> None:
    from inference.transfer.plan import TensorSpec
    from inference.weights.target import route_manifest

    toy = dirs[0]
    config = read_model_config(toy)
    model = _load(toy)
    specs = [TensorSpec.of(name, t) for name, t in load_file(str(toy / "model.safetensors")).items()]
    routing = route_manifest(specs, model, config, which="target", rank=RANK, tp_size=1, allow_cast=False)
    held = _held_by_hf_name(model, config)
    for route in routing.routes:
        assert route.held is not None and route.held.data_ptr() == held[route.spec.name].data_ptr()


def test_unknown_architecture_names_the_field() -> None:
    with pytest.raises(InvalidRequestError) as err:
        model_config_from_hf({"architectures": ["NoSuchForCausalLM"], "model_type": "no_such"})
    assert err.value.field == "config.architectures" and "LlamaForCausalLM" in err.value.message


@pytest.mark.parametrize(("hf_modules", "words"), [
    ({"qkv_proj": ("wq", "wk", "wv")}, "no HF modules fill our fused gate_up_proj"),
    ({"qkv_proj": ("wq", "wk"), "gate_up_proj": ("w1", "w3")}, "2 HF module(s) for 3 part(s)"),
    ({"qkv_proj": ("wq", "wk", "wv"), "gate_up_proj": ("w1", "w3"), "down_proj": ("w1",)}, "'w1' fills both"),
])
def test_a_wrong_declaration_fails_when_the_class_is_defined(hf_modules: dict, words: str) -> None:
    with pytest.raises(TypeError, match=words.replace("(", r"\(").replace(")", r"\)")):
        type("Broken", (ModelFamily,), {"hf_modules": hf_modules})


def test_a_family_cannot_take_a_shipped_name() -> None:
    clash = type("Clash", (Llama,), {"name": "clash", "model_type": "clash"})  # Llama's architectures
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        register_family(clash)
    with pytest.raises(ValueError, match="shipped"):
        unregister_family("llama")
