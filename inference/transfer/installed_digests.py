"""The expected installed digests a sync delivers: an FP8 rank checks the bytes it will compute with (the
rule's values and row scales, `name:fp8` / `name:scale`, or its TP share of them) against the sender's own
application of the rule (bit-exact across devices) BEFORE its version goes live, so a rank that installed
other bytes is torn, never served. In a sync that delivers its digests (inference/transfer/delivery.py):
- step 1 (the plan agreement): a receiver that installs FP8 weights in this sync puts a 1 at slot T-1 of
  TP_SLOTS values (T: its TP size); the sender puts a 1 in one more value when it delivers them (its
  `check_installed`). The maxima tell every end the TP sizes asked for and whether the section follows.
- step 4: the section follows the sender's digests: a status byte (0: the digests follow; 1: the sender
  could not compute them and raises its error), then for each TP size asked (ascending), each FP8 linear of
  the manifest (in manifest order), each part (fp8, scale) and each TP rank, 16 bytes (delivery.py's form).
Every end derives the section's length from its manifest and the maxima: nothing else travels.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from inference.quant.fp8 import quantize_rows
from inference.quant.installed import FP8_SUFFIX, SCALE_SUFFIX, installed_part, is_fp8_linear, tp_share
from inference.transfer.delivery import DIGEST_BYTES
from inference.transfer.digests import RecordDigests
from inference.transfer.plan import TensorSpec

TP_SLOTS = 64  # the TP sizes a receiver can ask for (slot T-1); one more value says the sender delivers
PARTS = ("fp8", "scale")
_FOLLOW, _NONE = 0, 1
_BATCH_BYTES = 256 << 20  # shares digested per batch: the sender holds at most about this many quantized


def fp8_linears(specs: Sequence[TensorSpec]) -> tuple[str, ...]:
    """The HF names of a manifest's FP8 linears, in manifest order: a tensor `is_fp8_linear` selects, sent
    as it is (an FP8 rank quantizes it on receive) or as its FP8 payload (`name:fp8`, then `name:scale`)."""
    names = []
    for spec in specs:
        part = installed_part(spec.name)
        name = spec.name if part is None else part[0] if part[1] == "fp8" else None
        if name is not None and is_fp8_linear(name):
            names.append(name)
    return tuple(names)


def receiver_values(tp_size: int | None) -> list[int]:
    """A receiver's values of step 1: slot tp_size - 1 set when it installs FP8 weights at that TP size
    (None: it installs none). A TP size beyond TP_SLOTS cannot ask: its audit then fails for want of them."""
    values = [0] * (TP_SLOTS + 1)
    if tp_size is not None and 1 <= tp_size <= TP_SLOTS:
        values[tp_size - 1] = 1
    return values


def sender_values(delivers: bool) -> list[int]:
    """The sender's values of step 1: the last set when it delivers the section (to the ranks that ask)."""
    return [0] * TP_SLOTS + [int(delivers)]


@dataclass(frozen=True)
class SharesLayout:
    """One sync's section, as every end derives it: the FP8 linears and the TP sizes it covers."""

    names: tuple[str, ...] = ()
    sizes: tuple[int, ...] = ()

    @classmethod
    def agreed(cls, specs: Sequence[TensorSpec], maxima: Sequence[int]) -> SharesLayout:
        """From the sync's manifest (as sent: before a delta) and step 1's maxima of the values above;
        empty when the sender delivers nothing or no rank asked (the manifest is read only otherwise)."""
        assert len(maxima) == TP_SLOTS + 1, len(maxima)
        sizes = tuple(t + 1 for t in range(TP_SLOTS) if maxima[t])
        if not maxima[TP_SLOTS] or not sizes:
            return cls()
        names = fp8_linears(specs)
        return cls(names, sizes) if names else cls()

    @property
    def size(self) -> int:
        """The section's bytes in step 4's message (0: no section)."""
        return 1 + DIGEST_BYTES * self.entries if self.sizes else 0

    @property
    def entries(self) -> int:
        return len(PARTS) * len(self.names) * sum(self.sizes)

    def index(self, tp_size: int, i: int, part: str, tp_rank: int) -> int:
        """The entry of TP rank `tp_rank`'s share (at TP size `tp_size`) of part `part` of names[i]."""
        before = len(PARTS) * len(self.names) * sum(t for t in self.sizes if t < tp_size)
        return before + (i * len(PARTS) + PARTS.index(part)) * tp_size + tp_rank


@dataclass(frozen=True)
class RankExpectation:
    """What one rank must hold after the sync ({`name:fp8` / `name:scale`: digest}), or, in `missing`, why
    the sender delivered none for it (then nothing goes live)."""

    digests: dict[str, str] = field(default_factory=dict)
    missing: str | None = None


def failed_section(layout: SharesLayout) -> bytes:
    """The section of a sender that could not compute it: the ranks that asked for it fail their audit."""
    return bytes([_NONE]) + bytes(layout.size - 1) if layout.size else b""


def rank_expectation(section: bytes, layout: SharesLayout, tp_size: int, tp_rank: int) -> RankExpectation:
    """Rank `tp_rank` (of `tp_size`)'s expected installed digests out of step 4's section, for a rank that
    installs FP8 weights in a sync whose sender delivers them."""
    assert len(section) == layout.size, (len(section), layout.size)
    if tp_size not in layout.sizes:
        return RankExpectation(missing=f"the sender delivered no installed FP8 digests for TP size {tp_size} "
                               f"(it can deliver them for TP sizes up to {TP_SLOTS})")
    if section[0] != _FOLLOW:
        return RankExpectation(missing="the sender could not compute the installed FP8 digests it expects (the "
                               "trainer raises its error)")
    out = {}
    for i, name in enumerate(layout.names):
        for part in PARTS:
            at = 1 + DIGEST_BYTES * layout.index(tp_size, i, part, tp_rank)
            out[f"{name}:{part}"] = section[at : at + DIGEST_BYTES].hex()
    return RankExpectation(out)


class ExpectedShares:
    """The sender's side: each sync's section computed on a side thread while the bytes move. One per
    WeightSender (its RecordDigests launches from that thread alone)."""

    def __init__(self) -> None:
        self._digests = RecordDigests("installed-digest")
        self._pool: ThreadPoolExecutor | None = None

    def start(self, layout: SharesLayout, items: Sequence[tuple[str, torch.Tensor]], algorithm: str) -> Future[bytes]:
        """Start computing the section of `layout` from `items`, the tensors send() sends (a linear as it
        is, quantized here by the rule, or its FP8 payload, taken as it is), digested under `algorithm`.
        The tensors must stay unchanged until the future is done (send() waits for it)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="installed-digest")
        return self._pool.submit(self._section, layout, list(items), algorithm)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._digests.close()

    def _section(self, layout: SharesLayout, items: list[tuple[str, torch.Tensor]], algorithm: str) -> bytes:
        by_name = dict(items)
        entries: list[bytes] = [b""] * layout.entries
        batch: list[tuple[str, torch.Tensor]] = []
        where: list[list[int]] = []  # per batch item, the entries its digest fills
        held = 0
        with torch.no_grad():
            for i, name in enumerate(layout.names):
                if name + FP8_SUFFIX in by_name:  # quantized on send: the payload is what every rank installs
                    q, scale = by_name[name + FP8_SUFFIX], by_name[name + SCALE_SUFFIX]
                else:
                    q, scale = quantize_rows(by_name[name].detach(), name)
                for part, full in zip(PARTS, (q, scale)):
                    whole: int | None = None  # a share that is the whole tensor is digested once
                    for tp in layout.sizes:
                        for r in range(tp):
                            share = tp_share(full, name, part, tp, r)
                            at = whole if share is full else None
                            if at is None:
                                batch.append((f"{name}:{part}", share))
                                where.append([])
                                held += share.numel() * share.element_size()
                                at = len(batch) - 1
                                whole = at if share is full else whole
                            where[at].append(layout.index(tp, i, part, r))
                if held >= _BATCH_BYTES:
                    self._digest(batch, where, entries, algorithm)
                    held = 0
        self._digest(batch, where, entries, algorithm)
        return bytes([_FOLLOW]) + b"".join(entries)

    def _digest(self, batch: list[tuple[str, torch.Tensor]], where: list[list[int]], entries: list[bytes],
                algorithm: str) -> None:
        for record, places in zip(self._digests.digest(batch, algorithm), where):
            digest = bytes.fromhex(record.digest)
            assert len(digest) == DIGEST_BYTES, record
            for k in places:
                entries[k] = digest
        batch.clear()
        where.clear()
