"""Re-export of the trainer's-side client (trainer_hooks/client.py, where `SidecarClient` and its errors
live), so that `from sidecar.client import ...` works. The names are that module's `__all__`, declared
there once."""

from __future__ import annotations

from trainer_hooks import client as _client
from trainer_hooks.client import *  # noqa: F403

__all__ = list(_client.__all__)
