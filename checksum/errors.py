"""Errors of the checksum package.

`checksum` is a leaf (it cannot import `inference.core.SidecarError`), so it has its own base,
`ChecksumError`. Its concrete errors are also `ValueError`s: a bad manifest and a mismatching
audit (`checksum.compare.ChecksumMismatch`, which carries its Report) are both "the data is wrong",
and callers that only know the standard library can catch them.
"""

from __future__ import annotations


class ChecksumError(Exception):
    """Base of every error the checksum package raises on purpose."""


class ManifestError(ChecksumError, ValueError):
    """A manifest (file, JSON text or dict) is malformed.

    `source` names where it came from (a path, or "<dict>"), `field` the offending field as a
    dotted path such as "tensors[3].shape"; both appear in the message.
    """

    def __init__(self, source: str, field_name: str, message: str) -> None:
        super().__init__(f"{source}: {field_name}: {message}")
        self.source = source
        self.field = field_name
        self.message = message

