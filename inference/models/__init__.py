"""Model families (one class each, declaring names, fused modules and layout) and the decoder they build.

Light to import: config.json reading (inference/models/hf_config.py) and the tiny model writer read
the family classes without torch; the decoder and build_model load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from inference.models.family import ModelFamily, ShardId, WeightSlot
from inference.models.registry import family_for_hf, family_names, get_family, register_family, unregister_family

if TYPE_CHECKING:
    from inference.models.build import build_model
    from inference.models.decoder import DecoderForCausalLM, KVCacheSpec

_LAZY = {"build_model": "inference.models.build", "DecoderForCausalLM": "inference.models.decoder",
         "KVCacheSpec": "inference.models.decoder"}

__all__ = ["DecoderForCausalLM", "KVCacheSpec", "ModelFamily", "ShardId", "WeightSlot", "build_model",
           "family_for_hf", "family_names", "get_family", "register_family", "unregister_family"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(name)
