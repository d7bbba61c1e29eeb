"""A PEFT LoRA adapter directory -> LoRASlots on a built model, filled from adapter_model.safetensors.

`read_adapter(dir)` reads adapter_config.json into an AdapterSpec and refuses, naming the option, what
the engine cannot serve unmerged (DoRA, biases, modules_to_save, per-module ranks, ...); options that
only matter in training (lora_dropout, init_lora_weights) are ignored. `attach_adapter` hangs a slot on
every targeted linear (inference/layers/lora.py), sharded over tensor parallelism as the linear's
weight is; `adapter_regions(model)` maps each adapter tensor's wire name (inference/models/naming.py:
`<module>.lora_A.weight`) to where this rank holds it (the whole tensor or its slice: an AdapterTensor),
which is what the launch load, a sync's routing and the audit use. One adapter per model.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from inference.config import ModelConfig
from inference.core import InvalidRequestError
from inference.layers.linear import ColumnParallelLinear, RowParallelLinear
from inference.layers.lora import AdapterTensor, LoRAPart, LoRASlot
from inference.models.naming import expected_hf_tensors, hf_to_param, lora_name, param_to_hf, peft_to_hf

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
# option -> the value that means "not used"; any other value is refused, naming the option
_REFUSED = {"use_dora": False, "bias": "none", "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {},
            "layers_to_transform": None, "layers_pattern": None, "fan_in_fan_out": False, "lora_bias": False,
            "target_parameters": None, "trainable_token_indices": None, "use_qalora": False,
            "megatron_config": None, "layer_replication": None, "exclude_modules": None}
_UNADAPTABLE = ("embed_tokens", "lm_head")


@dataclass(frozen=True)
class AdapterSpec:
    """What the engine serves of an adapter_config.json."""

    rank: int
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...] | str  # PEFT: module-name suffixes, or one regex / "all-linear"

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


def read_adapter(adapter_dir: str | Path) -> AdapterSpec:
    """The AdapterSpec of a PEFT adapter directory, or InvalidRequestError naming the culprit."""
    path = Path(adapter_dir) / CONFIG_FILE
    if not path.is_file():
        raise InvalidRequestError("lora", f"{adapter_dir} has no {CONFIG_FILE}: not a PEFT adapter directory")
    cfg = json.loads(path.read_text())
    if cfg.get("peft_type", "LORA") != "LORA":
        raise InvalidRequestError("lora.peft_type", f"is {cfg['peft_type']!r}; only LORA adapters are served")
    for option, unused in _REFUSED.items():
        value = cfg.get(option, unused)
        if value not in (unused, None, {}, [], False) or (option == "bias" and value != "none"):
            raise InvalidRequestError(f"lora.{option}", f"is {value!r} in {path}: the engine serves plain LoRA "
                                      "unmerged and cannot serve this option (merge the adapter instead)")
    rank, alpha, targets = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r")), cfg.get("target_modules")
    if not isinstance(rank, int) or rank <= 0:
        raise InvalidRequestError("lora.r", f"must be a positive integer, got {rank!r}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise InvalidRequestError("lora.lora_alpha", f"must be a number, got {alpha!r}")
    if not targets:
        raise InvalidRequestError("lora.target_modules", "is empty: the adapter adapts nothing")
    targets = targets if isinstance(targets, str) else tuple(sorted(targets))
    return AdapterSpec(rank, float(alpha), bool(cfg.get("use_rslora", False)), targets)


def _targeted(module: str, targets: tuple[str, ...] | str) -> bool:
    """PEFT's matching: a list names module-name suffixes; a string is a full-match regex or "all-linear"."""
    if targets == "all-linear":
        return True
    if isinstance(targets, str):
        return re.fullmatch(targets, module) is not None
    return any(module == t or module.endswith("." + t) for t in targets)


def attach_adapter(model: nn.Module, config: ModelConfig, spec: AdapterSpec, *, invariant: bool = False) -> None:
    """Hang a zeroed LoRASlot on every linear the spec targets (refusing what cannot be adapted), sharded
    by the layer's own tensor-parallel rank and size, in the layer's compute dtype (the model dtype, also
    over an FP8 weight)."""
    expected = expected_hf_tensors(config)
    modules = dict(model.named_modules())
    matched: set[str] = set()
    for hf_name, shape in expected.items():
        module = hf_name[:-len(".weight")]
        if not hf_name.endswith(".weight") or len(shape) != 2 or not _targeted(module, spec.target_modules):
            continue
        short = module.rsplit(".", 1)[-1]
        if short in _UNADAPTABLE:
            if spec.target_modules == "all-linear":
                continue  # PEFT's all-linear leaves the output layer out too
            raise InvalidRequestError("lora.target_modules", f"adapts {short}, which is served without LoRA")
        matched.add(short)
    if isinstance(spec.target_modules, tuple):
        missing = [t for t in spec.target_modules if not any(m == t.rsplit(".", 1)[-1] for m in matched)]
        if missing:
            raise InvalidRequestError("lora.target_modules", f"{missing[0]!r} matches no linear layer of this "
                                      f"{config.family} model")
    for param_name in {hf_to_param(n, config)[0] for n in expected}:
        layer = modules.get(param_name[:-len(".weight")])
        if not isinstance(layer, ColumnParallelLinear | RowParallelLinear) or not param_name.endswith(".weight"):
            continue
        parts, offset = [], 0
        for hf_name, _ in param_to_hf(param_name, config):
            rows = expected[hf_name][0]
            if _targeted(hf_name[:-len(".weight")], spec.target_modules):
                parts.append(LoRAPart(hf_name, offset, rows))
            offset += rows
        if parts:
            in_features = expected[parts[0].hf_name][1]  # the full layer's, as A's shape
            # the model dtype, never an FP8 weight's: the adapter computes as over a bf16 base
            layer.lora = LoRASlot(parts, spec.rank, in_features, spec.scaling, layer.compute_dtype,
                                  layer.weight.device, invariant,
                                  tp_rank=layer.tp.rank, tp_size=layer.tp.size,
                                  row_parallel=isinstance(layer, RowParallelLinear))


def adapter_regions(model: nn.Module) -> dict[str, AdapterTensor]:
    """Wire name -> where this rank holds it, for every adapter tensor of `model` (empty without one)."""
    out: dict[str, AdapterTensor] = {}
    for module in model.modules():
        if isinstance(module, LoRASlot):
            out.update({lora_name(base, kind): t for (base, kind), t in module.regions().items()})
    return out


def load_adapter(model: nn.Module, adapter_dir: str | Path) -> None:
    """Fill the model's slots from adapter_model.safetensors: every tensor exactly once, shapes checked."""
    from safetensors import safe_open

    path = Path(adapter_dir) / WEIGHTS_FILE
    if not path.is_file():
        raise InvalidRequestError("lora", f"{adapter_dir} has no {WEIGHTS_FILE}")
    regions = adapter_regions(model)
    seen: set[str] = set()
    with safe_open(str(path), framework="pt") as f, torch.no_grad():
        for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            name = peft_to_hf(key)
            if name not in regions:
                raise InvalidRequestError(key, f"in {path}: no adapted layer of this model takes it")
            tensor, held = f.get_tensor(key), regions[name]
            if tuple(tensor.shape) != held.full_shape:
                raise InvalidRequestError(key, f"in {path}: shape {list(tensor.shape)}, the model's adapter "
                                          f"takes {list(held.full_shape)}")
            held.load(tensor)
            seen.add(name)
    missing = sorted(set(regions) - seen)
    if missing:
        raise InvalidRequestError(missing[0], f"missing from {path} ({len(missing)} adapter tensor(s))")
