"""The `sidecar` command. Each subcommand lives in its own module and registers itself here."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module exposing add_arguments(parser) and run(args) -> int
COMMANDS = {
    "audit": ("sidecar.audit_cli", "compare checksum manifests (expected vs actual)"),
    "demo": ("sidecar.demo_cli", "an end-to-end RL demo (tiny, Qwen2-0.5B shape or a model dir): train, sync, audit"),
    "generate": ("sidecar.generate_cli", "generate with the in-process engine (default: the embedded tiny model)"),
    "make-model": ("sidecar.make_model_cli", "write a tiny random model directory (the embedded default)"),
    "launch": ("sidecar.launch_cli", "serve a model over HTTP: rank processes, control plane, metrics"),
    "status": ("sidecar.status_cli", "print a running sidecar's state as a table"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sidecar", description="Weight-sync sidecar for RL post-training.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
