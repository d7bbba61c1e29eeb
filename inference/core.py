"""Shared types of every layer: sampling parameters, outputs, weight versions and errors.

This module imports nothing heavy (no torch) so that the HTTP layer, the trainer hooks and the
client can all use it. No other module redefines these types.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, fields
from typing import Literal

LogprobsMode = Literal["raw", "processed"]


class SidecarError(Exception):
    """Base of every error Sidecar raises on purpose."""


class InvalidRequestError(SidecarError, ValueError):
    """A request (prompt, sampling parameters, manifest) is malformed; `field` names the culprit."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.message = message


class StateError(SidecarError, RuntimeError):
    """An operation is not allowed in the current state (asleep, torn weights, open session...)."""


class FinishReason(str, enum.Enum):
    STOP = "stop"  # an EOS token, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # cancelled by the caller or failed


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one prompt's completions.

    temperature == 0 is greedy. top_k <= 0 and top_p == 1 and min_p == 0 disable those filters.
    `logprobs_mode` says which distribution the reported logprobs come from:
    "raw" is log_softmax of the model's logits (what a trainer recomputes at temperature 1);
    "processed" is log_softmax after temperature, top-k, top-p and min-p (the sampling distribution).
    A seeded request gives the same completion whatever else runs in the batch; sample i of n
    uses the seed derived from (seed, i).
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int = 0
    logprobs_mode: LogprobsMode = "raw"

    MAX_N = 1024
    MAX_LOGPROBS = 20

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise InvalidRequestError naming the first bad field."""

        def bad(name: str, msg: str) -> InvalidRequestError:
            return InvalidRequestError(f"sampling_params.{name}", msg)

        if not isinstance(self.n, int) or not 1 <= self.n <= self.MAX_N:
            raise bad("n", f"must be an integer in [1, {self.MAX_N}], got {self.n!r}")
        if not _finite(self.temperature) or self.temperature < 0:
            raise bad("temperature", f"must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", f"must be an integer >= -1 (0 or -1 disable it), got {self.top_k!r}")
        if not _finite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not _finite(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise bad("seed", f"must be a non-negative integer or None, got {self.seed!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= self.MAX_LOGPROBS:
            raise bad("logprobs", f"must be an integer in [0, {self.MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.logprobs_mode not in ("raw", "processed"):
            raise bad("logprobs_mode", f"must be 'raw' or 'processed', got {self.logprobs_mode!r}")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or t < 0 or (vocab_size is not None and t >= vocab_size):
                raise bad("stop_token_ids", f"token id {t!r} is outside the vocabulary [0, {vocab_size})")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise bad("stop", f"stop strings must be non-empty strings, got {s!r}")

    @classmethod
    def from_dict(cls, data: dict) -> SamplingParams:
        """Build from a plain dict (HTTP, config); unknown keys are an error naming the key."""
        known = {f.name for f in fields(cls)}
        for key in data:
            if key not in known:
                raise InvalidRequestError(f"sampling_params.{key}", "unknown field")
        data = dict(data)
        for key in ("stop_token_ids", "stop"):
            if key in data:
                value = data[key]
                data[key] = (value,) if isinstance(value, (str, int)) else tuple(value)
        return cls(**data)


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class CompletionOutput:
    """One sampled completion. `logprobs[i]` is the logprob of `token_ids[i]` (see logprobs_mode)."""

    index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason | None = None
    text: str | None = None
    top_logprobs: list[dict[int, float]] | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # [(first token index, weight version), ...]: one entry unless the request was held across a sync
    weight_version_spans: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class RequestOutput:
    """The result of one prompt: its completions and the weight version that produced them.

    `weight_version` is the oldest version that produced any of its tokens; a request held across a
    weight sync (sleep with in_flight="hold") has several spans in its completions'
    `weight_version_spans`.
    """

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    weight_version: int
    finished: bool = True
    prompt: str | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache, over all n samples
    metrics: dict[str, float] = field(default_factory=dict)
