"""Comparing manifests: one rank, several ranks, and the report that names the first mismatch.

Canonical order of mismatches (so "the first mismatch" is well defined and stable): by rank
(dp, pp, tp numerically), then model (target before draft), then rank- and manifest-level problems,
then tensor name, then kind in KINDS order. A tensor's digest does not cover its dtype or shape, so
dtype and shape are compared on their own: same bytes under another shape is still a mismatch.
Manifests of two different algorithms have incomparable digests: that is one "algorithm" mismatch
naming both, and their digests are not compared (names, dtypes and shapes still are).
A torn actual manifest (a sync failed after its first byte may have been written) is always a "torn"
mismatch, even where every digest matches: those bytes are not the weight version the manifest names.
`Report.cause` tells the reader what a failed audit means, and the summary says it: other weights (a
weight_version mismatch: digests of two versions differ, as they should) are not corrupted bytes (digests
that differ at the same version).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from checksum.digest import TensorRecord
from checksum.errors import ChecksumError, ManifestError
from checksum.manifest import MODELS, Manifest, parse_rank_key

# Rank-level, then manifest-level, then per-tensor kinds; the order is part of the canonical order.
KINDS = (
    "missing_rank", "extra_rank", "torn", "algorithm", "model", "weight_version",
    "missing", "extra", "dtype", "shape", "digest",
)
_TENSOR_KINDS = frozenset(("missing", "extra", "dtype", "shape", "digest"))
_FIELDS = operator.attrgetter("name", "dtype", "shape", "digest")


@dataclass(frozen=True)
class Mismatch:
    """One difference. `tensor` is "" for rank- and manifest-level kinds; "-" means absent."""

    kind: str
    rank: str
    model: str
    tensor: str
    expected: str
    actual: str

    def __post_init__(self) -> None:
        assert self.kind in KINDS, f"unknown mismatch kind {self.kind!r}"

    def describe(self) -> str:
        where = f"rank {self.rank} ({self.model})"
        subject = f"tensor {self.tensor!r}" if self.tensor else "manifest"
        if self.kind == "missing":
            return f"{subject} missing on {where} (expected {self.expected})"
        if self.kind == "extra":
            return f"unexpected {subject} on {where} ({self.actual})"
        if self.kind == "missing_rank":
            return f"no manifest for {where} (expected {self.expected})"
        if self.kind == "extra_rank":
            return f"unexpected manifest for {where} ({self.actual})"
        if self.kind == "torn":
            return (f"the model on {where} is torn ({self.actual}): it holds no weight version (a re-sync "
                    "heals it)")
        if self.kind == "algorithm":
            return (f"algorithm of manifest on {where}: expected {self.expected}, got {self.actual} "
                    "(digests of different algorithms cannot be compared: digest both sides with one)")
        return f"{self.kind} of {subject} on {where}: expected {self.expected}, got {self.actual}"

    def sort_key(self) -> tuple[object, ...]:
        model = MODELS.index(self.model) if self.model in MODELS else len(MODELS)
        level = self.kind in _TENSOR_KINDS  # rank- and manifest-level problems first
        return (_rank_order(self.rank), model, level, self.tensor, KINDS.index(self.kind))


class ChecksumMismatch(ChecksumError, ValueError):
    """An audit found a difference; `report` holds every mismatch, the message names the first one."""

    def __init__(self, report: Report) -> None:
        assert not report.ok, "ChecksumMismatch needs a failing report"
        super().__init__(report.summary())
        self.report = report


@dataclass(frozen=True)
class Report:
    """The outcome of an audit. `mismatches` is in canonical order; `ok` iff there are none."""

    mismatches: tuple[Mismatch, ...]
    ranks: tuple[str, ...]  # every rank key looked at, in canonical order
    tensors_checked: int  # expected tensors compared, over all ranks

    @classmethod
    def build(cls, mismatches: Iterable[Mismatch], ranks: Iterable[str], tensors_checked: int) -> Report:
        # a fact two rules found (a torn rank: its replicas' and the expected digests') is listed once
        return cls(tuple(sorted(set(mismatches), key=Mismatch.sort_key)),
                   tuple(sorted(set(ranks), key=_rank_order)), tensors_checked)

    @classmethod
    def merge(cls, reports: Iterable[Report]) -> Report:
        reports = list(reports)
        return cls.build((m for r in reports for m in r.mismatches), (k for r in reports for k in r.ranks),
                         sum(r.tensors_checked for r in reports))

    @property
    def ok(self) -> bool:
        return not self.mismatches

    @property
    def first(self) -> Mismatch | None:
        return self.mismatches[0] if self.mismatches else None

    @property
    def first_tensor(self) -> Mismatch | None:
        """The first mismatch that names a tensor (skips rank- and manifest-level ones)."""
        return next((m for m in self.mismatches if m.tensor), None)

    @property
    def cause(self) -> str | None:
        """What the mismatches mean, the first that applies: None (ok); "torn" (a rank holds no version);
        "algorithm" (digests of two rules); "version" (the two sides are different weight versions, so
        their digests differ as different weights do: not corruption); "layout" (only names, dtypes or
        shapes differ: two layouts of the weights, e.g. a checkpoint's tensors against a rank's fused
        parameters); "bytes" (same version and layout, other digests: the bytes are not the ones expected)."""
        kinds = {m.kind for m in self.mismatches}
        if not kinds:
            return None
        for kind, cause in (("torn", "torn"), ("algorithm", "algorithm"), ("weight_version", "version")):
            if kind in kinds:
                return cause
        return "bytes" if "digest" in kinds else "layout"

    def summary(self) -> str:
        """One line: the verdict; on failure the first mismatch, and the first tensor if that differs,
        then what the mismatches mean (`cause`) when that is not plain from the first."""
        ranks = f"{len(self.ranks)} rank{'s' if len(self.ranks) != 1 else ''}"
        if self.ok:
            return f"OK: {self.tensors_checked} tensors on {ranks} match"
        assert self.first is not None
        cause = self.cause
        head = "different weight version, not corrupted bytes" if cause == "version" else "checksum mismatch"
        text = f"{head}: {self.first.describe()}"
        tensor = self.first_tensor
        if tensor is not None and tensor is not self.first:
            text += f"; first tensor: {tensor.describe()}"
        bad_ranks = len({m.rank for m in self.mismatches})
        count = f"{len(self.mismatches)} mismatch{'es' if len(self.mismatches) != 1 else ''}"
        text += f" [{count} on {bad_ranks} of {ranks}]"
        if cause == "version":
            digests = sum(m.kind == "digest" for m in self.mismatches)
            text += f"; digests of two versions differ as different weights do ({digests} tensors here)"
        elif cause == "bytes":
            text += "; same weight version: these bytes are not the ones expected (corrupted or written outside a sync)"
        return text

    def table(self, max_rows: int | None = None) -> str:
        """An aligned plain-text table of the mismatches (at most `max_rows`), then the summary."""
        if self.ok:
            return self.summary() + "\n"
        shown = self.mismatches if max_rows is None else self.mismatches[:max_rows]
        header = ("RANK", "MODEL", "KIND", "TENSOR", "EXPECTED", "ACTUAL")
        rows = [header] + [(m.rank, m.model, m.kind, m.tensor or "-", m.expected, m.actual) for m in shown]
        widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
        lines = ["  ".join([*(c.ljust(w) for c, w in zip(row, widths)), row[-1]]) for row in rows]
        if len(shown) < len(self.mismatches):
            lines.append(f"... and {len(self.mismatches) - len(shown)} more")
        lines.append(self.summary())
        return "\n".join(lines) + "\n"

    def check(self) -> None:
        """Raise ChecksumMismatch (its message names the first mismatch) unless the report is ok."""
        if not self.ok:
            raise ChecksumMismatch(self)


def compare(expected: Manifest, actual: Manifest) -> Report:
    """Compare one rank's manifest with what was expected; mismatches name `actual.rank`."""
    rank, model = actual.rank, expected.model
    found: list[Mismatch] = []
    if actual.torn:
        found.append(Mismatch("torn", rank, model, "", f"weight version {expected.weight_version}",
                              str(actual.torn_reason)))
    same_algorithm = expected.algorithm == actual.algorithm
    if not same_algorithm:
        found.append(Mismatch("algorithm", rank, model, "", expected.algorithm, actual.algorithm))
    if expected.model != actual.model:
        found.append(Mismatch("model", rank, model, "", expected.model, actual.model))
    if expected.weight_version != actual.weight_version:
        found.append(Mismatch("weight_version", rank, model, "",
                              str(expected.weight_version), str(actual.weight_version)))
    if not found and _same_records(expected.records, actual.records):
        return Report.build((), [rank], len(expected.records))  # the common case, decided in bulk
    want, have = expected.by_name(), actual.by_name()
    for name in sorted(want.keys() | have.keys()):
        e, a = want.get(name), have.get(name)
        if a is None:
            assert e is not None
            found.append(Mismatch("missing", rank, model, name, _describe(e), "-"))
        elif e is None:
            found.append(Mismatch("extra", rank, model, name, "-", _describe(a)))
        else:
            found.extend(_compare_records(rank, model, e, a, digests=same_algorithm))
    return Report.build(found, [rank], len(want))


def compare_each(expected: Manifest, actuals: Sequence[Manifest]) -> Report:
    """One expected manifest (the sender's full tensors) against every rank that received it."""
    _index(actuals, "actual")
    return Report.merge(compare(expected, a) for a in actuals)


def compare_ranks(expected: Sequence[Manifest], actuals: Sequence[Manifest]) -> Report:
    """Per-rank expectations: manifests are matched by (model, rank key); unmatched ones are reported."""
    want, have = _index(expected, "expected"), _index(actuals, "actual")
    reports, found = [], []
    for key in sorted(want.keys() | have.keys(), key=lambda k: (_rank_order(k[1]), k[0])):
        model, rank = key
        e, a = want.get(key), have.get(key)
        if a is None:
            assert e is not None
            found.append(Mismatch("missing_rank", rank, model, "", f"{len(e.records)} tensors", "-"))
        elif e is None:
            found.append(Mismatch("extra_rank", rank, model, "", "-", f"{len(a.records)} tensors"))
        else:
            reports.append(compare(e, a))
    ranks = [k[1] for k in want.keys() | have.keys()]
    return Report.merge([*reports, Report.build(found, ranks, 0)])


def audit(expected: Sequence[Manifest], actuals: Sequence[Manifest]) -> Report:
    """The `sidecar audit` rule: one expected manifest applies to every actual rank (the sender's
    digests); several expected manifests are matched to the actual ones by (model, rank key)."""
    if not expected:
        raise ValueError("audit needs at least one expected manifest")
    if len(expected) == 1:
        return compare_each(expected[0], actuals)
    return compare_ranks(expected, actuals)


def _same_records(expected: Sequence[TensorRecord], actual: Sequence[TensorRecord]) -> bool:
    """Whether every record is equal field by field, in C-level passes: both are sorted by name with
    unique names (a Manifest's invariant), so equal lists mean no tensor is missing, extra or differs."""
    return list(map(_FIELDS, expected)) == list(map(_FIELDS, actual))


def _compare_records(rank: str, model: str, e: TensorRecord, a: TensorRecord, *, digests: bool) -> list[Mismatch]:
    out = []
    if e.dtype != a.dtype:
        out.append(Mismatch("dtype", rank, model, e.name, e.dtype, a.dtype))
    if e.shape != a.shape:
        out.append(Mismatch("shape", rank, model, e.name, _shape(e.shape), _shape(a.shape)))
    if digests and e.digest != a.digest:
        out.append(Mismatch("digest", rank, model, e.name, e.digest, a.digest))
    return out


def _index(manifests: Sequence[Manifest], side: str) -> dict[tuple[str, str], Manifest]:
    by_key: dict[tuple[str, str], Manifest] = {}
    for i, m in enumerate(manifests):
        key = (m.model, m.rank)
        if key in by_key:
            raise ManifestError(side, f"manifests[{i}].rank", f"second {side} manifest for rank {m.rank} "
                                f"({m.model})")
        by_key[key] = m
    return by_key


def _rank_order(rank: str) -> tuple[int, ...]:
    try:
        return parse_rank_key(rank)
    except ValueError:
        return (1 << 62,)  # not a rank key (cannot happen for validated manifests): sort last


def _shape(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def _describe(record: TensorRecord) -> str:
    return f"{record.dtype}{_shape(record.shape)}"
