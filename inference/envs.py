"""Every environment variable Sidecar reads, in one registry: name, type, default, doc, when it is read.

No other module of the packages reads `os.environ` for a setting: it asks a switch here
(`GEMV.get()`), and docs/configuration.md lists them all (tests/test_envs.py holds both true).
Two reading times, each said on the switch:
- "import": read once, when the module that uses it is first imported. These pick kernel code paths
  that CUDA graphs bake in, so they must not change under a running engine: set them before the
  process starts (tests flip the module flags they initialise instead).
- "call": read at every use (paths, the test-only fault, the API key of the CLI clients).
Besides the switches, `sidecar launch` reads one variable per LaunchConfig field, SIDECAR_<FIELD>
(SIDECAR_MAX_NUM_SEQS for max_num_seqs), through `launch_overrides`; sidecar/config.py parses them.

Booleans accept 1/true/yes/on and 0/false/no/off (any case); an empty value is the default; anything
else is an InvalidRequestError naming the variable, never a silent guess.

This module imports nothing heavy (no torch): the CLI reads it before any engine exists.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from inference.core import InvalidRequestError

ReadAt = Literal["import", "call"]
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
    owner: str = "sidecar"  # "triton" for a variable Triton defines and we also read

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
GEMV = _switch("SIDECAR_GEMV", bool, True,
               "the Triton GEMV for decode-sized linears (1-8 rows); 0 keeps every linear on cuBLAS "
               "(benchmarks compare both paths)", "import")
NORM_GEMV = _switch("SIDECAR_NORM_GEMV", bool, True,
                    "the residual add and RMSNorm formed in the GEMV's prologue; 0 keeps them in their own "
                    "add_rms_norm launch", "import")
GEMV_MAX_ROWS = _switch("SIDECAR_GEMV_MAX_ROWS", int, 1,
                         "the most rows (1-8) a linear sends to the Triton GEMV; more go to cuBLAS, which the "
                         "H200 measured faster at 2-8 rows (docs/benchmarks.md, session 13)", "import")
DECODE_LONG_TILES = _switch("SIDECAR_DECODE_LONG_TILES", bool, True,
                             "decode attention takes 128-key tiles from 32 sequences (models without a draft); "
                             "0 keeps 64-key tiles (A/B benchmarks)", "import")
VERIFY_PROGRAMS_PER_SM = _switch("SIDECAR_VERIFY_PROGRAMS_PER_SM", int, 4,
                                  "decode launches holding several rows of one sequence (spec-decode verify) "
                                  "choose their KV splits for this many programs a SM (plain decode: 2; "
                                  "docs/benchmarks.md, session 14)", "import")
VERIFY_KEYS_ONCE = _switch("SIDECAR_VERIFY_KEYS_ONCE", bool, False,
                             "spec-decode verify launches run the kernel that holds every row of a sequence in "
                             "one program and reads each key once (inference/layers/verify_attention.py); off "
                             "until the H200 shows it faster (A/B benchmarks, issue 24)", "import")
GEMV_PREFETCH = _switch("SIDECAR_GEMV_PREFETCH", bool, True,
                        "load the first weight tile before PDL's wait; 0 loads each tile in its own K step "
                        "(A/B benchmarks)", "import")
GEMV_FUSED_SPLIT = _switch("SIDECAR_GEMV_FUSED_SPLIT", bool, True,
                           "split-K partials summed by the last split to finish; 0 sums them in a second "
                           "launch (the same bits)", "import")
INVARIANT_FUSE_PROLOGUES = _switch("SIDECAR_INVARIANT_FUSE_PROLOGUES", bool, False,
                                   "the batch-invariant mode forms the pre-norms and SiLU*up inside the next "
                                   "GEMM's prologue (4 launches a layer instead of 7; the same bits at every "
                                   "row count); off until measured faster (A/B benchmarks, issue 23)", "import")
INVARIANT_FUSED_ROPE = _switch("SIDECAR_INVARIANT_FUSED_ROPE", bool, False,
                               "the batch-invariant mode rotates q and the new k inside the decode attention "
                               "kernel (one launch a layer fewer), its attention launched without FP "
                               "contraction so the rotation rounds as rotary_qk's in prefill; off until the "
                               "H200 shows the same bits (A/B benchmarks, issue 23)", "import")
PDL_EARLY_INVARIANT = _switch("SIDECAR_PDL_EARLY_INVARIANT", bool, True,
                              "the batch-invariant GEMM lets the next kernel be scheduled at its start (PDL); "
                              "0 does it after its main loop, so waiting dependents hold no SM its later "
                              "programs need (A/B benchmarks, issue 23)", "import")
PDL = _switch("SIDECAR_PDL", bool, True,
              "programmatic dependent launch for the decode kernels on Hopper or newer; 0 turns it off",
              "import")
TRITON_INTERPRET = _switch("TRITON_INTERPRET", bool, False,
                           "Triton's own variable: run kernels in its CPU interpreter; set it before Triton "
                           "is imported (tests do). Our kernel modules check it before they route CPU tensors "
                           "to a kernel (their FORCE_ON_CPU); checksum/device_digest.py, a leaf that imports "
                           "no registry, reads it directly", "call", owner="triton")

# ---- files and tests ----------------------------------------------------------------------------------
HOME = _switch("SIDECAR_HOME", str, None,
               "cache root: the embedded tiny models live in $SIDECAR_HOME/models (unset: ~/.cache/sidecar)",
               "call")
WEIGHT_FAULT = _switch("SIDECAR_WEIGHT_FAULT", str, None,
                       "test-only fault injection: 'flip:<tensor name>' flips a byte of that tensor on "
                       "arrival, so the audit must fail naming it", "call")

# ---- clients ------------------------------------------------------------------------------------------
FAST_HTTP = _switch("SIDECAR_FAST_HTTP", bool, True,
                    "`sidecar launch` serves on uvloop's event loop and httptools' HTTP parser when they are "
                    "installed (the server extra brings both); 0 keeps asyncio's loop and h11 (A/B benchmarks)",
                    "call")
HOT_ROUTES = _switch("SIDECAR_HOT_ROUTES", bool, True,
                    "the sidecar answers a valid POST /weights/update (the one request of a sync) without "
                    "FastAPI's routing and validation pass (sidecar/http/hot.py); 0 sends it through the "
                    "FastAPI route like every other request (A/B benchmarks)", "call")
API_KEY = _switch("SIDECAR_API_KEY", str, None,
                  "the API key: `sidecar launch` requires it (the api_key field's SIDECAR_<FIELD> variable), "
                  "`sidecar status` and `sidecar audit --url` send it; unlike --api-key it does not show "
                  "in `ps`", "call")


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
