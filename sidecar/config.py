"""The launch configuration of `sidecar launch`: one frozen dataclass, the only declaration of its options.

Each field carries its help text and bounds. Generated from the fields: the command-line flags
(sidecar/cli/launch.py), the SIDECAR_<FIELD> environment variables (read through inference/envs.py),
the config-file keys, the validation, and, for fields marked `engine`, the EngineConfig every rank runs
(`engine_config`). docs/configuration.md lists them; tests/test_config.py holds that list complete.
Sources, highest precedence first: flags, SIDECAR_* variables, a config file (JSON, or TOML where
`tomllib` exists), the defaults. A file's unknown key is an error naming it; SIDECAR_* variables that
name no field are ignored (SIDECAR_HOME is a switch of inference/envs.py). Engine options default to
None, "not chosen": inference/config.py owns their defaults, so none is declared twice.

Invariant: a LaunchConfig that exists is valid (`__post_init__` validates) and holds only what the user
chose; values found at run time live elsewhere. The one thing read at construction is --api-key-file.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from inference import envs
from inference.config import (
    ENGINE_SECTIONS,
    LOAD_FORMATS,
    QUANTIZATIONS,
    EngineConfig,
    build_engine_config,
    engine_option_names,
)
from inference.core import ON_SYNC_MODES, InvalidRequestError
from inference.transfer.backends import BACKEND_NAMES
from sidecar.log_format import LOG_FORMATS

DEVICES = ("auto", "cuda", "cpu")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def option(default: Any, help: str, **meta: Any) -> Any:
    """A LaunchConfig field. meta: engine (the flat EngineConfig option it sets), min/max (inclusive),
    gt (exclusive lower bound), choices, secret (masked in logs and /state), metavar."""
    return dataclasses.field(default=default, metadata={"help": help, **meta})


@dataclass(frozen=True)
class LaunchConfig:
    """What `sidecar launch` serves and how."""

    # ---- what to serve ----
    model: str | None = option(None, "HF model directory, or a model id (ORG/NAME) already in the local Hugging "
                                     "Face cache (default: the embedded tiny model)", metavar="DIR|ID")
    served_model_name: str | None = option(None, "the model name the OpenAI routes answer to (`model` of a request, "
                                                 "/v1/models); unset: the --model id, or the directory's name",
                                           metavar="NAME")
    tokenizer: str | None = option(None, "tokenizer directory (default: the model's)", engine="tokenizer",
                                   metavar="DIR")
    draft_model: str | None = option(None, "draft model directory: speculative decoding", engine="draft_model",
                                     metavar="DIR")
    num_speculative_tokens: int | None = option(None, "draft tokens proposed per step with --draft-model "
                                                      "(or --self-draft)",
                                                engine="num_speculative_tokens", min=0)
    lora: str | None = option(None, "PEFT LoRA adapter directory, served unmerged on the model (sharded as its "
                                    "weights at any --tp; synced adapter-only: docs/sync-modes.md)", engine="lora",
                              metavar="DIR")
    draft_lora: str | None = option(None, "PEFT LoRA adapter directory served unmerged on the draft model (as --lora)",
                                    engine="draft_lora", metavar="DIR")
    dtype: str | None = option(None, "auto (bfloat16 on CUDA, float32 on CPU), bfloat16, float16, float32 or "
                                     "model (the checkpoint's)", engine="dtype")
    load_format: str | None = option(None, "auto: safetensors from the model directory; dummy: random weights "
                                           "(benchmarks)", engine="load_format", choices=LOAD_FORMATS)
    seed: int | None = option(None, "seed of the engine's generators", engine="seed", min=0)
    quantization: str | None = option(None, "weights of the linears: none (the model dtype) or fp8 (e4m3, a "
                                            "scale per output row, quantized at load and on every sync; "
                                            "docs/fp8.md)", engine="quantization", choices=QUANTIZATIONS)
    draft_quantization: str | None = option(None, "the draft model's quantization; unset: --quantization's",
                                            engine="draft_quantization", choices=QUANTIZATIONS)
    # ---- where ----
    tp: int = option(1, "tensor-parallel size: one process per rank", engine="tp_size", min=1)
    device: str = option("auto", "auto: cuda when available", choices=DEVICES)
    devices: str | None = option(None, "GPU indices, one per rank (1,2: rank 0 on GPU 1, rank 1 on GPU 2); "
                                       "unset: rank r on GPU r", metavar="LIST")
    threads: int | None = option(None, "torch threads of each rank process; unset: 1 on cuda (the GPU computes), "
                                       "min(4, cores / 2 / tp) on cpu, so a trainer on the same machine keeps "
                                       "half of it", min=1)
    host: str = option("127.0.0.1", "address to bind", metavar="ADDR")
    port: int = option(8000, "port; 0 picks a free one (printed in the 'Sidecar serving on' line)", min=0,
                       max=65535)
    dp_rank: int = option(0, "this replica's data-parallel rank in a fleet: replica I of `sidecar fleet` or of "
                             "trainer_hooks.Fleet([...]) is launched with I. Under torchrun or Slurm take it "
                             "from the launcher: SIDECAR_DP_RANK=$RANK (or $SLURM_PROCID); docs/fleet.md",
                          min=0)
    api_key: str | None = option(None, "require 'Authorization: Bearer KEY'. A key on the command line shows in "
                                       "`ps`: prefer --api-key-file or the SIDECAR_API_KEY variable",
                                 secret=True, metavar="KEY")
    api_key_file: str | None = option(None, "read the API key from this file (its first line), so it shows "
                                            "in no process list", metavar="PATH")
    log_level: str = option("info", "log level", choices=LOG_LEVELS)
    log_format: str = option("text", "text (human lines) or json (one JSON object a line, for log shippers)",
                             choices=LOG_FORMATS)
    # ---- engine: memory and batching ----
    block_size: int | None = option(None, "tokens per KV-cache block", engine="block_size", min=1)
    kv_cache_bytes: int | None = option(None, "KV cache bytes per rank (overrides --gpu-memory-utilization)",
                                        engine="kv_cache_bytes", min=1)
    gpu_memory_utilization: float | None = option(None, "fraction of device memory the rank may fill, in (0, 1]",
                                                  engine="gpu_memory_utilization", gt=0.0, max=1.0)
    enable_prefix_caching: bool | None = option(None, "reuse the KV of shared prompt prefixes",
                                                engine="enable_prefix_caching")
    max_num_seqs: int | None = option(None, "sequences per step; 0 or unset: chosen from the KV cache",
                                      engine="max_num_seqs", min=0)
    max_num_batched_tokens: int | None = option(None, "tokens per step (prefill chunks plus decodes)",
                                                engine="max_num_batched_tokens", min=1)
    max_model_len: int | None = option(None, "prompt plus completion tokens; unset: the model's "
                                             "max_position_embeddings", engine="max_model_len", min=1)
    async_scheduling: bool | None = option(None, "overlap each step's host work with the previous step on the "
                                                 "GPU; unset: on for CUDA (with a draft too)",
                                           engine="async_scheduling")
    spec_max_batch: int | None = option(None, "with --draft-model: speculate only while at most this many "
                                              "sequences decode (the tail of a rollout); 0: at every batch size",
                                        engine="spec_max_batch", min=0)
    enforce_eager: bool | None = option(None, "no CUDA graphs", engine="enforce_eager")
    attention_backend: str | None = option(None, "auto (per device), reference (eager torch) or triton",
                                           engine="attention_backend")
    batch_invariant: bool | None = option(None, "batch-invariant mode: a request's tokens and logprobs are the "
                                                "same bits whatever runs beside it (docs/invariance.md)",
                                          engine="batch_invariant")
    self_draft: bool | None = option(None, "in the batch-invariant mode without --draft-model: the model on the "
                                           "default kernels drafts --num-speculative-tokens tokens and the mode's "
                                           "forward verifies them (the same bits, fewer invariant steps); unset: "
                                           "on for CUDA", engine="self_draft")
    on_sync: str | None = option(None, "what a request in flight does when a weight sync goes live, unless its "
                                       "call says (on_sync): recompute (its KV recomputed under the new weights), "
                                       "keep (its KV kept) or abort (restarted from its prompt); unset: the "
                                       "engine's recompute", engine="on_sync", choices=ON_SYNC_MODES)
    # ---- weight transfer ----
    transfer: str | None = option(None, "accept only this weight-transfer backend (unset: the one the "
                                        "trainer's init_info names)", choices=BACKEND_NAMES)
    bucket_mb: int = option(512, "bucket size advertised in /state to senders that ask", min=1)
    # ---- timeouts and limits ----
    startup_timeout_s: float = option(900.0, "seconds for every rank to load the model", gt=0.0)
    rpc_timeout_s: float = option(900.0, "seconds for one control call (sleep, wake, a weight update) on "
                                         "every rank", gt=0.0)
    step_timeout_s: float = option(300.0, "seconds a rank with work owed may stay silent (no heartbeat, sent "
                                          "every 0.25 s even mid-step) before it is hung; a step that runs "
                                          "longer but still answers is waited for, with a warning", gt=0.0)
    max_pause_s: float = option(300.0, "the longest lease of POST /pause: generation resumes when it runs out "
                                       "unless renewed (another /pause) or ended (/resume)", gt=0.0)
    max_transfer_timeout_s: float = option(600.0, "the longest weight-wire timeout a trainer may ask for "
                                                  "(init_info.timeout_s); more gets 400. The driver waits a "
                                                  "weight command for --rpc-timeout-s plus this, so a dead "
                                                  "trainer is a 502 and a torn model, never a dead rank", gt=0.0)
    # Limits (docs/limits.md): an RL batch (a 32k-token prompt, n=64, thousands of sequences) passes; 50 MB
    # of text or millions of sequences from one call are refused before any work.
    max_body_mb: int = option(64, "MiB of one HTTP request body; a larger one gets 413 before it is read", min=1)
    max_prompt_chars: int = option(1 << 20, "characters of one text prompt (a 32k-token prompt is ~130k); a "
                                            "longer one gets 400 before it is tokenized", min=1)
    max_request_sequences: int = option(16384, "sequences (prompts x n) one generation call may ask for; more "
                                               "get 400", min=1)
    max_stops: int = option(256, "stop strings, and stop token ids, one prompt's sampling params may carry "
                                 "(each list); more get 400", min=0)
    max_stop_chars: int = option(16384, "characters of one prompt's stop strings together; more get 400", min=0)
    max_response_tokens: int = option(1 << 27, "tokens one generation call may ask back, each top logprob "
                                               "counted as one: the sum over its prompts of n x max_tokens x "
                                               "(1 + logprobs); more get 400 before any work", min=1)
    max_chat_messages: int = option(4096, "messages of one chat call; more get 400 before the template runs",
                                    min=1)
    text_workers: int | None = option(None, "threads that tokenize prompts and render chat templates; unset: "
                                            "the machine's cores, at most 8", min=1)
    max_text_queue: int = option(256, "generation calls waiting for a tokenizer thread; more get 503 with "
                                      "Retry-After at once", min=1)
    max_header_kb: int = option(64, "KiB of one HTTP request's line and headers; more get 431 and the "
                                    "connection is closed", min=1)
    header_timeout_s: float = option(30.0, "seconds for an HTTP request's line and headers to arrive once "
                                           "it began; then the connection is closed", gt=0.0)
    body_timeout_s: float = option(60.0, "seconds an HTTP request body may go without a new byte (a body "
                                         "shorter than its Content-Length waits this long); then 408", gt=0.0)
    max_connections: int = option(4096, "open HTTP connections; past it the longest-idle one is closed, or "
                                        "the new one answered 503 when none is idle", min=1)
    max_queued_sequences: int = option(65536, "sequences (prompts x n) waiting or running; a call that would "
                                              "pass it gets 429 (retry later)", min=1)
    max_pool_sequences: int = option(65536, "sequences (prompts x n) held in rollout pools (POST /rollouts): "
                                            "submitted and not yet acknowledged or cancelled, every pool "
                                            "together; a submission past it gets 429 naming prompts (take and "
                                            "acknowledge finished groups first)", min=1)
    hold_while_asleep: bool = option(False, "hold generation calls that arrive while the sidecar sleeps, or "
                                            "while a model is torn or awaits its first sync, until it can "
                                            "serve; default: answer 409 at once, naming the state")

    def __post_init__(self) -> None:
        for f in fields(self):
            _check_field(f, getattr(self, f.name))
        if self.devices is not None:
            self._check_devices()
        if self.max_request_sequences > self.max_queued_sequences:
            raise InvalidRequestError("max_request_sequences", f"{self.max_request_sequences} exceeds "
                                      f"max_queued_sequences ({self.max_queued_sequences}): such a call could "
                                      "never be queued")
        if not self.host:
            raise InvalidRequestError("host", "must be a non-empty host name or address")
        if self.api_key is not None and not self.api_key:
            raise InvalidRequestError("api_key", "must be a non-empty string when given")
        if self.api_key is not None:
            check_api_key(self.api_key, "api_key")
        if self.api_key_file is not None:
            key = read_key_file(self.api_key_file)
            check_api_key(key, "api_key_file")
            if self.api_key is not None and self.api_key != key:
                raise InvalidRequestError("api_key_file", "give the key once: --api-key (or SIDECAR_API_KEY) "
                                                          "or --api-key-file, not both")
            object.__setattr__(self, "api_key", key)

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
        for f in fields(self):
            if f.metadata.get("secret") and out[f.name] is not None:
                out[f.name] = "***"
        return out


def _field_types() -> tuple[dict[str, type], frozenset[str]]:
    """Each field's value type (int, float, str or bool) and the fields that may be None, from the hints."""
    hints = typing.get_type_hints(LaunchConfig)
    types, optional = {}, set()
    for f in fields(LaunchConfig):
        args = [a for a in typing.get_args(hints[f.name]) if a is not type(None)]
        if args:
            optional.add(f.name)
        kind = args[0] if args else hints[f.name]
        assert kind in (int, float, str, bool) and len(args) <= 1, f"LaunchConfig.{f.name}: unsupported type"
        types[f.name] = kind
    return types, frozenset(optional)


FIELD_TYPES, OPTIONAL = _field_types()


def build_config(cli: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None,
                 config_file: str | Path | None = None) -> LaunchConfig:
    """Merge the sources (CLI > env > file > defaults). `cli` holds only flags the user gave
    (None values are ignored); `env` defaults to the process environment (read by inference/envs.py).
    Raises InvalidRequestError naming the field (prefixed `env SIDECAR_X` or the file's path when the
    bad value came from there)."""
    merged: dict[str, Any] = {}
    if config_file is not None:
        merged.update(load_config_file(config_file))
    merged.update(from_env(env))
    merged.update({k: v for k, v in (cli or {}).items() if v is not None})
    unknown = sorted(set(merged) - set(FIELD_TYPES))
    if unknown:
        raise InvalidRequestError(unknown[0], "unknown launch option")
    return LaunchConfig(**merged)


def from_env(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The SIDECAR_<FIELD> variables that are set, parsed to their field's type."""
    return {name: _parse_text(name, text, f"env {key}")
            for name, (key, text) in envs.launch_overrides(FIELD_TYPES, env).items()}


def load_config_file(path: str | Path) -> dict[str, Any]:
    """A flat table of launch options from JSON (.json) or TOML (any other suffix)."""
    p = Path(path)
    text = read_bounded(p, MAX_CONFIG_BYTES, "config")
    if p.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise InvalidRequestError("config", f"{p} is not valid JSON: {e}") from e
        except RecursionError:
            raise InvalidRequestError("config", f"{p} nests too deeply: a config file is a flat table") from None
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
    except RecursionError:
        raise InvalidRequestError("config", f"{p} nests too deeply: a config file is a flat table") from None


def _check_file_value(name: str, value: Any, source: str) -> Any:
    kind = FIELD_TYPES[name]
    if value is None and name in OPTIONAL:
        return None
    if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if kind is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if kind in (str, bool) and type(value) is kind:
        return value
    raise InvalidRequestError(f"{source}: {name}", f"must be {kind.__name__}, got {value!r}")


def _parse_text(name: str, text: str, source: str) -> Any:
    """A field's value from the text of an environment variable."""
    kind = FIELD_TYPES[name]
    text = text.strip()
    if name in OPTIONAL and text.lower() in ("", "none", "null"):
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


def engine_default(name: str) -> Any:
    """The engine's default of a flat engine option (what an unset engine field of LaunchConfig means)."""
    section = engine_option_names()[name]
    cls = ENGINE_SECTIONS[section] if section else EngineConfig
    return next(f.default for f in fields(cls) if f.name == name)


def engine_config(cfg: LaunchConfig, model_dir: str, device: str) -> EngineConfig:
    """The EngineConfig every rank runs: every engine field the user set, the engine's defaults for the
    rest (a rank's own device index is applied in rank_main)."""
    chosen = {f.metadata["engine"]: getattr(cfg, f.name) for f in fields(cfg)
              if "engine" in f.metadata and getattr(cfg, f.name) is not None}
    return build_engine_config(model_dir, device=device, **chosen)


def read_key_file(path: str) -> str:
    """The first line of an API key file, stripped (InvalidRequestError naming api_key_file otherwise)."""
    text = read_bounded(Path(path).expanduser(), MAX_KEY_FILE_BYTES, "api_key_file")
    key = text.strip().splitlines()[0].strip() if text.strip() else ""
    if not key:
        raise InvalidRequestError("api_key_file", f"{path} is empty")
    return key


MAX_CONFIG_BYTES = 1 << 20  # a config file is a flat table of options: a few KiB
MAX_KEY_FILE_BYTES = 1 << 16


def read_bounded(path: Path, limit: int, field: str) -> str:
    """A small text file's content, reading at most `limit` + 1 bytes (/dev/zero or a FIFO must not read
    forever); InvalidRequestError naming `field` when it is larger, unreadable or not UTF-8."""
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise InvalidRequestError(field, f"cannot read {path}: {e.strerror or e}") from e
    if len(data) > limit:
        raise InvalidRequestError(field, f"{path} is larger than {limit} bytes: not a {field.replace('_', ' ')}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidRequestError(field, f"{path} is not UTF-8 text: {e}") from None


def check_api_key(key: str, field: str) -> None:
    """An API key travels in an HTTP header (`Authorization: Bearer KEY`): printable ASCII only, so that
    every client can send the key it was given."""
    if not key.isascii() or not key.isprintable():
        at = next(i for i, ch in enumerate(key) if not (ch.isascii() and ch.isprintable()))
        raise InvalidRequestError(field, f"character {at} of the key is not printable ASCII: an API key is sent "
                                         "in an HTTP header, which cannot carry it")


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


def _check_field(f: dataclasses.Field, value: Any) -> None:
    """Type, bounds and choices of one field, as its declaration states them."""
    name, kind, meta = f.name, FIELD_TYPES[f.name], f.metadata
    if value is None:
        if name in OPTIONAL:
            return
        raise InvalidRequestError(name, "must be given")
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
    else:
        ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if not ok:
        raise InvalidRequestError(name, f"must be {kind.__name__}, got {value!r}")
    if "choices" in meta and value not in meta["choices"]:
        raise InvalidRequestError(name, f"must be one of {list(meta['choices'])}, got {value!r}")
    low, gt, high = meta.get("min"), meta.get("gt"), meta.get("max")
    if (low is not None and value < low) or (gt is not None and value <= gt) or (high is not None and value > high):
        lo = f"[{low}" if low is not None else f"({gt}" if gt is not None else "(-inf"
        hi = f"{high}]" if high is not None else "inf)"
        raise InvalidRequestError(name, f"must be in {lo}, {hi}, got {value!r}")
