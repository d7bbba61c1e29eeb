"""The launch configuration of `sidecar launch`: one frozen dataclass built once at the edge.

Sources, highest precedence first: command-line flags, SIDECAR_* environment variables, a config
file (JSON, or TOML when `tomllib` is available), the defaults below. Every source uses the field
names of `LaunchConfig` (dashes and underscores are the same in a file; the environment variable
of `max_num_seqs` is SIDECAR_MAX_NUM_SEQS). Unknown keys in a file are an error naming the key;
unknown SIDECAR_* variables are ignored (SIDECAR_HOME, for one, belongs to inference.tiny).

Invariant: a LaunchConfig that exists is valid (`__post_init__` validates), and it holds only
what the user chose; values found at run time (the resolved device, KV blocks) live elsewhere.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from inference.core import InvalidRequestError

DEVICES = ("auto", "cuda", "cpu")
TRANSFERS = ("nccl", "ipc", "gloo")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
ENV_PREFIX = "SIDECAR_"
_SECRET_FIELDS = frozenset({"api_key"})


@dataclass(frozen=True)
class LaunchConfig:
    """What `sidecar launch` serves and how. `model` None is the embedded tiny model."""

    model: str | None = None
    draft_model: str | None = None
    tp: int = 1
    device: str = "auto"
    devices: str | None = None  # "1,2": rank r on the r-th listed GPU; None: rank r on GPU r
    host: str = "127.0.0.1"
    port: int = 8000  # 0: pick a free port (printed in the "Sidecar serving on" line)
    api_key: str | None = None
    transfer: str | None = None  # None: accept the backend the trainer's init_info names
    bucket_mb: int = 512  # advertised in /state for senders that ask which bucket size to use
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.85
    kv_cache_bytes: int | None = None
    enforce_eager: bool = False
    dtype: str = "auto"
    max_num_seqs: int = 256
    seed: int = 0
    log_level: str = "info"
    startup_timeout_s: float = 900.0  # loading the model on every rank
    rpc_timeout_s: float = 900.0  # one control call (sleep, wake, a weight update) on every rank
    step_timeout_s: float = 300.0  # one engine step on every rank
    max_queued_requests: int = 65536  # prompts waiting or running; more are refused with 503

    def __post_init__(self) -> None:
        _check_int(self, "tp", 1)
        _check_int(self, "port", 0, 65535)
        _check_int(self, "bucket_mb", 1)
        _check_int(self, "max_num_seqs", 1)
        _check_int(self, "seed", 0)
        _check_int(self, "max_queued_requests", 1)
        if self.max_model_len is not None:
            _check_int(self, "max_model_len", 1)
        if self.kv_cache_bytes is not None:
            _check_int(self, "kv_cache_bytes", 1)
        _check_choice(self, "device", DEVICES)
        if self.devices is not None:
            self._check_devices()
        _check_choice(self, "log_level", LOG_LEVELS)
        if self.transfer is not None:
            _check_choice(self, "transfer", TRANSFERS)
        if not _number(self.gpu_memory_utilization) or not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise InvalidRequestError("gpu_memory_utilization",
                                      f"must be in (0, 1], got {self.gpu_memory_utilization!r}")
        for name in ("startup_timeout_s", "rpc_timeout_s", "step_timeout_s"):
            value = getattr(self, name)
            if not _number(value) or value <= 0:
                raise InvalidRequestError(name, f"must be a positive number of seconds, got {value!r}")
        if not isinstance(self.host, str) or not self.host:
            raise InvalidRequestError("host", "must be a non-empty host name or address")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise InvalidRequestError("api_key", "must be a non-empty string when given")

    def _check_devices(self) -> None:
        indices = parse_devices(self.devices)
        if self.device == "cpu":
            raise InvalidRequestError("devices", "GPU indices need --device cuda (or auto), not cpu")
        if len(indices) != self.tp:
            raise InvalidRequestError("devices", f"lists {len(indices)} GPU(s) for --tp {self.tp}: give one per rank")

    @property
    def device_indices(self) -> tuple[int, ...] | None:
        """The GPU of each rank, in rank order, among the GPUs visible to the launcher (None: 0..tp-1)."""
        return None if self.devices is None else parse_devices(self.devices)

    @property
    def bucket_bytes(self) -> int:
        return self.bucket_mb << 20

    def public_dict(self) -> dict[str, Any]:
        """Every field, with secrets masked: what the launcher logs and /state shows."""
        out = asdict(self)
        for name in _SECRET_FIELDS:
            if out[name] is not None:
                out[name] = "***"
        return out


FIELD_TYPES: dict[str, type] = {
    "model": str, "draft_model": str, "tp": int, "device": str, "devices": str, "host": str, "port": int,
    "api_key": str, "transfer": str, "bucket_mb": int, "max_model_len": int, "gpu_memory_utilization": float,
    "kv_cache_bytes": int, "enforce_eager": bool, "dtype": str, "max_num_seqs": int, "seed": int,
    "log_level": str, "startup_timeout_s": float, "rpc_timeout_s": float, "step_timeout_s": float,
    "max_queued_requests": int,
}
assert set(FIELD_TYPES) == {f.name for f in fields(LaunchConfig)}
_OPTIONAL = frozenset({"model", "draft_model", "api_key", "transfer", "max_model_len", "kv_cache_bytes",
                       "devices"})


def build_config(cli: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None,
                 config_file: str | Path | None = None) -> LaunchConfig:
    """Merge the sources (CLI > env > file > defaults). `cli` holds only flags the user gave
    (None values are ignored); `env` defaults to os.environ. Raises InvalidRequestError naming the
    field (prefixed `env SIDECAR_X` or the file's path when the bad value came from there)."""
    merged: dict[str, Any] = {}
    if config_file is not None:
        merged.update(load_config_file(config_file))
    merged.update(from_env(os.environ if env is None else env))
    merged.update({k: v for k, v in (cli or {}).items() if v is not None})
    unknown = sorted(set(merged) - set(FIELD_TYPES))
    if unknown:
        raise InvalidRequestError(unknown[0], "unknown launch option")
    return LaunchConfig(**merged)


def from_env(env: Mapping[str, str]) -> dict[str, Any]:
    """Known SIDECAR_<FIELD> variables, parsed to the field's type."""
    out: dict[str, Any] = {}
    for name, kind in FIELD_TYPES.items():
        key = ENV_PREFIX + name.upper()
        if key in env:
            out[name] = _parse_text(name, kind, env[key], f"env {key}")
    return out


def load_config_file(path: str | Path) -> dict[str, Any]:
    """A flat table of launch options from JSON (.json) or TOML (any other suffix)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise InvalidRequestError("config", f"cannot read {p}: {e.strerror or e}") from e
    if p.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise InvalidRequestError("config", f"{p} is not valid JSON: {e}") from e
    else:
        data = _load_toml(p, text)
    if not isinstance(data, dict):
        raise InvalidRequestError("config", f"{p} must hold a table/object of options, got {type(data).__name__}")
    out: dict[str, Any] = {}
    for raw_key, value in data.items():
        key = str(raw_key).replace("-", "_")
        if key not in FIELD_TYPES:
            raise InvalidRequestError(f"{p}: {raw_key}", f"unknown launch option (known: {', '.join(FIELD_TYPES)})")
        out[key] = _check_file_value(key, value, str(p))
    return out


def _load_toml(p: Path, text: str) -> Any:
    try:
        import tomllib
    except ImportError as e:  # Python 3.10
        raise InvalidRequestError("config", f"{p}: TOML needs Python 3.11+; use a .json file") from e
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise InvalidRequestError("config", f"{p} is not valid TOML: {e}") from e


def _check_file_value(name: str, value: Any, source: str) -> Any:
    kind = FIELD_TYPES[name]
    if value is None and name in _OPTIONAL:
        return None
    if kind is float and _number(value):
        return float(value)
    if kind is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if kind in (str, bool) and type(value) is kind:
        return value
    raise InvalidRequestError(f"{source}: {name}", f"must be {kind.__name__}, got {value!r}")


def _parse_text(name: str, kind: type, text: str, source: str) -> Any:
    text = text.strip()
    if name in _OPTIONAL and text.lower() in ("", "none", "null"):
        return None
    try:
        if kind is bool:
            low = text.lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        return kind(text)
    except ValueError:
        raise InvalidRequestError(f"{source}", f"{name} must be {kind.__name__}, got {text!r}") from None


def parse_devices(text: object) -> tuple[int, ...]:
    """Parse "1, 2" into (1, 2): distinct GPU indices >= 0, comma-separated (InvalidRequestError otherwise)."""
    if not isinstance(text, str):
        raise InvalidRequestError("devices", f"must be comma-separated GPU indices like '1,2', got {text!r}")
    try:
        indices = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise InvalidRequestError("devices", f"must be comma-separated GPU indices like '1,2', got {text!r}") from None
    if any(i < 0 for i in indices) or len(set(indices)) != len(indices):
        raise InvalidRequestError("devices", f"GPU indices must be distinct and >= 0, got {text!r}")
    return indices


def _number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check_int(cfg: LaunchConfig, name: str, lo: int, hi: int | None = None) -> None:
    value = getattr(cfg, name)
    if not isinstance(value, int) or isinstance(value, bool) or value < lo or (hi is not None and value > hi):
        bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise InvalidRequestError(name, f"must be an integer {bound}, got {value!r}")


def _check_choice(cfg: LaunchConfig, name: str, choices: tuple[str, ...]) -> None:
    value = getattr(cfg, name)
    if value not in choices:
        raise InvalidRequestError(name, f"must be one of {list(choices)}, got {value!r}")
