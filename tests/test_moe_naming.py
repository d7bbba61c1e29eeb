"""The naming of MoE families (inference/models/moe_family.py): each family's per-expert checkpoint names map
onto the fused expert parameters and back; at TP=1 the weight receiver writes every expert tensor straight
into its region of the fused parameter (the region the loader fills); with TP each rank holds its slice of
the intermediate dimension of every expert."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from inference.config import ModelConfig
from inference.core import InvalidRequestError
from inference.models import build_model
from inference.models.hf_config import read_model_config
from inference.models.loader import iter_hf_tensors, load_named_tensors, load_weights
from inference.models.naming import expected_hf_tensors, family_of, hf_to_param, param_to_hf
from inference.models.tiny import make_tiny_model
from inference.parallel import TPInfo
from inference.transfer.plan import TensorSpec
from inference.weights.target import validate_manifest


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp(request.param) / "m", request.param, num_layers=2,
                           hidden_size=64, intermediate_size=96)


def _config(model_dir: Path) -> ModelConfig:
    return read_model_config(model_dir)


def test_expert_names_map_to_the_fused_parameters_and_back(model_dir: Path) -> None:
    config = _config(model_dir)
    block, (gate, up, down) = (("mlp", ("gate_proj", "up_proj", "down_proj")) if config.family == "qwen3_moe"
                               else ("block_sparse_moe", ("w1", "w3", "w2")))
    p = "model.layers.1."
    assert hf_to_param(f"{p}{block}.experts.3.{gate}.weight", config) == (p + "mlp.experts.gate_up_proj", (3, 0))
    assert hf_to_param(f"{p}{block}.experts.3.{up}.weight", config) == (p + "mlp.experts.gate_up_proj", (3, 1))
    assert hf_to_param(f"{p}{block}.experts.7.{down}.weight", config) == (p + "mlp.experts.down_proj", 7)
    assert hf_to_param(f"{p}{block}.gate.weight", config) == (p + "mlp.gate.weight", None)
    model = build_model(config, TPInfo(), torch.float32, "meta")
    covered = set()
    for name, _ in model.named_parameters():
        for hf_name, shard_id in param_to_hf(name, config):
            assert hf_to_param(hf_name, config) == (name, shard_id)
            covered.add(hf_name)
    assert covered == set(expected_hf_tensors(config))


def test_the_receiver_writes_each_expert_straight_into_its_region(model_dir: Path) -> None:
    config = _config(model_dir)
    model = build_model(config, TPInfo(), torch.float32, "cpu")
    load_weights(model, model_dir)
    specs = [TensorSpec(n, "float32", tuple(t.shape)) for n, t in iter_hf_tensors(model_dir)]
    routes = validate_manifest(specs, model, config, which="target", rank="dp0:pp0:tp0", tp_size=1, allow_cast=False)
    tensors = dict(iter_hf_tensors(model_dir))
    experts = [r for r in routes if ".experts." in r.spec.name]
    assert len(experts) == 3 * config.num_experts * (config.num_layers - len(config.dense_layers))
    for route in routes:
        assert route.held is not None, route.spec.name
        assert torch.equal(route.held, tensors[route.spec.name]), route.spec.name  # the loader's bytes there


def test_each_tp_rank_holds_its_slice_of_every_expert(model_dir: Path) -> None:
    config = _config(model_dir)
    tensors = dict(iter_hf_tensors(model_dir))
    inter = config.moe_intermediate_size // 2
    for rank in range(2):
        model = build_model(config, TPInfo(rank, 2, group=object()), torch.float32, "cpu")
        load_weights(model, model_dir)
        params = dict(model.named_parameters())
        for hf_name, t in tensors.items():
            name, shard_id = hf_to_param(hf_name, config)
            if isinstance(shard_id, tuple):
                expert, part = shard_id
                held = params[name][expert, part * inter:(part + 1) * inter]
                assert torch.equal(held, t[rank * inter:(rank + 1) * inter]), hf_name
            elif name.endswith("experts.down_proj"):
                assert torch.equal(params[name][shard_id], t[:, rank * inter:(rank + 1) * inter]), hf_name


def test_transformers_in_memory_experts_fill_the_parameters_whole(model_dir: Path) -> None:
    """A trainer's transformers 5 model holds a layer's experts fused under our names: the receiver takes
    that layout (held whole at TP=1), one layout per manifest, and each TP rank's loader keeps the slice."""
    config = _config(model_dir)
    full = build_model(config, TPInfo(), torch.float32, "cpu")
    load_weights(full, model_dir)
    layout = family_of(config).in_memory_hf_tensors(config)
    assert layout is not None
    specs = [TensorSpec(n, "float32", s) for n, s in layout.items()]
    routes = validate_manifest(specs, full, config, which="target", rank="dp0:pp0:tp0", tp_size=1, allow_cast=False)
    params = dict(full.named_parameters())
    for route in routes:
        if ".experts." in route.spec.name:
            assert route.shard_id is None and route.held is not None
            assert route.held.data_ptr() == params[route.spec.name].data_ptr()
    mixed = [s for s in specs if not s.name.endswith("layers.0.mlp.experts.down_proj")]
    with pytest.raises(InvalidRequestError, match=r"layers\.0\.mlp\.experts\.down_proj"):
        validate_manifest(mixed, full, config, which="target", rank="dp0:pp0:tp0", tp_size=1, allow_cast=False)
    inter = config.moe_intermediate_size // 2
    gate_up, down = (params[f"model.layers.0.mlp.experts.{n}"].detach() for n in ("gate_up_proj", "down_proj"))
    for rank in range(2):
        shard = dict(build_model(config, TPInfo(rank, 2, group=object()), torch.float32, "cpu").named_parameters())
        for name, whole in (("gate_up_proj", gate_up), ("down_proj", down)):
            p = shard[f"model.layers.0.mlp.experts.{name}"]
            p.weight_loader(p, whole, None)
        rows = slice(rank * inter, (rank + 1) * inter)
        held = shard["model.layers.0.mlp.experts.gate_up_proj"]
        assert torch.equal(held, torch.cat([gate_up[:, rows], gate_up[:, 2 * inter:][:, rows]], dim=1))
        assert torch.equal(shard["model.layers.0.mlp.experts.down_proj"], down[:, :, rows])


def test_a_transformers_state_dict_loads_as_the_checkpoint_does(model_dir: Path) -> None:
    """load_named_tensors over a transformers 5 MoE model's own state (fused experts) fills every parameter
    with the checkpoint's bytes (what the generate benchmark does with dummy weights)."""
    import transformers

    config = _config(model_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ours, ref = (build_model(config, TPInfo(), torch.float32, "cpu") for _ in range(2))
    load_named_tensors(ours, hf.state_dict().items())
    load_weights(ref, model_dir)
    got = dict(ours.named_parameters())
    for name, p in ref.named_parameters():
        assert torch.equal(got[name], p), name
