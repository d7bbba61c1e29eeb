"""The receiving end of the weight wire: one rank's membership in the group, and the steps of one sync.

Protocol of one sync (every rank walks it in the same order, so no collective can pair with the
wrong one): (1) ONE all-reduce agrees on the plan fingerprint (version, manifest, bucket size,
backend), followed by the backend's own keys and values (ipc: the key of its layout and the size of
its message): if any rank derived a different plan, all stop before a byte moves; (2) the bytes, as
the backend moves them (inference/transfer/backends/: one file per backend); (3) a status
all-reduce in which every receiver reports whether it unpacked everything: the sender's send()
returns only after it, so an ipc sender never overwrites memory a receiver still reads, and a
receiver's failure is reported to the trainer instead of passing silently; (4) only in a sync whose
sender delivers its digests (agreed in step 1): one broadcast of them (inference/transfer/delivery.py),
taken with `sender_digests` once the rank is ready to compare, with this rank's expected installed FP8
digests when step 1 agreed on them (inference/transfer/installed_digests.py). A session negotiated with delta syncs
(`InitInfo.delta`) puts the offer before (1): one all-max that decides delta or full
(inference/transfer/delta.py); a delta then walks (1)-(4) as a sync of one uint8 tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from inference.transfer.backends import check_backend
from inference.transfer.backends.base import Sink, TransferBackend, backend_class
from inference.transfer.delivery import PLAN_SUFFIX, delivery_size, post_digests, read_digests
from inference.transfer.delta import (
    DeltaSink,
    SliceTable,
    delta_regions,
    offer_agreed,
    offer_slices,
    offer_values,
    slice_values,
)
from inference.transfer.delta_codec import CODES, DeltaLayout
from inference.transfer.groups import InitInfo, TransferError, TransferGroup, owner_key
from inference.transfer.installed_digests import (
    RankExpectation,
    SharesLayout,
    rank_expectation,
    receiver_values,
)
from inference.transfer.plan import ParsedManifest, TensorSpec

Share = tuple[int, int]  # (TP size, TP rank) of a rank that installs FP8 weights


class WeightReceiver:
    """One receiver rank of one transfer session. Joining blocks until every rank has joined.
    `backend`: this rank's end of the session's backend (built from the registry by its name)."""

    def __init__(self, info: InitInfo, rank: int, device: torch.device, rank_key: str) -> None:
        spec = check_backend(info.backend, "init_info.backend")
        self.info = info
        self.rank_key = rank_key
        self.device = device
        label = f"rank {rank_key}"
        self.backend: TransferBackend = backend_class(spec)(spec, device, label, info.bucket_bytes)
        self.backend.check_device()
        self.group = TransferGroup(info, rank, device, label=label, data_plane=self.backend.data_plane)
        self._owed: Callable[[], bytes] | None = None  # a posted step 4 not taken yet (sender_digests)
        # what that step 4 carries: the manifest's tensor count, the installed section, and this rank's share
        # of it when it asked and the sender delivers (else None)
        self._owed_layout: tuple[int, SharesLayout, Share | None] = (0, SharesLayout(), None)
        self.last_delta: DeltaSink | None = None  # the last sync's delta sink (None: it was full)
        self._picks: list[int] | None = None  # a delta into slices: this rank's digests among the delivered
        self.full_digests: list[str] | None = None  # then: the sender's digests of the full tensors

    @property
    def broken(self) -> str | None:
        return self.group.broken

    def close(self) -> None:
        self.backend.close()
        self.group.close()

    def receive(self, version: int, specs: ParsedManifest | Sequence[TensorSpec], sink: Sink,
                on_agreed: Callable[[], None] | None = None, *, digests_follow: bool = False,
                held_version: int = -1, owner: str | None = None, installed: Share | None = None) -> None:
        """Receive one whole sync into `sink`. Raises TransferError (group broken) or the sink's error.

        `on_agreed` runs once both ends agreed on the plan, just before the first byte may be written.
        `digests_follow`: the sender delivers its digests after the bytes (step 4): once this returns,
        call `sender_digests` (every end takes part in it, or the group's next collective mismatches).
        `held_version`: in a delta session, the version this rank holds intact (-1: none), offered as
        the base a delta may be applied to; a sink without a region for every tensor offers -1, and so
        does one that holds slices in a sync without `digests_follow` (their digests come only so).
        `owner`: the update's owner (groups.owner_key); a sender that names another is refused.
        `installed`: (TP size, TP rank) when this rank installs FP8 weights in this sync: it asks the
        sender for its expected installed digests (sender_digests returns them).
        """
        if self._owed is not None:  # the last sync's step 4 was never taken: let it end before this sync
            owed, self._owed = self._owed, None
            owed()
        parsed = specs if isinstance(specs, ParsedManifest) else ParsedManifest(specs)
        whole = parsed  # the installed digests are of the full tensors, a delta or not
        tensors = len(parsed)  # the digests delivered: the full tensors', then those of a delta's slices
        self.last_delta, self._picks, self.full_digests = None, None, None
        if self.info.delta:
            parsed, sink, tensors = self._delta(parsed, sink, held_version, digests_follow)
        plan_id = self.backend.plan_id() + (PLAN_SUFFIX if digests_follow else "")
        fingerprint = parsed.fingerprint(version, self.info.bucket_bytes, plan_id)
        keys, values = self.backend.receiver_agreement()
        assert (len(keys), len(values)) == self.backend.agreement_size, "every end adds the same to step 1"
        asks = receiver_values(installed[0] if installed is not None else None)
        same, maxima = self.group.agree_many([fingerprint, owner_key(owner), *keys], [*values, *asks])
        maxima, agreed = maxima[:len(values)], maxima[len(values):]
        if not same[1]:
            raise TransferError(f"rank {self.rank_key}: the sender's bytes are not this update's owner's (the "
                                "sender names another session's nonce: another trainer's send, or an update "
                                "another init replaced); nothing was written")
        if not same[0]:
            raise TransferError(f"rank {self.rank_key}: the sender's plan (version, manifest, bucket size, whether "
                                "it delivers its digests in the sync, or the backend's release) differs from "
                                f"this rank's for version {version}; nothing was written")
        plan = self.backend.plan(parsed)
        if on_agreed is not None:
            on_agreed()
        self.backend.receive(self.group, plan, parsed, sink, same[2:], maxima)
        if digests_follow:
            layout = SharesLayout.agreed(whole, agreed)
            self._owed = post_digests(self.group, tensors, layout.size)
            self._owed_layout = (tensors, layout, installed if agreed[-1] else None)

    def sender_digests(self, algorithm: str) -> tuple[dict[str, Any], RankExpectation | None]:
        """Step 4 of a sync received with digests_follow (posted when receive returned): the sender's digests
        as finish takes them ({"algorithm", "digests"}: per manifest tensor, of what this rank holds of it), and
        this rank's expected installed digests (None: the sender delivers none, or this rank asked for none).
        StateError when the sender had no digests; TransferError (the group broken) on the wire."""
        owed, self._owed = self._owed, None
        assert owed is not None, "sender_digests without a sync received with digests_follow"
        n, layout, share = self._owed_layout
        message = owed()
        size = delivery_size(n)
        got = read_digests(message[:size], algorithm, self.rank_key)
        if self._picks is not None:
            self.full_digests = got["digests"][:len(self._picks)]
            got["digests"] = [got["digests"][j] for j in self._picks]
        if share is None:
            return got, None
        return got, rank_expectation(message[size:], layout, *share)

    def _delta(self, parsed: ParsedManifest, sink: Sink, held_version: int,
               digests_follow: bool) -> tuple[ParsedManifest, Sink, int]:
        """The offer of a delta session (inference/transfer/delta.py): (what this sync moves, where it
        lands, how many digests the sender delivers): the delta's one tensor into a DeltaSink, or, when
        some end offered another version, the manifest into `sink`."""
        n = len(parsed)
        regions = delta_regions(sink)
        sliced = regions is not None and any(sl is not None for _, sl in regions)
        base = held_version if regions is not None and (digests_follow or not sliced) else -1
        got = self.group.all_max(offer_values(base, sliced), "delta offer")
        if not offer_agreed(got):
            return parsed, sink, n
        assert regions is not None  # this rank offered a version: it has them
        receivers = self.info.world_size - 1
        mine = slice_values([sl for _, sl in regions], self.group.rank, receivers) if offer_slices(got) else []
        values = self.group.all_max([0] * (CODES * n) + mine, "delta codes")
        layout = DeltaLayout.from_codes(parsed, values[:CODES * n])
        delivered = n
        if offer_slices(got):
            table = SliceTable.from_values(values[CODES * n:], n, receivers)
            self._picks, delivered = table.digest_indices(self.group.rank), n + len(table.distinct)
        self.last_delta = DeltaSink(sink, regions, parsed, layout, self.device)  # type: ignore[arg-type]
        return layout.wire_specs(), self.last_delta, delivered

    def refuse(self) -> None:
        """Take part in step (1) of a sync this rank cannot receive, with the fingerprint that never
        agrees (0): every end then stops before a byte moves and the group stays usable, so a sender
        already waiting in the agreement fails at once instead of at its timeout. In a delta session the
        offer comes first, where this rank offers no version (so no delta's codes follow)."""
        if self.info.delta:
            self.group.all_max(offer_values(-1), "delta offer")
        keys, values = self.backend.receiver_agreement()
        self.group.agree_many([0, 0, *keys], [*values, *receiver_values(None)])
