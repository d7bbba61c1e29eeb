"""The trainer's side of Sidecar: weight sources, the sync hook, framework callbacks.

Imports no engine module: torch, checksum, inference.core and the light sender only. The
transformers callback lives in trainer_hooks.hf_callback (transformers is imported lazily there).
"""

from trainer_hooks.hook import AuditError, SidecarGoneError, WeightSyncHook, sampling
from trainer_hooks.sources import (
    collect_weights,
    deepspeed_weights,
    fsdp2_weights,
    merged_lora_weights,
    module_weights,
    named_parameters,
    normalize_name,
    unwrap,
)

__all__ = [
    "AuditError",
    "SidecarGoneError",
    "WeightSyncHook",
    "collect_weights",
    "deepspeed_weights",
    "fsdp2_weights",
    "merged_lora_weights",
    "module_weights",
    "named_parameters",
    "normalize_name",
    "sampling",
    "unwrap",
]
