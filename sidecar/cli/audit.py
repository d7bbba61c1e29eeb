"""`sidecar audit EXPECTED.json ACTUAL.json [MORE.json ...]`: compare checksum manifests.
`sidecar audit --url URL [--model target|draft] [--source held|received] [--algorithm RULE]
[EXPECTED.json | --checkpoint DIR]`: the same against a running sidecar.

The first file holds what was expected, every further file what a rank holds; any file may hold one
manifest, a JSON list of them, or a saved GET /checksums answer. One expected manifest applies to every
actual rank; several are matched by (model, rank key), and ranks found on only one side are reported.
A checkpoint's tensor names against a rank's fused parameters are refused (exit 2, naming --checkpoint).
With --url every rank's manifest is fetched (GET /checksums; held digests by the rule EXPECTED.json
names, or --algorithm, else each rank's), the ranks are compared with each other (sidecar/audit/rules.py),
and against EXPECTED.json or the checkpoint laid out as a rank holds it (sidecar/audit/checkpoint.py;
a sidecar synced since launch is said to hold another version). With neither, a sidecar without replicas
has nothing to compare: exit 2, never "OK". Exit status: 0 all match, 1 mismatch, 2 bad input, nothing to
compare or an unreachable sidecar (a one-line error on stderr).
checksum (and so torch) is imported inside the functions that need it, so that `sidecar audit --help`
stays fast (scripts/tools/check_help_speed.py).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from inference import envs
from inference.core import SidecarError
from sidecar.cli.common import one_line

if TYPE_CHECKING:
    from checksum import Manifest, Report

EXIT_OK, EXIT_MISMATCH, EXIT_BAD_INPUT = 0, 1, 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("expected", metavar="EXPECTED.json", nargs="?",
                        help="the expected manifest(s), e.g. the trainer's digests of what it sent "
                             "(optional with --url)")
    parser.add_argument("actual", metavar="ACTUAL.json", nargs="*",
                        help="one or more actual manifests (a file may hold a JSON list, one per rank)")
    parser.add_argument("--max-rows", type=int, default=50, metavar="N",
                        help="print at most N mismatch rows (0: all; default 50)")
    parser.add_argument("--url", default=None, help="fetch every rank's manifest from a running sidecar")
    parser.add_argument("--checkpoint", default=None, metavar="DIR",
                        help="with --url (held): check the ranks against this HF checkpoint directory, laid "
                             "out as the sidecar holds it (fused qkv_proj/gate_up_proj, TP shards, its dtype)")
    parser.add_argument("--model", choices=("target", "draft"), default="target", help="with --url (default target)")
    parser.add_argument("--source", choices=("held", "received"), default="held",
                        help="with --url: the weights held now, or what the last sync delivered (default held)")
    # No `choices=checksum.ALGORITHMS` here: importing checksum imports torch; run() checks the name.
    parser.add_argument("--algorithm", default=None, metavar="RULE",
                        help="with --url: the digest rule of the held weights, xxh3_128_seg64m (host) or "
                             "xxh3_64_seg64k (device) (default: the one EXPECTED.json names, else each rank's "
                             "own: the device rule on a GPU)")
    parser.add_argument("--api-key", default=None, help="with --url (default: $SIDECAR_API_KEY)")
    parser.add_argument("--timeout", type=float, default=300.0, help="with --url: seconds per request")


def run(args: argparse.Namespace) -> int:
    from checksum import ManifestError, Report, audit

    try:
        _check_arguments(args)
        expected = load_input(args.expected) if args.expected is not None else None
        actual = _actual_manifests(args, expected)
        if args.checkpoint is not None:
            from sidecar.audit.checkpoint import checkpoint_manifests

            expected = checkpoint_manifests(args.checkpoint, actual)
        elif expected is not None:
            _check_layouts(expected, actual)
        reports = [audit(expected, actual)] if expected is not None else []
        if args.url is not None and has_replicas(actual, args.source):
            from sidecar.audit.rules import replica_report

            reports.append(replica_report(actual, args.source))
        elif args.url is not None and expected is None:  # one rank compared with itself would say "OK"
            raise ManifestError("<command line>", "EXPECTED.json", _nothing_to_compare(args.url, actual))
        report = Report.merge(reports)
        if args.checkpoint is not None:
            report = _checkpoint_verdict(args, actual, report)
    except (ManifestError, SidecarError) as exc:
        print(f"sidecar audit: error: {one_line(exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    sys.stdout.write(report.table(max_rows=args.max_rows if args.max_rows > 0 else None))
    return EXIT_OK if report.ok else EXIT_MISMATCH


def _check_arguments(args: argparse.Namespace) -> None:
    """The combinations that cannot mean anything, refused before any file is read or request sent."""
    from checksum import ALGORITHMS, ManifestError

    def bad(field: str, message: str) -> ManifestError:
        return ManifestError("<command line>", field, message)

    if args.algorithm is not None and args.algorithm not in ALGORITHMS:
        raise bad("--algorithm", f"unknown digest rule {args.algorithm!r} (known: {', '.join(ALGORITHMS)})")
    if args.checkpoint is not None:
        if args.url is None:
            raise bad("--checkpoint", "needs --url: the checkpoint is laid out as the sidecar's ranks hold it")
        if args.expected is not None:
            raise bad("--checkpoint", "give EXPECTED.json or --checkpoint, not both")
        if args.source != "held":
            raise bad("--checkpoint", "describes held weights (the default --source); for --source received "
                                      "pass the sender's manifest of what it sent as EXPECTED.json")
    if args.expected is None and args.url is None:
        raise bad("EXPECTED.json", "give the expected manifest file (or --url)")


def _check_layouts(expected: list[Manifest], actual: list[Manifest]) -> None:
    """Refuse (exit 2) a comparison of one model in two layouts, which reads as a mismatch of every fused
    tensor: a checkpoint's (or a trainer's) tensor names against a rank's held parameters."""
    from checksum import ManifestError
    from inference.models.naming import hf_layout_of

    names = [({r.name for m in side for r in m.records}, label) for side, label in
             ((expected, "EXPECTED.json"), (actual, "the actual manifests"))]
    for (hf, hf_label), (ours, ours_label) in (names, names[::-1]):
        family = hf_layout_of(hf, ours)
        if family is not None:
            raise ManifestError("<command line>", "EXPECTED.json", (
                f"{hf_label} names a checkpoint's (a trainer's) tensors, {ours_label} a sidecar's held "
                f"parameters (fused qkv_proj / gate_up_proj, the {family} layout): one model in two layouts, "
                "whose names never match. Check a sidecar's held weights against a checkpoint with "
                "`sidecar audit --url URL --checkpoint DIR`; compare a trainer's manifest with what its sync "
                "delivered with `sidecar audit --url URL --source received EXPECTED.json`"))


def _checkpoint_verdict(args: argparse.Namespace, held: list[Manifest], report: Report) -> Report:
    """--checkpoint: a checkpoint carries no version (its manifests say v0), so a sidecar synced since
    launch whose bytes equal the checkpoint's passes, said in one line; one whose bytes differ gets the
    note that its weights are a trainer's before the report (_note_synced)."""
    from checksum import Report

    if report.mismatches and all(m.kind == "weight_version" for m in report.mismatches):
        live = ", ".join(f"v{v}" for v in sorted({m.weight_version for m in held}))
        print(f"the sidecar holds {args.model} {live}, and its bytes equal this checkpoint's (a checkpoint "
              "carries no version)")
        return Report.build([], report.ranks, report.tensors_checked)
    if not report.ok:
        _note_synced(args, held)
    return report


def _note_synced(args: argparse.Namespace, held: list[Manifest]) -> None:
    """--checkpoint on a sidecar synced since launch: its weights are a trainer's, so say that before the
    report's digest differences can read as corruption."""
    versions = sorted({m.weight_version for m in held if m.weight_version})
    if versions:
        live = ", ".join(f"v{v}" for v in versions)
        print(f"the sidecar holds {args.model} {live}: it was synced since launch, so it serves a trainer's "
              "weights, not the checkpoint (v0); their digests differ as different weights do, which is not "
              f"corruption. To audit those bytes: sidecar audit --url {args.url} --source received "
              "TRAINER_MANIFEST.json")


def has_replicas(actual: list[Manifest], source: str) -> bool:
    """Whether the replica rule (sidecar/audit/rules.py) compares any two manifests: "received" ones
    need two ranks, "held" ones two ranks holding the same shard (same model, pp and tp; dp differs)."""
    from checksum import parse_rank_key

    if source == "received":
        return len(actual) > 1
    shards = Counter((m.model, *parse_rank_key(m.rank)[1:]) for m in actual)
    return any(count > 1 for count in shards.values())


def _nothing_to_compare(url: str, actual: list[Manifest]) -> str:
    ranks = ", ".join(m.rank for m in actual) or "none"
    return (f"nothing to compare: no expected digests were given and the sidecar at {url} has no two ranks "
            f"that hold the same bytes (ranks: {ranks}); pass --checkpoint DIR (the checkpoint it serves) "
            "or EXPECTED.json (e.g. the trainer's manifest of what it sent, with --source received)")


def _actual_manifests(args: argparse.Namespace, expected: list[Manifest] | None = None) -> list[Manifest]:
    """Every actual manifest, in command-line order: the files, then the sidecar's ranks (--url)."""
    from checksum import ManifestError

    if not args.actual and args.url is None:
        raise ManifestError("<command line>", "ACTUAL.json", "give at least one actual manifest file")
    found = [m for path in args.actual for m in load_input(path)]
    if args.url is not None:
        found += _fetch(args, _url_algorithm(args, expected))
    return found


def _url_algorithm(args: argparse.Namespace, expected: list[Manifest] | None) -> str | None:
    """--algorithm, else the one rule the expected manifests name (held digests only: received ones are
    of the sync's rule, whatever is asked), else None (each rank's default)."""
    if args.algorithm is not None or args.source != "held" or not expected:
        return args.algorithm
    rules = {m.algorithm for m in expected}
    return rules.pop() if len(rules) == 1 else None


def load_input(path: str) -> list[Manifest]:
    """The manifests of one file named on the command line. Whatever reading it raises is bad input
    (exit 2, one line naming the file), never a traceback: checksum's loader means to raise only
    ManifestError, and a file that makes it raise anything else is still the user's file to fix,
    not a mismatch."""
    from checksum import ManifestError, load_manifests

    if str(path).endswith(".safetensors") or Path(path).is_dir():
        raise ManifestError(path, "<file>", "a checkpoint, not a checksum manifest: check a sidecar against it "
                                            "with `sidecar audit --url URL --checkpoint DIR`")
    try:
        return load_manifests(path)
    except ManifestError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
        raise ManifestError(path, "<file>", f"not a valid manifest ({type(e).__name__}: {e})") from e


def _fetch(args: argparse.Namespace, algorithm: str | None = None) -> list[Manifest]:
    from checksum import Manifest
    from sidecar.client import SidecarClient

    key = args.api_key or envs.API_KEY.get()
    with SidecarClient(args.url, api_key=key, timeout=args.timeout, retries=1) as client:
        dicts = client.checksums(args.model, args.source, algorithm)
    return [Manifest.from_dict(d, f"{args.url} rank {i}") for i, d in enumerate(dicts)]
