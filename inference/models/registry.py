"""The model families the engine serves, by name and by config.json; the only list of them.

A new family is one class (inference/models/<family>.py), one line in SHIPPED and its test. Code
outside the engine may add one at run time with register_family (before building a model of it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from inference.core import InvalidRequestError
from inference.models.family import ModelFamily
from inference.models.llama import Llama
from inference.models.mistral import Mistral
from inference.models.mixtral import Mixtral
from inference.models.qwen2 import Qwen2
from inference.models.qwen3 import Qwen3
from inference.models.qwen3_moe import Qwen3Moe

SHIPPED: tuple[type[ModelFamily], ...] = (Llama, Qwen2, Qwen3, Mistral, Qwen3Moe, Mixtral)
_BY_NAME: dict[str, type[ModelFamily]] = {}


def register_family(family: type[ModelFamily]) -> type[ModelFamily]:
    """Make `family` known by its name, architectures and model_type; ValueError if any is taken."""
    if not family.name or not family.architectures or not family.model_type:
        raise ValueError(f"{family.__name__}: a family needs a name, architectures and a model_type")
    for other in _BY_NAME.values():
        clash = ({other.name, other.model_type} & {family.name, family.model_type}
                 or set(other.architectures) & set(family.architectures))
        if clash:
            raise ValueError(f"{family.__name__}: {sorted(clash)} already belongs to {other.__name__}")
    _BY_NAME[family.name] = family
    return family


def unregister_family(name: str) -> None:
    """Forget a family added with register_family (the shipped ones stay)."""
    if name in {f.name for f in SHIPPED}:
        raise ValueError(f"{name} is a shipped family")
    _BY_NAME.pop(name, None)


def family_names() -> tuple[str, ...]:
    return tuple(_BY_NAME)


def get_family(name: str) -> type[ModelFamily]:
    """The family called `name` (ModelConfig.family); InvalidRequestError naming config.family otherwise."""
    family = _BY_NAME.get(name)
    if family is None:
        raise InvalidRequestError("config.family", f"unknown family {name!r}; known: {sorted(_BY_NAME)}")
    return family


def family_for_hf(hf: Mapping[str, Any]) -> type[ModelFamily]:
    """The family of a config.json: its first known `architectures` entry, else its `model_type`."""
    archs = hf.get("architectures") or []
    by_architecture = {a: f for f in _BY_NAME.values() for a in f.architectures}
    for a in archs:
        if a in by_architecture:
            return by_architecture[a]
    for family in _BY_NAME.values():
        if hf.get("model_type", "") == family.model_type:
            return family
    raise InvalidRequestError("config.architectures", f"unsupported model {archs or hf.get('model_type')!r}; "
                              f"supported: {sorted(by_architecture)}")


for _family in SHIPPED:
    register_family(_family)
