"""`sidecar audit EXPECTED.json ACTUAL.json [MORE.json ...]`: compare checksum manifests.
`sidecar audit --url URL [--model target|draft] [--source held|received] [--algorithm RULE] [EXPECTED.json]`:
the same against a running sidecar (held weights are digested by the rule EXPECTED.json names, or
--algorithm, else each rank's default: the device rule on a GPU).

The first file holds what was expected, every further file what a rank holds. Any file may hold
one manifest or a JSON list of them (one per rank). One expected manifest applies to every actual
rank (the trainer's digests of what it sent); several are matched to the actual ones by (model,
rank key), and ranks found on only one side are reported. With --url, every rank's manifest is
fetched (GET /checksums) and the ranks are compared with each other (sidecar/audit_rules.py: the
replica rule); EXPECTED.json is then optional. Exit status: 0 all match, 1 mismatch, 2 bad input
or an unreachable sidecar (a one-line error on stderr).
"""

from __future__ import annotations

import argparse
import sys

from checksum import ALGORITHMS, Manifest, ManifestError, Report, audit, load_manifests
from inference import envs
from inference.core import SidecarError

EXIT_OK, EXIT_MISMATCH, EXIT_BAD_INPUT = 0, 1, 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("expected", metavar="EXPECTED.json", nargs="?",
                        help="the expected manifest(s), e.g. the trainer's digests of what it sent "
                             "(optional with --url)")
    # nargs="*" rather than "+": a later `--url URL` (fetch the actual manifests from a running
    # sidecar) will be another source of actual manifests; see _actual_manifests.
    parser.add_argument("actual", metavar="ACTUAL.json", nargs="*",
                        help="one or more actual manifests (a file may hold a JSON list, one per rank)")
    parser.add_argument("--max-rows", type=int, default=50, metavar="N",
                        help="print at most N mismatch rows (0: all; default 50)")
    parser.add_argument("--url", default=None, help="fetch every rank's manifest from a running sidecar")
    parser.add_argument("--model", choices=("target", "draft"), default="target", help="with --url (default target)")
    parser.add_argument("--source", choices=("held", "received"), default="held",
                        help="with --url: the weights held now, or what the last sync delivered (default held)")
    parser.add_argument("--algorithm", choices=tuple(ALGORITHMS), default=None,
                        help="with --url: the digest rule of the held weights (default: the one EXPECTED.json "
                             "names, else each rank's own: the device rule on a GPU)")
    parser.add_argument("--api-key", default=None, help="with --url (default: $SIDECAR_API_KEY)")
    parser.add_argument("--timeout", type=float, default=300.0, help="with --url: seconds per request")


def run(args: argparse.Namespace) -> int:
    try:
        if args.expected is None and args.url is None:
            raise ManifestError("<command line>", "EXPECTED.json", "give the expected manifest file (or --url)")
        expected = load_input(args.expected) if args.expected is not None else None
        actual = _actual_manifests(args, expected)
        reports = [audit(expected, actual)] if expected is not None else []
        if args.url is not None:
            from sidecar.audit_rules import replica_report

            reports.append(replica_report(actual, args.source))
        report = Report.merge(reports)
    except (ManifestError, SidecarError) as exc:
        print(f"sidecar audit: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    sys.stdout.write(report.table(max_rows=args.max_rows if args.max_rows > 0 else None))
    return EXIT_OK if report.ok else EXIT_MISMATCH


def _actual_manifests(args: argparse.Namespace, expected: list[Manifest] | None = None) -> list[Manifest]:
    """Every actual manifest, in command-line order: the files, then the sidecar's ranks (--url)."""
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
    ManifestError, and a file that makes it raise anything else (a list as a dtype raised TypeError)
    is still the user's file to fix, not a mismatch."""
    try:
        return load_manifests(path)
    except ManifestError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
        raise ManifestError(path, "<file>", f"not a valid manifest ({type(e).__name__}: {e})") from e


def _fetch(args: argparse.Namespace, algorithm: str | None = None) -> list[Manifest]:
    from sidecar.client import SidecarClient

    key = args.api_key or envs.API_KEY.get()
    with SidecarClient(args.url, api_key=key, timeout=args.timeout, retries=1) as client:
        dicts = client.checksums(args.model, args.source, algorithm)
    return [Manifest.from_dict(d, f"{args.url} rank {i}") for i, d in enumerate(dicts)]
