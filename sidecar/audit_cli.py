"""`sidecar audit EXPECTED.json ACTUAL.json [MORE.json ...]`: compare checksum manifests.

The first file holds what was expected, every further file what a rank holds. Any file may hold
one manifest or a JSON list of them (one per rank). One expected manifest applies to every actual
rank (the trainer's digests of what it sent); several are matched to the actual ones by (model,
rank key), and ranks found on only one side are reported. Exit status: 0 all match, 1 mismatch,
2 bad input (a one-line error on stderr).
"""

from __future__ import annotations

import argparse
import sys

from checksum import Manifest, ManifestError, audit, load_manifests

EXIT_OK, EXIT_MISMATCH, EXIT_BAD_INPUT = 0, 1, 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("expected", metavar="EXPECTED.json",
                        help="the expected manifest(s), e.g. the trainer's digests of what it sent")
    # nargs="*" rather than "+": a later `--url URL` (fetch the actual manifests from a running
    # sidecar) will be another source of actual manifests; see _actual_manifests.
    parser.add_argument("actual", metavar="ACTUAL.json", nargs="*",
                        help="one or more actual manifests (a file may hold a JSON list, one per rank)")
    parser.add_argument("--max-rows", type=int, default=50, metavar="N",
                        help="print at most N mismatch rows (0: all; default 50)")


def run(args: argparse.Namespace) -> int:
    try:
        expected = load_manifests(args.expected)
        actual = _actual_manifests(args)
        report = audit(expected, actual)
    except ManifestError as exc:
        print(f"sidecar audit: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    sys.stdout.write(report.table(max_rows=args.max_rows if args.max_rows > 0 else None))
    return EXIT_OK if report.ok else EXIT_MISMATCH


def _actual_manifests(args: argparse.Namespace) -> list[Manifest]:
    """Every actual manifest, in command-line order (files now; a sidecar URL later)."""
    if not args.actual:
        raise ManifestError("<command line>", "ACTUAL.json", "give at least one actual manifest file")
    return [m for path in args.actual for m in load_manifests(path)]
