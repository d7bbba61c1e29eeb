"""The data of the weight updater (inference/weights/updater.py): per-model version and torn state, an
open session, a passed audit's result, and the cached routing of the last manifest. Plain records:
the updater is their only writer, and nobody else keeps a copy of what they hold."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from checksum import ALGORITHM, Manifest, Report, TensorRecord
from inference.config import ModelConfig
from inference.memory.arenas import ArenaState
from inference.parallel import TPInfo
from inference.transfer.digests import PendingRecords
from inference.transfer.installed_digests import RankExpectation
from inference.transfer.plan import ParsedManifest
from inference.weights.target import Routing, UpdateTarget

if TYPE_CHECKING:
    from inference.memory.sleep import MemoryManager


class WeightHost(Protocol):
    """What the updater reads of its Worker (inference/engine/worker.py) at each use: the models it writes
    are the Worker's, built and adopted into arenas there."""

    models: dict[str, nn.Module]
    model_configs: dict[str, ModelConfig]
    device: torch.device | None
    tp: TPInfo
    dp_rank: int
    memory: MemoryManager | None

    @property
    def rank_key(self) -> str: ...


@dataclass
class ModelWeightState:
    """One model's weights: the live version (advanced only by a passed audit), torn from the first
    byte a sync may write until an audit passes, `loaded` False after reset_weights until then."""

    version: int = 0
    torn: bool = False
    torn_reason: str | None = None
    loaded: bool = True  # False after reset_weights until a sync passes its audit


@dataclass
class Session:
    which: str
    version: int
    specs: ParsedManifest
    target: UpdateTarget
    algorithm: str = ALGORITHM  # the digest rule the sender named in the start manifest
    bytes_moved: bool = False
    received: bool = False
    held_digests: PendingRecords | None = None  # started when the last byte landed
    # (records in manifest order, the received Manifest) of held_digests, collected when update ended
    held_received: tuple[list[TensorRecord], Manifest] | None = None
    # what the sender expects this rank to have installed (FP8), delivered in the sync; None: it checks none
    expected_installed: RankExpectation | None = None


@dataclass(frozen=True)
class UpdateResult:
    """A passed audit: the received digests (trainer names), if asked the held ones (engine names), and on an
    FP8 model the installed ones (`name:fp8`, `name:scale`, as this rank holds them: inference/weights/installed.py)
    and how many of them the sender's expected installed digests covered (0: it delivered none)."""

    model: str
    version: int
    rank: str
    report: Report
    received: Manifest
    held: Manifest | None = None
    installed: tuple[TensorRecord, ...] = ()
    installed_checked: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "version": self.version, "rank": self.rank, "ok": self.report.ok,
                "summary": self.report.summary(), "received": self.received.to_dict(),
                "held": self.held.to_dict() if self.held is not None else None}


@dataclass
class RouteCache:
    """The routing of the last manifest started on one model, valid while `slots` still hold: the
    same model object, each module still holding the same Parameter on the same storage."""

    specs: ParsedManifest
    allow_cast: bool
    model: nn.Module
    config: ModelConfig
    slots: list[tuple[nn.Module, str, nn.Parameter, int]]
    routing: Routing

    def matches(self, specs: ParsedManifest, allow_cast: bool, model: nn.Module, config: ModelConfig) -> bool:
        return (specs is self.specs and allow_cast == self.allow_cast and model is self.model
                and config is self.config
                and all(m._parameters.get(n) is p and p.data_ptr() == ptr for m, n, p, ptr in self.slots))


def parameter_slots(model: nn.Module) -> list[tuple[nn.Module, str, nn.Parameter, int]]:
    return [(module, name, p, p.data_ptr()) for module in model.modules()
            for name, p in module._parameters.items() if p is not None]


def arena_asleep(memory: MemoryManager | None, tag: str) -> str | None:
    """The state of arena `tag` when it is not awake; None when awake (or no such arena)."""
    if memory is None or tag not in memory.tags or memory.state(tag) is ArenaState.AWAKE:
        return None
    return str(memory.state(tag).value)


def set_arena_valid(memory: MemoryManager | None, tag: str, valid: bool) -> None:
    """Mark arena `tag`'s contents valid (mirrored at a level-1 sleep) or not (half-written)."""
    if memory is not None and tag in memory.tags:
        (memory.mark_loaded if valid else memory.mark_not_loaded)(tag)
