"""Sidecar: the process around the inference worker (CLI, HTTP control plane, rank processes).

`SidecarClient` and `Fleet` (several replicas behind one trainer) live with the trainer's side
(trainer_hooks/client.py, trainer_hooks/fleet.py); they are re-exported here (SidecarClient also from
sidecar.client) and load lazily, so that importing this package needs no httpx.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Fleet", "SidecarClient"]


def __getattr__(name: str) -> Any:
    if name == "SidecarClient":
        from trainer_hooks.client import SidecarClient  # lazily: httpx only when asked for

        return SidecarClient
    if name == "Fleet":
        from trainer_hooks.fleet import Fleet

        return Fleet
    raise AttributeError(name)
