"""The trainer's side of Sidecar: weight sources, the sync hook, the HTTP client, a fleet of replicas,
framework callbacks.

Imports no engine module and nothing of sidecar/: torch, checksum, inference.core and the light
sender only (tests/test_import_layers.py holds this). The names below load on first use, so that
`trainer_hooks.client` (httpx + inference.core) imports without torch, as `sidecar status` wants.
The transformers callback lives in trainer_hooks.hf_callback (transformers is imported lazily there).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainer_hooks.client import SidecarClient
    from trainer_hooks.fleet import Fleet, FleetError, FleetGoneError
    from trainer_hooks.hook import AttachError, AuditError, SidecarGoneError, WeightSyncHook, sampling
    from trainer_hooks.logprob_gap import (
        LogprobGap,
        measure_logprob_gap,
        rollout_importance_weights,
        truncated_importance_weights,
    )
    from trainer_hooks.sources import (
        collect_weights,
        deepspeed_weights,
        fsdp2_weights,
        merged_lora_weights,
        module_weights,
        named_parameters,
        normalize_name,
        peft_adapter_weights,
        peft_base_weights,
        unwrap,
    )

_CLIENT = ("SidecarClient",)
_FLEET = ("Fleet", "FleetError", "FleetGoneError")
_HOOK = ("AttachError", "AuditError", "SidecarGoneError", "WeightSyncHook", "sampling")
_GAP = ("LogprobGap", "measure_logprob_gap", "rollout_importance_weights", "truncated_importance_weights")
_SOURCES = ("collect_weights", "deepspeed_weights", "fsdp2_weights", "merged_lora_weights", "module_weights",
            "named_parameters", "normalize_name", "peft_adapter_weights", "peft_base_weights", "unwrap")

__all__ = [  # the five groups above, spelled out for linters and readers
    "AttachError",
    "AuditError",
    "Fleet",
    "FleetError",
    "FleetGoneError",
    "LogprobGap",
    "SidecarClient",
    "SidecarGoneError",
    "WeightSyncHook",
    "collect_weights",
    "deepspeed_weights",
    "fsdp2_weights",
    "measure_logprob_gap",
    "merged_lora_weights",
    "module_weights",
    "named_parameters",
    "normalize_name",
    "peft_adapter_weights",
    "peft_base_weights",
    "rollout_importance_weights",
    "sampling",
    "truncated_importance_weights",
    "unwrap",
]


def __getattr__(name: str) -> Any:
    if name in _CLIENT:
        from trainer_hooks import client as module
    elif name in _FLEET:
        from trainer_hooks import fleet as module  # type: ignore[no-redef]
    elif name in _HOOK:
        from trainer_hooks import hook as module  # type: ignore[no-redef]
    elif name in _GAP:
        from trainer_hooks import logprob_gap as module  # type: ignore[no-redef]
    elif name in _SOURCES:
        from trainer_hooks import sources as module  # type: ignore[no-redef]
    else:
        raise AttributeError(f"module 'trainer_hooks' has no attribute {name!r}")
    return getattr(module, name)
