"""GET /checksums and POST /audit: every rank's manifest, compared across ranks and with expectations.

Two sources per rank (docs/checksums.md): "held" digests the parameters the rank holds now (its
shards, engine names); "received" is what the last finished sync delivered (full tensors, trainer
names). The replica rule is sidecar/audit/rules.py. `expected` adds the sidecar-audit rule
(checksum.audit): one expected manifest (or a list of the sender's records) applies to every rank,
several are matched by rank key.

Torn models: the torn flag and version are the WeightUpdater's, read with the manifest in the same
rank command, so /state, /checksums and /audit cannot disagree. A manifest of a torn model carries
`torn: true` and `torn_reason` (its weight_version is the last good version, which these bytes are NOT),
and an audit of a torn model is not ok, its summary naming each torn rank and why, whatever the digests.
Which digest rule each route uses: `add_audit_routes`.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Literal

from fastapi import APIRouter

from checksum import ALGORITHMS, Manifest, ManifestError, Report, audit
from inference.core import InvalidRequestError
from inference.transfer.digests import sender_records
from sidecar.api.common import ApiError, ServerState, call
from sidecar.api.models import AuditRequest
from sidecar.audit.rules import replica_report
from sidecar.ranks.commands import ReadManifest

MAX_MISMATCH_ROWS = 1000


def add_audit_routes(router: APIRouter, state: ServerState) -> None:
    """The two routes. Digest rule (docs/checksums.md): "held" manifests are digested by the rank's default
    (the device rule on a GPU) or by `algorithm` (a query parameter of both routes); POST /audit with no
    `algorithm` follows the rule its expected manifest(s) name, so a manifest of either rule is checked
    against digests of its own rule. "received" digests are of the rule the sync's sender picked.
    Manifests of two rules compared anyway give one "algorithm" mismatch naming both."""
    @router.get("/checksums", summary="Every rank's manifest of the target or draft model")
    async def checksums(model: Literal["target", "draft"] = "target", source: Literal["held", "received"] = "held",
                        algorithm: str | None = None) -> dict[str, Any]:
        manifests = await rank_manifests(state, model, source, _checked(algorithm))
        return {"model": model, "source": source, "manifests": [m.to_dict() for m in manifests]}

    @router.post("/audit", summary="Compare ranks (replicas) and, optionally, expected digests")
    async def audit_endpoint(body: AuditRequest, algorithm: str | None = None) -> dict[str, Any]:
        t0 = time.perf_counter()
        rule = _checked(algorithm) or (expected_algorithm(body.expected) if body.source == "held" else None)
        actual = await rank_manifests(state, body.model, body.source, rule)
        report = audit_manifests(actual, body.expected, body.source)
        out = report_dict(report, body.model, body.source)  # a torn rank is a "torn" mismatch: not ok
        out["torn"] = {m.rank: m.torn_reason for m in actual if m.torn}
        if not out["ok"]:
            state.metrics.audit_failures.inc()
        out["algorithm"] = actual[0].algorithm if actual else None
        state.metrics.sync_seconds.labels(body.model, "audit").observe(time.perf_counter() - t0)
        return out


async def rank_manifests(state: ServerState, model: Literal["target", "draft"], source: Literal["held", "received"],
                         algorithm: str | None = None) -> list[Manifest]:
    return await call(state, ReadManifest(model, source, algorithm))


def _checked(algorithm: str | None) -> str | None:
    if algorithm is not None and algorithm not in ALGORITHMS:
        raise ApiError(400, "InvalidRequestError", f"unknown checksum algorithm {algorithm!r} (supported: "
                       f"{', '.join(map(repr, ALGORITHMS))})", "algorithm")
    return algorithm


def expected_algorithm(expected: Any) -> str | None:
    """The rule that expected manifest(s) name when they are manifests that all name one; else None
    (sender records name none)."""
    if isinstance(expected, dict):
        items = [expected] if "format" in expected else expected.get("tensors")
    else:
        items = expected
    if not isinstance(items, list) or not items or not all(isinstance(x, dict) and "format" in x for x in items):
        return None
    rules = {x.get("algorithm") for x in items}
    rule = rules.pop() if len(rules) == 1 else None
    return rule if rule in ALGORITHMS else None


def audit_manifests(actual: list[Manifest], expected: Any, source: str) -> Report:
    reports = [replica_report(actual, source)]
    if expected is not None:
        manifests = parse_expected(expected, actual[0])
        try:
            reports.append(audit(manifests, actual))
        except ManifestError as e:  # e.g. two expected manifests for one rank
            raise ApiError(400, "ManifestError", str(e), "expected") from None
    return Report.merge(reports)


def parse_expected(expected: Any, reference: Manifest) -> list[Manifest]:
    """Manifest dict(s), or the sender's records (name, dtype, shape, digest) -> expected manifests."""
    try:
        if isinstance(expected, dict) and "format" in expected:
            return [Manifest.from_dict(expected, "expected")]
        items = expected.get("tensors") if isinstance(expected, dict) else expected
        if isinstance(items, list) and items and all(isinstance(x, dict) and "format" in x for x in items):
            return [Manifest.from_dict(x, f"expected[{i}]") for i, x in enumerate(items)]
        if not isinstance(items, list):
            raise ApiError(400, "InvalidRequestError", "must be a manifest, a list of manifests, or a list of "
                           "records {name, dtype, shape, digest}", "expected")
        try:
            records = sender_records(items, "expected")  # the parser a rank's finish uses too
        except InvalidRequestError as e:
            raise ApiError(400, "InvalidRequestError", e.message, e.field) from None
        # Records name no rule: they are the sender's digests of the sync, so of the actual manifests' rule,
        # unless the dict around them names one.
        algorithm = reference.algorithm
        if isinstance(expected, dict):
            algorithm = expected.get("algorithm", algorithm)
        return [Manifest(reference.model, reference.weight_version, reference.rank, tuple(records), algorithm)]
    except ManifestError as e:
        raise ApiError(400, "ManifestError", str(e), "expected") from None


def report_dict(report: Report, model: str, source: str) -> dict[str, Any]:
    return {
        "ok": report.ok, "model": model, "source": source, "summary": report.summary(),
        "cause": report.cause,  # what a failed audit means: other weights ("version") or bad bytes ("bytes")
        "table": report.table(max_rows=50), "ranks": list(report.ranks), "tensors_checked": report.tensors_checked,
        "mismatch_count": len(report.mismatches),
        "mismatches": [dataclasses.asdict(m) for m in report.mismatches[:MAX_MISMATCH_ROWS]],
    }
