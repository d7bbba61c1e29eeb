"""Every environment variable Sidecar reads, in one registry: name, type, default, doc, when it is read.

No other module of the packages reads `os.environ` for a setting: it asks a switch here
(`PDL.get()`), and docs/configuration.md lists them all (tests/test_envs.py holds both true).
The registry holds user settings only, never an experiment: a code path is chosen by measurement and
kept as the only one (docs/dev/benchmark-log.md, "Experiments decided"), and tests reach a path through
arguments or inputs, never through a variable. Every switch is read at each use ("call").
Besides the switches, `sidecar launch` reads one variable per LaunchConfig field, SIDECAR_<FIELD>
(SIDECAR_MAX_NUM_SEQS for max_num_seqs), through `launch_overrides`; sidecar/config.py parses them.

Booleans accept 1/true/yes/on and 0/false/no/off (any case); an empty value is the default; anything
else is an InvalidRequestError naming the variable, never a silent guess.

This module imports nothing heavy (no torch): the CLI reads it before any engine exists.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any, Literal

from inference.core import InvalidRequestError

ReadAt = Literal["import", "call"]  # "import": read once when first imported (none is, today)
LAUNCH_PREFIX = "SIDECAR_"  # SIDECAR_<FIELD>: one per LaunchConfig field
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class EnvSwitch:
    """One environment variable: its parsed type, its value when unset, what it does, when it is read."""

    name: str
    kind: type  # bool, int or str
    default: Any
    doc: str
    read_at: ReadAt
    owner: str = "sidecar"  # "triton", "huggingface": a variable that library defines and we also read

    def get(self, env: Mapping[str, str] | None = None) -> Any:
        """The value now (os.environ unless `env` is given); the default when unset or empty."""
        raw = (os.environ if env is None else env).get(self.name)
        if raw is None or not raw.strip():
            return self.default
        return self.parse(raw)

    def parse(self, text: str) -> Any:
        text = text.strip()
        if self.kind is bool:
            if text.lower() in _TRUE:
                return True
            if text.lower() in _FALSE:
                return False
            raise InvalidRequestError(f"env {self.name}", f"must be one of {_TRUE + _FALSE}, got {text!r}")
        if self.kind is int:
            try:
                return int(text)
            except ValueError:
                raise InvalidRequestError(f"env {self.name}", f"must be an integer, got {text!r}") from None
        return text


SWITCHES: dict[str, EnvSwitch] = {}


def _switch(name: str, kind: type, default: Any, doc: str, read_at: ReadAt, owner: str = "sidecar") -> EnvSwitch:
    assert name not in SWITCHES, f"{name} registered twice"
    switch = EnvSwitch(name, kind, default, doc, read_at, owner)
    SWITCHES[name] = switch
    return switch


# ---- kernels (inference/layers) ---------------------------------------------------------------------
PDL = _switch("SIDECAR_PDL", bool, True,
              "programmatic dependent launch for the decode kernels on Hopper or newer; 0 turns it off "
              "(results are the same bits either way; set it before the engine captures its CUDA graphs)",
              "call")
TRITON_INTERPRET = _switch("TRITON_INTERPRET", bool, False,
                           "Triton's own variable: run kernels in its CPU interpreter; set it before Triton "
                           "is imported (tests do). inference/layers/kernel_device.py checks it before it routes "
                           "CPU tensors to a kernel; checksum/device_digest.py, a leaf that imports no registry, "
                           "reads it directly", "call", owner="triton")

# ---- files ----------------------------------------------------------------------------------------
HOME = _switch("SIDECAR_HOME", str, None,
               "cache root: the embedded tiny models live in $SIDECAR_HOME/models (unset: ~/.cache/sidecar)",
               "call")

KERNEL_CACHE = _switch("TRITON_CACHE_DIR", str, None,
                       "Triton's own variable: where compiled kernels persist. Unset with SIDECAR_HOME set, the "
                       "engine sets it to $SIDECAR_HOME/triton (`use_kernel_cache`), so a start finds the kernels "
                       "an earlier one compiled there; unset without SIDECAR_HOME: Triton's ~/.triton/cache",
                       "call", owner="triton")

# ---- models named by a Hugging Face id (inference/models/hub_cache.py) ------------------------------------
HF_HUB_CACHE = _switch("HF_HUB_CACHE", str, None,
                       "huggingface_hub's own variable: the local hub cache where a model id (ORG/NAME) given "
                       "to `LLM(...)`, `--model` or `--draft-model` is looked up (nothing is downloaded); unset: "
                       "$HF_HOME/hub", "call", owner="huggingface")
HF_HOME = _switch("HF_HOME", str, None,
                  "huggingface_hub's own variable: its cache root; the hub cache is $HF_HOME/hub when "
                  "HF_HUB_CACHE is unset (both unset: ~/.cache/huggingface/hub)", "call", owner="huggingface")

# ---- clients ------------------------------------------------------------------------------------------
API_KEY = _switch("SIDECAR_API_KEY", str, None,
                  "the API key: `sidecar launch` requires it (the api_key field's SIDECAR_<FIELD> variable), "
                  "`sidecar status` and `sidecar audit --url` send it; unlike --api-key it does not show "
                  "in `ps`", "call")


def use_kernel_cache(env: MutableMapping[str, str] | None = None) -> str | None:
    """The directory compiled Triton kernels persist in: TRITON_CACHE_DIR when set; else, with
    SIDECAR_HOME set, $SIDECAR_HOME/triton, written into the environment (`env`, os.environ unless
    given) so Triton and every process started afterwards use it; else None (Triton's default)."""
    env = os.environ if env is None else env
    chosen = KERNEL_CACHE.get(env)
    if chosen is not None:
        return chosen
    home = HOME.get(env)
    if home is None:
        return None
    env[KERNEL_CACHE.name] = str(os.path.join(os.path.expanduser(home), "triton"))
    return env[KERNEL_CACHE.name]


def launch_overrides(fields: Iterable[str], env: Mapping[str, str] | None = None) -> dict[str, tuple[str, str]]:
    """{field: (variable, raw text)} for every SIDECAR_<FIELD> that is set (os.environ unless `env`).

    Variables of other names are ignored (SIDECAR_HOME belongs to the switches above)."""
    source = os.environ if env is None else env
    out = {}
    for name in fields:
        key = LAUNCH_PREFIX + name.upper()
        if key in source:
            out[name] = (key, source[key])
    return out
