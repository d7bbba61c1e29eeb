"""What the `sidecar` subcommands share: the help formatter and the one device check.

Imports nothing heavy (torch only inside `check_device`), because every `sidecar <cmd> --help`
imports this module and must print in well under a second (scripts/tools/check_help_speed.py).
"""

from __future__ import annotations

import argparse

from inference.core import InvalidRequestError


class HelpFormatter(argparse.HelpFormatter):
    """Shows every option's default: appended as "(default: X)" unless its help already states one
    (the launch flags write theirs, with the engine's default and the variable). None reads "unset"
    and a false switch "off", so a reader never has to guess what leaving a flag out means."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (isinstance(action, argparse._HelpAction) or action.default is argparse.SUPPRESS
                or "default" in text.lower()):
            return text
        if not action.option_strings and action.nargs not in ("?", "*"):
            return text  # a required positional has no default
        default = action.default
        if default is None:
            shown = "unset"
        elif default is False and action.nargs == 0:
            shown = "off"
        elif isinstance(default, (list, tuple)):
            shown = " ".join(repr(v) if isinstance(v, str) else str(v) for v in default)
        else:
            shown = str(default)
        return f"{text} (default: {shown.replace('%', '%%')})".lstrip()


def check_device(device: str, needed: int = 1) -> str:
    """The --device flag checked against this machine: "auto" resolved (inference.parallel.resolve_device);
    "cuda" (or "cuda:N") without any GPU is an InvalidRequestError naming `device` that says so in one
    line (and whether this torch is a CPU build). `needed` GPUs are the caller's to count; this only
    refuses zero."""
    import torch

    from inference.parallel import resolve_device

    if device == "auto":
        return str(resolve_device(device))
    if device.startswith("cuda") and not torch.cuda.is_available():
        why = (f"this torch ({torch.__version__}) is a CPU build" if torch.version.cuda is None
               else "torch sees no CUDA device")
        gpus = "a GPU" if needed <= 1 else f"{needed} GPUs"
        raise InvalidRequestError("device", f"--device {device} needs {gpus}, but there is no GPU here: {why}; "
                                            "use --device cpu (or auto)")
    return device


def one_line(message: object) -> str:
    """An error as the one line a command prints: line breaks a file's keys or values carried are shown
    escaped (\\n), so a script reading stderr sees one line per error."""
    return str(message).replace("\r", "\\r").replace("\n", "\\n")
