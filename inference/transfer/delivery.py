"""Step 4 of a sync, when the sender delivers its digests over the group: the audit needs no second call.

`WeightSender.send(..., deliver_digests=True)` and `WeightReceiver.receive(..., digests_follow=True)`
agree on it in step 1 (it enters the plan fingerprint: an end that expects the digests never meets one
that does not send them, both stop before a byte moves). After the status step the sender broadcasts
ONE control message on the gloo group, whose length every end derives from the manifest:
  byte 0: 0 (the digests follow) or 1 (the sender could not digest what it sent; it raises its error);
  then 16 bytes per manifest tensor, in manifest order: each digest's canonical form (every rule's digest
  is an xxh3-128, 32 hex digits; checksum/definition.py).
then, when step 1 agreed on one, the section of expected installed FP8 digests, whose length every end
derives too (inference/transfer/installed_digests.py).
A receiver turns the digests into the plain finish form ({"algorithm", "digests": hex strings}) that its
finish compares in C-level passes (inference/weights/audit.py). Every end runs the step or none does: the
status all-reduce before it gives every end the same verdict.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from checksum import TensorRecord
from inference.core import StateError
from inference.transfer.groups import TransferGroup

DIGEST_BYTES = 16  # xxh3-128's canonical digest: what every rule's hex digest stands for
PLAN_SUFFIX = "+digests"  # added to the backend's plan id in the fingerprint of a sync that delivers them
_FOLLOW, _NONE = 0, 1


def delivery_size(n: int) -> int:
    """The digests' length in the step's message for a manifest of `n` tensors (every end computes it
    alone); the installed section, if any, follows them."""
    return 1 + DIGEST_BYTES * n


def send_digests(group: TransferGroup, records: Sequence[TensorRecord] | None, n: int, section: bytes = b"") -> None:
    """The sender's step 4: `records` (one per manifest tensor, in order), or None when it has none (its
    digest failed): the receivers then fail their audit instead of waiting for digests. `section`: the
    expected installed digests step 1 agreed on (b"" when none)."""
    payload = _payload(records, n) + section
    group.broadcast_bytes(payload, len(payload))


def post_digests(group: TransferGroup, n: int, section: int = 0) -> Callable[[], bytes]:
    """A receiver's step 4, posted right after the status step (the sender's message then meets a posted
    receive while this rank collects its own digest); the callable waits for the message (digests, then
    the `section` bytes of expected installed digests)."""
    return group.post_bytes(None, delivery_size(n) + section)


def read_digests(payload: bytes, algorithm: str, rank: str) -> dict[str, Any]:
    """The step's message as finish takes the sender's digests. StateError naming this rank when the sender
    had none (the model stays torn: the audit cannot pass without them)."""
    if payload[0] != _FOLLOW:
        raise StateError(f"rank {rank}: the sender could not digest what it sent (the trainer raises its "
                         "error), so this sync cannot be audited; nothing goes live: sync again")
    text = payload[1:].hex()
    width = 2 * DIGEST_BYTES
    return {"algorithm": algorithm, "digests": [text[i : i + width] for i in range(0, len(text), width)]}


def _payload(records: Sequence[TensorRecord] | None, n: int) -> bytes:
    if records is not None and len(records) == n:
        try:
            body = b"".join(bytes.fromhex(r.digest) for r in records)
        except ValueError:
            body = b""
        if len(body) == DIGEST_BYTES * n:
            return bytes([_FOLLOW]) + body
    return bytes([_NONE]) + bytes(DIGEST_BYTES * n)
