"""Sidecar: the process around the inference worker (CLI, HTTP control plane, rank processes).

`SidecarClient` lives with the trainer's side (trainer_hooks/client.py); it is re-exported here
(and from sidecar.client) and loads lazily, so that importing this package needs no httpx.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SidecarClient"]


def __getattr__(name: str) -> Any:
    if name == "SidecarClient":
        from trainer_hooks.client import SidecarClient  # lazily: httpx only when asked for

        return SidecarClient
    raise AttributeError(name)
