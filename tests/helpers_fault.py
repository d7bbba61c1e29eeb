"""Fault injection for the audit tests: one tensor's first byte flipped as it arrives at a rank's sink.

In this process, `flipped_on_arrival(name)` patches UpdateTarget (the receiver's sink) for the `with` block.
A sidecar subprocess gets the same patch from tests/fault_injection/sitecustomize.py: `flip_env(name)` is
the environment that loads it there (Python imports sitecustomize from PYTHONPATH at start).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

FLIP_VARIABLE = "TEST_FLIP_ON_ARRIVAL"  # these five are read only by tests/fault_injection/sitecustomize.py
FLIP_RANK_VARIABLE = "TEST_FLIP_RANK"
FLIP_TIMES_VARIABLE = "TEST_FLIP_TIMES"
SKEW_VARIABLE = "TEST_SKEW_INSTALLED"
SKEW_RANK_VARIABLE = "TEST_SKEW_RANK"
_SITE = Path(__file__).resolve().parent / "fault_injection"


def _flipped(tensor: torch.Tensor) -> torch.Tensor:
    """A copy with one bit of its first byte flipped (the received buffer itself is left alone)."""
    out = tensor.clone()
    if out.numel():
        out.view(-1).view(torch.uint8)[:1].bitwise_xor_(1)
    return out


def patch_sink(monkeypatch: pytest.MonkeyPatch, name: str, rank: str | None = None, times: int | None = None) -> None:
    """Every UpdateTarget (of rank key `rank` only, if given) flips tensor `name` on arrival, in its
    first `times` syncs (every sync if None): it is taken off the backends' direct copies, so it comes
    through put(), which receives the flipped copy."""
    from inference.weights.target import UpdateTarget

    direct, put = UpdateTarget.direct_destinations, UpdateTarget.put
    syncs = [0]  # the UpdateTargets (one per sync) that chose to flip so far

    def flips(target: UpdateTarget) -> bool:
        chosen = target.__dict__.get("_test_flips")
        if chosen is None:  # the sync's first call decides for the whole sync
            chosen = (rank is None or target.rank == rank) and (times is None or syncs[0] < times)
            syncs[0] += chosen
            target.__dict__["_test_flips"] = chosen
        return bool(chosen)

    def direct_destinations(self: UpdateTarget) -> Sequence[torch.Tensor | None]:
        if not flips(self):
            return direct(self)
        return tuple(None if r.spec.name == name else d for r, d in zip(self.routes, direct(self)))

    def flipping_put(self: UpdateTarget, items: Sequence[tuple[int, torch.Tensor]]) -> None:
        if not flips(self):
            put(self, items)
            return
        put(self, [(i, _flipped(t) if self.routes[i].spec.name == name else t) for i, t in items])

    monkeypatch.setattr(UpdateTarget, "direct_destinations", direct_destinations)
    monkeypatch.setattr(UpdateTarget, "put", flipping_put)


@contextmanager
def flipped_on_arrival(name: str) -> Iterator[None]:
    """Inside: tensor `name` arrives with a flipped byte at every rank of this process."""
    with pytest.MonkeyPatch.context() as mp:
        patch_sink(mp, name)
        yield


def flip_env(name: str, rank: str | None = None, times: int | None = None) -> dict[str, str]:
    """The environment of a subprocess whose ranks (rank key `rank` only, if given) flip tensor `name` on
    arrival, in their first `times` syncs (every sync if None)."""
    path = os.pathsep.join(p for p in (str(_SITE), str(_SITE.parent.parent), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, FLIP_VARIABLE: name, FLIP_RANK_VARIABLE: rank or "",
            FLIP_TIMES_VARIABLE: "" if times is None else str(times)}


def skew_installed(monkeypatch: pytest.MonkeyPatch, name: str, rank: str | None = None) -> None:
    """An FP8 rank (of rank key `rank` only, if given) quantizes HF tensor `name` from a copy whose last
    element is negated (it lies in the last TP rank's share, whichever dimension the ranks split): it
    installs bytes the rule does not give for what it received (that value's sign bit), and stays
    consistent with itself (its received digest is of the true bytes, its installed audit compares with
    what it quantized), so only a check against the rule applied elsewhere (the sender's) tells."""
    from inference.weights.installed import InstalledAudit

    put = InstalledAudit.put

    def skewed(tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.clone()
        out.view(-1)[-1:].neg_()
        return out

    def skewed_put(self: InstalledAudit, items: Sequence[tuple]) -> None:
        if rank is not None and self.rank != rank:
            put(self, items)
            return
        put(self, [(spec, param, shard, skewed(t) if spec.name == name else t) for spec, param, shard, t in items])

    monkeypatch.setattr(InstalledAudit, "put", skewed_put)


def skew_env(name: str, rank: str | None = None) -> dict[str, str]:
    """The environment of a subprocess whose FP8 ranks (of rank key `rank` only, if given) install tensor
    `name` skewed (skew_installed)."""
    path = os.pathsep.join(p for p in (str(_SITE), str(_SITE.parent.parent), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, SKEW_VARIABLE: name, SKEW_RANK_VARIABLE: rank or ""}


def flip_held_after_landing(monkeypatch: pytest.MonkeyPatch, weights: object, param: torch.Tensor) -> None:
    """The first byte of `param` flips after the sync's bytes landed, just before the rank digests the
    weights it holds (a stray write into a live parameter): `weights` is the rank's WeightUpdater."""
    real = weights._launch_held_digest  # type: ignore[attr-defined]

    def flip_then_digest(session: object) -> None:
        if session.held_digests is None:  # type: ignore[attr-defined]  # once: a second flip would undo it
            param.detach().view(-1)[:1].view(torch.uint8)[:1].bitwise_xor_(1)
        real(session)

    monkeypatch.setattr(weights, "_launch_held_digest", flip_then_digest)


def flip_delta_values(monkeypatch: pytest.MonkeyPatch, name: str, rank: str | None = None) -> None:
    """Every delta that reaches a rank's sink (of rank key `rank` only, if given) has one bit of each value
    of tensor `name` flipped (its indices intact) just before it is applied: a delta corrupted on the wire."""
    from inference.transfer.delta import DeltaSink
    from inference.transfer.delta_codec import DENSE, INDEX, UNCHANGED, index_width

    real = DeltaSink.landed

    def flipping_landed(self: DeltaSink) -> None:
        if not self._applied and (rank is None or self._sink.rank == rank):  # type: ignore[attr-defined]
            i = [s.name for s in self._specs].index(name)
            spec, entry = self._specs[i], self.layout.entries[i]
            if entry.enc != UNCHANGED:
                heads = {DENSE: 0, INDEX: entry.a}.get(entry.enc, 2 * entry.a) * index_width(spec.numel)
                count = {DENSE: spec.numel, INDEX: entry.a}.get(entry.enc, entry.b)
                item, start = spec.torch_dtype.itemsize, entry.offset + (heads + 7) // 8 * 8
                self._buffer[start:start + count * item:item].bitwise_xor_(1)
        real(self)

    monkeypatch.setattr(DeltaSink, "landed", flipping_landed)
