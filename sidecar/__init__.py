"""Sidecar: the process around the inference worker (CLI, HTTP control plane, client).

`SidecarClient` (sidecar.client) loads lazily so that importing this package needs no httpx.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["SidecarClient"]


def __getattr__(name: str) -> Any:
    if name == "SidecarClient":
        return importlib.import_module("sidecar.client").SidecarClient
    raise AttributeError(name)
