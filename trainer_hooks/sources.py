"""Weight sources: a trainer's model -> (HF name, full tensor) pairs, in a stable order.

`collect_weights(model, keep=...)` picks the source by what the model is: a DeepSpeed engine (ZeRO
0-3), a model with DTensor parameters (FSDP2), a PEFT model (LoRA merged into a copy), or any other
nn.Module (HF transformers, DDP, torch.compile). `peft_adapter_weights` is the adapter-only source of a
LoRA-served sidecar (names as inference/models/naming.py gives them). Invariants:
- Names are the model's HF names: wrapper components ("module." at the front; "_orig_mod",
  "_fsdp_wrapped_module", "_checkpoint_wrapped_module" anywhere) are removed.
- Every parameter is emitted once: a tied lm_head (the same Parameter as the embedding) appears
  only as the embedding's name; the sidecar accepts either.
- Rotary tables and other buffers are not weights and are never emitted.
- Sharded sources are collectives: every rank calls in the same order; on ranks with keep=False the
  result is empty, but the rank took part in every collective.
Imports no engine module (torch, inference.core only); deepspeed and peft are imported lazily.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from inference.core import InvalidRequestError

WRAPPER_PARTS = ("_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")
DEFAULT_GROUP_BYTES = 256 * 2**20
NamedTensor = tuple[str, torch.Tensor]


def normalize_name(name: str) -> str:
    """A parameter name without the wrappers' components (see module docstring)."""
    parts = name.split(".")
    while parts and parts[0] == "module":  # DDP / DeepSpeed wrap the whole model once (or twice)
        parts = parts[1:]
    return ".".join(p for p in parts if p not in WRAPPER_PARTS)


def unwrap(model: nn.Module) -> nn.Module:
    """The innermost model under DDP/DeepSpeed (`.module`) and torch.compile (`._orig_mod`)."""
    while True:
        inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            inner = getattr(model, "module", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def named_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(HF name, parameter) once per parameter, in registration order; tied lm_head -> the embedding."""
    seen: dict[int, int] = {}
    out: list[tuple[str, nn.Parameter]] = []
    for raw, p in model.named_parameters(remove_duplicate=False):
        name = normalize_name(raw)
        if "rotary_emb." in name:
            continue
        if id(p) in seen:  # tied: keep the non-lm_head name, whichever came first
            if out[seen[id(p)]][0].endswith("lm_head.weight"):
                out[seen[id(p)]] = (name, p)
            continue
        seen[id(p)] = len(out)
        out.append((name, p))
    names = [n for n, _ in out]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise InvalidRequestError("model", f"two parameters normalize to the same name {dup!r}")
    return out


def collect_weights(model: Any, *, keep: bool = True, merge_lora: bool = True, offload: bool | None = None,
                    group_bytes: int = DEFAULT_GROUP_BYTES) -> list[NamedTensor]:
    """Every weight of `model` as (HF name, full detached tensor); empty where keep=False.

    Call it on EVERY rank of a distributed trainer in the same order (sharded sources are
    collectives). offload: copy full tensors to host (default: True for ZeRO-3, which is the
    point of gathering a group at a time; False otherwise).
    - DeepSpeed: stages 0-2 hold full parameters on every rank (plain path over engine.module); stage 3
      gathers `group_bytes` of parameters at a time (deepspeed_weights).
    - FSDP2 (`fully_shard`): `full_tensor()` per parameter, an all-gather each (fsdp2_weights).
    - PEFT (peft installed, merge_lora=True): `merge_and_unload()` on a deep copy, so the trainer's
      adapters are untouched; plain modules only (merged_lora_weights).
    """
    if _is_deepspeed_engine(model):
        return list(deepspeed_weights(model, keep=keep, offload=offload, group_bytes=group_bytes))
    if not isinstance(model, nn.Module):
        raise InvalidRequestError("model", f"expected an nn.Module or a DeepSpeed engine, got {type(model).__name__}")
    if any(_is_dtensor(p) for p in model.parameters()):
        return list(fsdp2_weights(model, keep=keep, offload=bool(offload)))
    if not keep:
        return []
    if merge_lora and _is_peft_model(model):
        return merged_lora_weights(model, offload=bool(offload))
    return [(n, _out(p.detach(), bool(offload))) for n, p in named_parameters(model)]


def module_weights(model: nn.Module, *, offload: bool = False) -> Iterator[NamedTensor]:
    """A plain module's parameters (views of the live parameters unless offload)."""
    for name, p in named_parameters(model):
        yield name, _out(p.detach(), offload)


def fsdp2_weights(model: nn.Module, *, keep: bool, offload: bool = False) -> Iterator[NamedTensor]:
    """FSDP2: all-gather each DTensor parameter (every rank, same order); yield only where keep."""
    for name, p in named_parameters(model):
        full = p.detach().full_tensor() if _is_dtensor(p) else p.detach()
        if keep:
            yield name, _out(full, offload)
        del full  # non-keeping ranks free each gathered tensor before the next all-gather


def deepspeed_weights(engine: Any, *, keep: bool, offload: bool | None = None,
                      group_bytes: int = DEFAULT_GROUP_BYTES) -> Iterator[NamedTensor]:
    """A DeepSpeed engine's weights at any ZeRO stage.

    Stage 3 gathers `group_bytes` of parameters at a time with
    `deepspeed.zero.GatheredParameters(group, modifier_rank=None)`. EVERY rank must enter each gather
    (it is a collective); only ranks with keep=True copy the full tensors out, so device memory stays
    bounded by one group. offload None: host copies at stage 3, views below it.
    """
    params = named_parameters(unwrap(engine))
    if not any(hasattr(p, "ds_id") for _, p in params):  # ZeRO 0-2: full parameters everywhere
        if keep:
            for name, p in params:
                yield name, _out(p.detach(), bool(offload))
        return
    offload = True if offload is None else offload
    import deepspeed  # lazily: only ZeRO-3 models need it, and it is heavy

    for group in _groups(params, group_bytes):
        # modifier_rank=None: read-only gather, nothing is scattered back on exit.
        with deepspeed.zero.GatheredParameters([p for _, p in group], modifier_rank=None):
            if keep:
                for name, p in group:
                    yield name, p.detach().to("cpu", copy=True) if offload else p.detach().clone()


def merged_lora_weights(model: nn.Module, *, offload: bool = False) -> list[NamedTensor]:
    """A PEFT model's base weights with the LoRA deltas merged, from a deep copy (the original keeps
    its adapters). Memory: one extra copy of the model while this runs."""
    merged = copy.deepcopy(model).merge_and_unload()  # type: ignore[operator]
    out = [(n, _out(p.detach(), offload)) for n, p in named_parameters(merged)]
    del merged
    return out


def peft_adapter_weights(model: nn.Module, *, offload: bool = False) -> list[NamedTensor]:
    """A PEFT LoRA model's active adapter tensors alone, under the wire names the sidecar serves them by
    (`<module>.lora_A.weight` [r, in], `<module>.lora_B.weight` [out, r]): views unless offload."""
    adapter = _active_adapter(model)
    out = []
    for name, p in named_parameters(model):
        if f".lora_A.{adapter}." in name or f".lora_B.{adapter}." in name:
            out.append((_wire_name(name, adapter), _out(p.detach(), offload)))
    if not out:
        raise InvalidRequestError("model", f"the PEFT model's adapter {adapter!r} holds no LoRA tensors")
    return out


def peft_base_weights(model: nn.Module, *, offload: bool = False) -> list[NamedTensor]:
    """A PEFT model's base weights, unmerged, under the base model's HF names (what a LoRA-served sidecar
    holds as its base: sent once after its weights were dropped, beside the adapter)."""
    out = []
    for name, p in named_parameters(model):
        if ".lora_" in name:
            continue
        name = name.replace(".base_layer.", ".")
        out.append((name.removeprefix("base_model.model."), _out(p.detach(), offload)))
    return out


def _active_adapter(model: nn.Module) -> str:
    active = getattr(model, "active_adapter", None)
    if not _is_peft_model(model) or not isinstance(active, str):
        raise InvalidRequestError("model", f"an adapter-only sync takes a PEFT model with one active adapter, "
                                  f"got {type(model).__name__}")
    return active


def _wire_name(peft_name: str, adapter: str) -> str:
    name = peft_name.removeprefix("base_model.model.")
    for kind in ("lora_A", "lora_B"):
        name = name.replace(f".{kind}.{adapter}.weight", f".{kind}.weight")
    return name


def _groups(params: list[tuple[str, nn.Parameter]], group_bytes: int) -> Iterator[list[tuple[str, nn.Parameter]]]:
    """Consecutive parameters whose full sizes sum to at most group_bytes (a larger one goes alone)."""
    group: list[tuple[str, nn.Parameter]] = []
    size = 0
    for name, p in params:
        nbytes = int(getattr(p, "ds_numel", p.numel())) * p.element_size()
        if group and size + nbytes > group_bytes:
            yield group
            group, size = [], 0
        group.append((name, p))
        size += nbytes
    if group:
        yield group


def _out(t: torch.Tensor, offload: bool) -> torch.Tensor:
    return t.to("cpu", copy=True) if offload and t.device.type != "cpu" else t


def _is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor" or type(getattr(t, "data", None)).__name__ == "DTensor"


def _is_deepspeed_engine(model: Any) -> bool:
    return any(c.__name__ == "DeepSpeedEngine" for c in type(model).__mro__)


def _is_peft_model(model: nn.Module) -> bool:
    return type(model).__module__.startswith("peft.") and hasattr(model, "merge_and_unload")
