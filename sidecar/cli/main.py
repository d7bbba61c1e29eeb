"""The `sidecar` command. Each subcommand lives in its own module and registers itself here.

Only the chosen subcommand's module is imported (its add_arguments, then its run), and no module
imports torch to declare its arguments, so `sidecar <cmd> --help` prints in well under a second
(scripts/tools/check_help_speed.py measures every command).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Iterable

from sidecar.cli.common import HelpFormatter

# subcommand -> module exposing add_arguments(parser) and run(args) -> int
COMMANDS = {
    "audit": ("sidecar.cli.audit", "compare checksum manifests (expected vs actual)"),
    "demo": ("sidecar.cli.demo", "an end-to-end RL demo (tiny, Qwen2-0.5B shape or a model dir): train, sync, audit"),
    "fleet": ("sidecar.cli.fleet", "start N replicas of `sidecar launch` on this machine (dp ranks, devices, ports) "
                                   "and print their URLs; stopping it stops them all"),
    "generate": ("sidecar.cli.generate", "generate with an engine of its own, in this process (a running sidecar "
                                         "is not used; default model: the embedded tiny one)"),
    "make-model": ("sidecar.cli.make_model", "write a tiny random model directory (the embedded default)"),
    "launch": ("sidecar.cli.launch", "serve a model over HTTP: rank processes, control plane, metrics"),
    "status": ("sidecar.cli.status", "print a running sidecar's state as a table (default: http://127.0.0.1:8000)"),
}


def build_parser(commands: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """The parser; the arguments of `commands` only (None: every command), so that only their modules
    are imported. The other subcommands are still listed (and chosen: their arguments are then missing)."""
    chosen = set(COMMANDS if commands is None else commands)
    parser = argparse.ArgumentParser(prog="sidecar", description="Weight-sync sidecar for RL post-training.",
                                     formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, formatter_class=HelpFormatter)
        if name in chosen:
            importlib.import_module(module).add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser([command] if command in COMMANDS else []).parse_args(argv)
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
