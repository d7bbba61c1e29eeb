"""The errors of `SidecarClient` (trainer_hooks/client.py), apart from it so that catching them needs
neither httpx nor torch: the hook catches these classes, never class names or `type` strings.

An error response becomes the class its HTTP status picks (sidecar/api/common.py maps the ranks'
error kinds to statuses); a 409 whose type is the checksum package's ChecksumMismatch (a per-rank
audit failed in a sync) is the narrower SidecarChecksumError, one whose type is ProtocolMismatch (the
sidecar speaks another weight-sync protocol) SidecarProtocolError.
"""

from __future__ import annotations

from typing import Any

from inference.core import InvalidRequestError, SidecarError, StateError

# checksum.ChecksumMismatch.__name__, as the server reports it (tests/test_client.py holds them equal;
# importing checksum here would import torch into every client)
CHECKSUM_MISMATCH = "ChecksumMismatch"
PROTOCOL_MISMATCH = "ProtocolMismatch"  # the sidecar's 409 at /weights/init (sidecar/api/control.py)


class SidecarHTTPError(SidecarError):
    """An error response. `field` names the culprit of a bad request; `rank` the rank that failed."""

    def __init__(self, status: int, type_: str, message: str, field: str | None = None,
                 rank: str | None = None, body: Any = None) -> None:
        Exception.__init__(self, f"HTTP {status} {type_}: {f'{field}: ' if field else ''}{message}")
        self.status, self.type, self.message, self.field, self.rank, self.body = (
            status, type_, message, field, rank, body)


class SidecarRequestError(SidecarHTTPError, InvalidRequestError):
    """400 / 422: a malformed body, a wrong type, an unknown field, a value out of range."""


class SidecarAuthError(SidecarHTTPError):
    """401: missing or wrong API key."""


class SidecarNotFoundError(SidecarHTTPError):
    """404."""


class SidecarStateError(SidecarHTTPError, StateError):
    """409: not allowed now (asleep with wait=False, a sync while another is open, checksum mismatch)."""


class SidecarChecksumError(SidecarStateError):
    """409 from a per-rank audit in a sync: a rank did not receive the bytes sent (the model is torn); the
    message names the tensor and the rank."""


class SidecarProtocolError(SidecarStateError):
    """Client and sidecar speak different weight-sync protocols (refused at /weights/init, by either
    side); the message names both versions. Install the trainer_hooks of the sidecar's own release."""


class SidecarBusyError(SidecarHTTPError):
    """429: too many queued prompts."""


class SidecarTransferError(SidecarHTTPError):
    """502: the weight wire failed (the sender died or timed out); the model is torn."""


class SidecarUnavailableError(SidecarHTTPError):
    """503: a rank process is dead or hung."""


class SidecarMemoryError(SidecarHTTPError):
    """507: not enough device memory to wake up (retry once the trainer freed it)."""


class SidecarServerError(SidecarHTTPError):
    """500 and any other status."""


class SidecarConnectionError(SidecarError):
    """The sidecar could not be reached (or did not answer in time), after any retries."""


_BY_STATUS: dict[int, type[SidecarHTTPError]] = {
    400: SidecarRequestError, 422: SidecarRequestError, 401: SidecarAuthError, 404: SidecarNotFoundError,
    409: SidecarStateError, 429: SidecarBusyError, 502: SidecarTransferError, 503: SidecarUnavailableError,
    507: SidecarMemoryError,
}


def error_class(status: int, type_: str) -> type[SidecarHTTPError]:
    """The class an error response with this status and error type becomes."""
    if status == 409 and type_ == CHECKSUM_MISMATCH:
        return SidecarChecksumError
    if status == 409 and type_ == PROTOCOL_MISMATCH:
        return SidecarProtocolError
    return _BY_STATUS.get(status, SidecarServerError)
