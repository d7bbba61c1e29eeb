"""How a sidecar's processes log (`--log-format`): human lines, or one JSON object a line for log shippers,
the same in the HTTP process, every rank and `sidecar fleet`'s own messages.

A JSON line holds time (UTC, ISO 8601), level, logger, process ("http", "rank0", ...; "fleet"), message,
and the record's `fields` when it carries some (`log.info(..., extra=fields(event="sync", ...))`), so a
sync's version, bytes, milliseconds and audit verdict are keys, not words to parse.
Imports nothing heavy: `sidecar fleet` uses it before any torch import.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

LOG_FORMATS = ("text", "json")
_FIELDS = "sidecar_fields"  # the LogRecord attribute that carries structured fields


def fields(**values: Any) -> dict[str, Any]:
    """The `extra=` of a log call whose values a JSON line carries as keys."""
    return {_FIELDS: values}


class JsonFormatter(logging.Formatter):
    def __init__(self, process: str) -> None:
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(), "logger": record.name, "process": self.process,
            "message": record.getMessage()}
        out.update(getattr(record, _FIELDS, None) or {})
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(level: str, log_format: str, process: str) -> None:
    """The root logger of this process: `level`, to stderr, in `log_format` ("text" or "json")."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, got {log_format!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(process) if log_format == "json" else logging.Formatter(
        f"%(asctime)s {process} %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler])


def line(message: str, log_format: str, process: str, level: str = "info", **values: Any) -> str:
    """One line written without the logging module (a CLI's own stderr), in `log_format`."""
    if log_format != "json":
        return message
    record = logging.LogRecord(process, logging.getLevelName(level.upper()), "", 0, message, None, None)
    setattr(record, _FIELDS, values)
    return JsonFormatter(process).format(record)
