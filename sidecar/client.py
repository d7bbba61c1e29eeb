"""Re-export of the trainer's-side client (trainer_hooks/client.py), where `SidecarClient` and its
errors live now; `from sidecar.client import ...` keeps working."""

from __future__ import annotations

from trainer_hooks.client import (
    SidecarAuthError,
    SidecarBusyError,
    SidecarChecksumError,
    SidecarClient,
    SidecarConnectionError,
    SidecarHTTPError,
    SidecarMemoryError,
    SidecarNotFoundError,
    SidecarRequestError,
    SidecarServerError,
    SidecarStateError,
    SidecarTransferError,
    SidecarUnavailableError,
    error_from_response,
    records_json,
)

__all__ = [
    "SidecarAuthError",
    "SidecarBusyError",
    "SidecarChecksumError",
    "SidecarClient",
    "SidecarConnectionError",
    "SidecarHTTPError",
    "SidecarMemoryError",
    "SidecarNotFoundError",
    "SidecarRequestError",
    "SidecarServerError",
    "SidecarStateError",
    "SidecarTransferError",
    "SidecarUnavailableError",
    "error_from_response",
    "records_json",
]
