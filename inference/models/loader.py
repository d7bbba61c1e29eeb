"""Load a Hugging Face safetensors checkpoint into our (fused, TP-sharded) parameters.

load_weights validates the whole checkpoint from the safetensors headers first (unknown names,
wrong shapes, duplicates, missing tensors), so a bad directory fails with an InvalidRequestError
naming the tensor before any parameter is written. Then each tensor goes through inference.models.naming
(the config's family says which parameter it fills) and that parameter's weight_loader, which takes
the FULL tensor and keeps this rank's slice.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from inference.config import ModelConfig
from inference.core import InvalidRequestError
from inference.models.naming import ShardId, expected_hf_tensors, hf_to_param, is_skipped, param_to_hf
from inference.quant.fp8 import FP8_DTYPE, quantize_rows

_INDEX = "model.safetensors.index.json"


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint's files: those the index names when there is one (so a stray file such as
    Mistral's consolidated.safetensors is not read), else every *.safetensors in the directory."""
    root = Path(model_dir)
    index = root / _INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise InvalidRequestError("model", f"{index} is not a safetensors index: {e}") from e
        files = [root / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise InvalidRequestError("model", f"{index} names {f.name}, which is missing")
        return files
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise InvalidRequestError("model", f"no *.safetensors files in {root}")
    return files


def hf_tensor_shapes(model_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in the checkpoint, read from headers only (no data loaded)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if name in shapes:
                    raise InvalidRequestError(
                        name, f"tensor appears in more than one file (again in {path.name})")
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def iter_hf_tensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_name, tensor on CPU) for every tensor of the checkpoint, one file at a time."""
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                yield name, f.get_tensor(name)


def validate_checkpoint(config: ModelConfig, shapes: dict[str, tuple[int, ...]]) -> None:
    """Raise InvalidRequestError naming the first unknown, misshapen or missing tensor."""
    expected = expected_hf_tensors(config)
    for name, shape in shapes.items():
        if is_skipped(name, config):
            continue
        if name not in expected:
            raise InvalidRequestError(name, f"unknown tensor for a {config.family} model of this config")
        if shape != expected[name]:
            raise InvalidRequestError(
                name, f"shape {list(shape)} does not match the expected {list(expected[name])}")
    missing = sorted(set(expected) - set(shapes))
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise InvalidRequestError(
            missing[0], f"{len(missing)} tensor(s) missing from the checkpoint: {shown}")


def load_hf_tensor(params: dict[str, nn.Parameter], config: ModelConfig, hf_name: str,
                   tensor: torch.Tensor) -> tuple[str, ShardId] | None:
    """Route one FULL HF tensor into its parameter (this rank's slice); None when the name is skipped.

    The shape must already be validated (validate_checkpoint); `params` is model.named_parameters().
    Returns the (parameter name, shard_id) written, so callers can track coverage.
    """
    if is_skipped(hf_name, config):
        return None
    param_name, shard_id = hf_to_param(hf_name, config)
    if param_name not in params:
        raise InvalidRequestError(hf_name, f"maps to {param_name}, which this model does not have")
    param = params[param_name]
    # weight_loader's copy_ casts to the parameter's dtype and device, slicing first on the host (an FP8
    # linear quantizes on the parameter's device instead, and refuses a non-finite tensor: named here).
    try:
        with torch.no_grad():
            param.weight_loader(param, tensor, shard_id)
    except InvalidRequestError as e:
        raise InvalidRequestError(hf_name, e.message) from e
    return param_name, shard_id


def load_weights(model: nn.Module, model_dir: str | Path) -> None:
    """Fill every parameter of `model` (which has `.config: ModelConfig`) from model_dir.

    Every parameter is covered exactly: each (parameter, shard_id) pair is written once.
    """
    validate_checkpoint(model.config, hf_tensor_shapes(model_dir))
    load_named_tensors(model, iter_hf_tensors(model_dir))


def load_named_tensors(model: nn.Module, named: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Fill every parameter from (HF name, full tensor) pairs already validated for this config."""
    config: ModelConfig = model.config
    params = dict(model.named_parameters())
    written: set[tuple[str, ShardId]] = set()
    for hf_name, tensor in named:
        key = load_hf_tensor(params, config, hf_name, tensor)
        if key is not None:
            written.add(key)
    check_covered(params, written, config)


def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights (normal, std 0.02; norms 1) for benchmarks that need no checkpoint; an FP8
    weight is drawn in the model dtype (the same values the unquantized model gets from the same seed) and
    quantized by the rule, its scales into the layer's weight_scale."""
    g = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif p.dtype == FP8_DTYPE:  # drawn as the unquantized model draws it, then quantized by the rule
                drawn = torch.empty(p.shape, dtype=p.quantized_from, device=p.device).normal_(0.0, 0.02, generator=g)
                q, scale = quantize_rows(drawn, name)
                p.copy_(q)
                model.get_submodule(name.rpartition(".")[0]).weight_scale.copy_(scale)
            else:
                p.normal_(0.0, 0.02, generator=g)


def check_covered(params: dict[str, nn.Parameter], written: set[tuple[str, ShardId]],
                  config: ModelConfig) -> None:
    """Raise InvalidRequestError naming the first HF tensor that no load wrote into its parameter."""
    for name in params:
        if (name, None) in written:  # filled whole (an MoE trainer's fused experts, transformers 5 layout)
            continue
        for hf_name, shard_id in param_to_hf(name, config):
            if (name, shard_id) not in written:
                raise InvalidRequestError(hf_name, f"no tensor was loaded into {name} (shard {shard_id})")
