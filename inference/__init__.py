"""The inference worker: models, paged KV cache, scheduler, sampler, runner, engine. No HTTP here.

Heavy modules load lazily so that `inference.core` stays cheap to import.
"""

from __future__ import annotations

import importlib
from typing import Any

from inference.core import (
    CompletionOutput,
    FinishReason,
    InvalidRequestError,
    RequestOutput,
    SamplingParams,
    SidecarError,
    StateError,
)

_LAZY = {"LLM": "inference.engine.llm", "Worker": "inference.engine.worker", "EngineConfig": "inference.config"}

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "FinishReason",
    "InvalidRequestError",
    "RequestOutput",
    "SamplingParams",
    "SidecarError",
    "StateError",
    "Worker",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(name)
