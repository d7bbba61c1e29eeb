"""Shared types of every layer: sampling parameters, what a request does at a weight sync, outputs,
weight versions, errors, and the routing array's dtype rule and JSON form.

This module imports nothing heavy (no torch; numpy only inside the routing codec) so that the HTTP
layer, the trainer hooks and the client can all use it. No other module redefines these types.
"""

from __future__ import annotations

import base64
import binascii
import enum
import functools
import math
import typing
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

LogprobsMode = Literal["raw", "processed"]
OnSync = Literal["keep", "recompute", "abort"]
ON_SYNC_MODES: tuple[str, ...] = typing.get_args(OnSync)


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


GREEDY_BELOW = 1e-5  # a temperature in (0, GREEDY_BELOW) samples greedily (as vLLM does)
FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32: below it a value turns subnormal or 0
FLOAT32_MAX = 3.4028234663852886e38
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1  # the bound of every int64 fact: seeds (torch.Generator) and weight versions
MAX_N = 1024  # completions per prompt
MAX_LOGPROBS = 20  # top logprobs per token


def _doc(default: object, doc: str) -> Any:
    return field(default=default, metadata={"doc": doc})


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one prompt's completions: declared here once; HTTP models, the client and the
    trainer hook all build this class, none re-declares its rules.

    Invariant: a SamplingParams that exists is valid on its own. `__post_init__` checks every field
    and raises InvalidRequestError naming it ("sampling_params.<field>"); what depends on the served
    model (vocabulary, max_model_len) is `check_limits`, called once per request by the engine (and by
    the HTTP server before queueing, with the same code, so both paths refuse the same requests).

    Normalised on construction, so that every layer sees the same values:
    - a temperature in (0, 1e-5) becomes 0.0, greedy. Dividing logits by a smaller temperature
      overflows float32 (1e-40 is a float32 subnormal), which sampled garbage; vLLM draws the same line.
    - `stop`, `stop_token_ids` and `sample_max_tokens` become tuples (a lone string or id is one stop).
    `max_tokens` bounds every completion (the length checks read it); `sample_max_tokens` lowers it per
    completion (`for_sample`), so sample i of one group stops at its own length.
    Refused, naming the field: a value float32 cannot carry (temperature above 3.4e38; a non-zero
    top_p or min_p below 1.2e-38, which the device would round to a subnormal or to 0: top_p=1e-300
    masked every token), top_k beyond int32 and seed beyond int64.

    temperature == 0 is greedy. top_k <= 0 and top_p == 1 and min_p == 0 disable those filters.
    `logprobs_mode` says which distribution the reported logprobs come from:
    "raw" is log_softmax of the model's logits (what a trainer recomputes at temperature 1);
    "processed" is log_softmax after temperature, top-k, top-p and min-p (the sampling distribution).
    Penalties (presence and frequency over the completion's tokens, OpenAI's and vLLM's; repetition
    over prompt and completion, HF's) change the logits before anything else, so with one set both
    modes report logprobs of the penalized logits; a row without penalties is never touched.
    A seeded request gives the same completion whatever else runs in the batch; sample i of n
    uses the seed derived from (seed, i).
    """

    n: int = _doc(1, f"completions per prompt, 1..{MAX_N}")
    temperature: float = _doc(1.0, "0 (or below 1e-5) is greedy; at most 3.4e38 (float32)")
    top_k: int = _doc(0, "keep the k most likely tokens; 0 or -1 disable it")
    top_p: float = _doc(1.0, "nucleus sampling, in (0, 1]; 1 disables it; at least 1.2e-38 (float32)")
    min_p: float = _doc(0.0, "drop tokens below min_p x the top probability, in [0, 1]; 0 disables it")
    seed: int | None = _doc(None, "a seeded completion does not depend on the rest of the batch; 0..2**63-1")
    max_tokens: int = _doc(16, "new tokens per completion, >= 1; prompt + max_tokens must fit max_model_len")
    sample_max_tokens: tuple[int, ...] = _doc((), "one max_tokens per completion (n values, each in [1, "
                                              "max_tokens]), for samples of one prompt with lengths of their own; "
                                              "empty: max_tokens for all")
    stop_token_ids: tuple[int, ...] = _doc((), "token ids that end a completion (kept in its tokens)")
    stop: tuple[str, ...] = _doc((), "strings that end a completion (cut from its text)")
    ignore_eos: bool = _doc(False, "keep generating past the end-of-sequence token")
    logprobs: int = _doc(0, f"top-k logprobs per token besides the sampled one's, 0..{MAX_LOGPROBS}")
    logprobs_mode: Literal["raw", "processed"] = _doc(
        "raw", "raw: the model's log_softmax; processed: the sampling distribution")
    presence_penalty: float = _doc(0.0, "in [-2, 2]: subtracted from the logit of every token the completion "
                                        "has generated so far (OpenAI's); 0 disables it")
    frequency_penalty: float = _doc(0.0, "in [-2, 2]: subtracted from a token's logit once per time the "
                                         "completion has generated it (OpenAI's); 0 disables it")
    repetition_penalty: float = _doc(1.0, "in (0, 100]: the logit of every token of the prompt or the completion "
                                          "is divided by it when positive, multiplied when not (HF's); 1 disables it")
    return_routing: bool = _doc(False, "return the experts each MoE layer chose for every token the engine "
                                       "computed (prompt and completion but the last token), for routing replay "
                                       "in the trainer (docs/moe.md); MoE models only")

    MAX_N = MAX_N
    MAX_LOGPROBS = MAX_LOGPROBS

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if isinstance(self.stop_token_ids, int):
            object.__setattr__(self, "stop_token_ids", (self.stop_token_ids,))
        for name in ("stop", "stop_token_ids", "sample_max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, (tuple, list)):
                raise _bad(name, f"must be a list, got {type(value).__name__}")
            object.__setattr__(self, name, tuple(value))
        _check_int("n", self.n, 1, self.MAX_N)
        _check_float("temperature", self.temperature, 0.0, FLOAT32_MAX, "a finite number >= 0")
        if self.temperature < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)
        _check_int("top_k", self.top_k, -1, INT32_MAX)
        _check_float("top_p", self.top_p, FLOAT32_TINY, 1.0, "in (0, 1]")
        _check_float("min_p", self.min_p, 0.0, 1.0, "in [0, 1]")
        if 0.0 < self.min_p < FLOAT32_TINY:
            raise _bad("min_p", f"{self.min_p!r} underflows float32 (smallest normal {FLOAT32_TINY:.3g}); "
                                "use 0 to disable min_p")
        if self.seed is not None:
            _check_int("seed", self.seed, 0, INT64_MAX)
        _check_int("max_tokens", self.max_tokens, 1, None)
        if self.sample_max_tokens:
            if len(self.sample_max_tokens) != self.n:
                raise _bad("sample_max_tokens", f"needs one value per completion (n={self.n}), got "
                                                f"{len(self.sample_max_tokens)}")
            for t in self.sample_max_tokens:
                _check_int("sample_max_tokens", t, 1, self.max_tokens)
        _check_int("logprobs", self.logprobs, 0, self.MAX_LOGPROBS)
        if self.logprobs_mode not in ("raw", "processed"):
            raise _bad("logprobs_mode", f"must be 'raw' or 'processed', got {self.logprobs_mode!r}")
        for name in ("ignore_eos", "return_routing"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(name, f"must be true or false, got {getattr(self, name)!r}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, 0, None)
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0, "in [-2, 2]")
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0, "in [-2, 2]")
        _check_float("repetition_penalty", self.repetition_penalty, FLOAT32_TINY, 100.0, "in (0, 100]")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise _bad("stop", f"stop strings must be non-empty strings, got {s!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """Any penalty set: the engine changes this row's logits (inference/sample/penalties.py)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @functools.cached_property
    def stop_id_set(self) -> frozenset[int]:
        """stop_token_ids as a set: the per-token check of every row costs O(1), whatever their number."""
        return frozenset(self.stop_token_ids)

    def for_sample(self, index: int) -> SamplingParams:
        """The params completion `index` runs with: its own max_tokens when sample_max_tokens gives one."""
        if not self.sample_max_tokens:
            return self
        return replace(self, max_tokens=self.sample_max_tokens[index], sample_max_tokens=())

    def check_limits(self, vocab_size: int, max_model_len: int, num_prompt_tokens: int | None = None) -> None:
        """Refuse what the served model cannot do; InvalidRequestError naming the field otherwise.

        Policy (the same in-process and over HTTP): a completion is never cut short by max_model_len
        behind the caller's back. prompt + max_tokens must fit in max_model_len, else the request is
        refused with the number that fits: an RL trainer would otherwise score a truncated sample
        ("length") as if the policy had rambled. `num_prompt_tokens` None (before tokenization) checks
        what holds for any prompt (one token at least).
        """
        for t in self.stop_token_ids:
            if t >= vocab_size:
                raise _bad("stop_token_ids", f"token id {t!r} is outside the vocabulary [0, {vocab_size})")
        prompt = 1 if num_prompt_tokens is None else num_prompt_tokens
        if prompt >= max_model_len:
            raise InvalidRequestError("prompt", f"has {prompt} tokens; max_model_len is {max_model_len}, "
                                                "which leaves no room for a completion")
        if prompt + self.max_tokens > max_model_len:
            after = "any prompt" if num_prompt_tokens is None else f"a {prompt}-token prompt"
            raise _bad("max_tokens", f"{self.max_tokens} new tokens after {after} exceed max_model_len "
                                     f"({max_model_len}): at most {max_model_len - prompt} fit. Lower max_tokens "
                                     "or serve a longer max_model_len; completions are never cut short silently")

    @classmethod
    def from_dict(cls, data: dict) -> SamplingParams:
        """Build from a plain dict (HTTP, config); unknown keys are an error naming the key."""
        known = {f.name for f in fields(cls)}
        for key in data:
            if key not in known:
                raise _bad(key, "unknown field")
        return cls(**data)


def _bad(name: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(f"sampling_params.{name}", message)


def _check_int(name: str, value: object, lo: int, hi: int | None) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < lo or (hi is not None and value > hi):
        bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise _bad(name, f"must be an integer {bound}, got {value!r}")


def _check_float(name: str, value: object, lo: float, hi: float, what: str) -> None:
    """A number in [lo, hi]; below lo but above 0 is named as a float32 underflow."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise _bad(name, f"must be {what}, got {value!r}")
    if 0.0 < value < lo:
        raise _bad(name, f"{value!r} underflows float32 (smallest normal {FLOAT32_TINY:.3g}); must be {what}")
    if value < lo or value > hi:
        extra = " (float32)" if hi == FLOAT32_MAX else ""
        raise _bad(name, f"must be {what}{extra}, got {value!r}")


@dataclass(frozen=True)
class SyncPolicy:
    """What a request in flight does when a weight sync goes live (docs/dev/design.md, "Syncs during
    generation"); None fields take the engine's default (EngineConfig.on_sync; no staleness bound).

    on_sync: "keep" continues on the KV it has (its tokens before the sync came from the old weights);
    "recompute" recomputes its KV by prefill under the new weights, keeping its tokens; "abort" drops
    its tokens and restarts it from the prompt. Either way it is returned once, when it finishes.
    max_staleness=k: a sync that leaves its oldest token more than k target versions behind the live
    one restarts it from the prompt (its tokens cannot be made fresher: they came from those weights).
    Checked at construction (InvalidRequestError naming the field).
    """

    on_sync: OnSync | None = None
    max_staleness: int | None = None

    def __post_init__(self) -> None:
        if self.on_sync is not None and self.on_sync not in ON_SYNC_MODES:
            raise InvalidRequestError("on_sync", f"must be one of {', '.join(ON_SYNC_MODES)}, got {self.on_sync!r}")
        k = self.max_staleness
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= INT64_MAX):
            raise InvalidRequestError("max_staleness", f"must be an integer >= 0 (versions behind the live one) "
                                                       f"or null, got {k!r}")


DEFAULT_SYNC_POLICY = SyncPolicy()  # the engine's on_sync, no staleness bound


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
    # [(first token index, weight version), ...]: one entry unless the request ran across a sync; the
    # target's versions (which weights sampled each token)
    weight_version_spans: list[tuple[int, int]] = field(default_factory=list)
    # the same for the draft model (speculative decoding): its live version when each token was
    # committed; empty without a draft
    draft_version_spans: list[tuple[int, int]] = field(default_factory=list)
    restarts: int = 0  # times a sync restarted it from the prompt (on_sync="abort" or max_staleness)
    # with SamplingParams.return_routing: numpy uint8 (int16 beyond 256 experts) [tokens, moe layers, k],
    # row p the experts token p went to; tokens = prompt + completion - 1 (the last token is never
    # computed), fewer for an aborted completion (its rows computed so far); docs/moe.md. Left out of ==
    # (an array has no truth value): compare it with numpy.array_equal
    routing: Any = field(default=None, compare=False)

    def token_versions(self, draft: bool = False) -> list[int]:
        """The version of each token, expanded from its spans (the draft's with draft=True: empty
        without a draft)."""
        spans = self.draft_version_spans if draft else self.weight_version_spans
        out: list[int] = []
        for (start, version), end in zip(spans, [s for s, _ in spans[1:]] + [len(self.token_ids)]):
            out += [version] * (end - start)
        return out


@dataclass
class RequestOutput:
    """The result of one prompt: its completions and the weight version that produced them.

    `weight_version` is the oldest version that produced any of its tokens; a request that ran across
    a weight sync (held through a sleep, or on_sync="keep" / "recompute") has several spans in its
    completions' `weight_version_spans`.
    """

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    weight_version: int
    finished: bool = True
    prompt: str | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache, over all n samples
    # latency_s always; with a draft (or the batch-invariant mode's own draft) spec_acceptance_rate,
    # draft_tokens_proposed and draft_tokens_accepted; preemptions when the scheduler preempted a sample for
    # KV blocks; a fleet adds replica and retries. Sidecar's /metrics sums the counts over finished requests
    metrics: dict[str, float] = field(default_factory=dict)



# ---- routing (SamplingParams.return_routing; docs/moe.md) -----------------------------------------
ROUTING_DTYPES = ("uint8", "int16")


def routing_dtype(num_experts: int) -> str:
    """The dtype of a model's expert ids: uint8 up to 256 experts, int16 beyond (engine and trainer alike)."""
    return "uint8" if num_experts <= 256 else "int16"


def encode_routing(routing: Any) -> dict[str, Any]:
    """A routing array (numpy, [tokens, moe layers, k]) as JSON: {"data": base64 of its bytes, C order,
    little-endian; "shape": [tokens, moe layers, k]; "dtype": "uint8" or "int16"}."""
    import numpy as np

    arr = np.asarray(routing)
    if arr.dtype.name not in ROUTING_DTYPES or arr.ndim != 3:
        raise InvalidRequestError("routing", f"must be a 3-D uint8 or int16 array, got {arr.dtype.name} "
                                             f"{list(arr.shape)}")
    data = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<")).tobytes()
    return {"data": base64.b64encode(data).decode("ascii"), "shape": list(arr.shape), "dtype": arr.dtype.name}


def decode_routing(obj: Any) -> Any:
    """encode_routing's JSON back to the numpy array; InvalidRequestError naming "routing" if malformed."""
    import numpy as np

    if not isinstance(obj, dict) or set(obj) != {"data", "shape", "dtype"}:
        raise InvalidRequestError("routing", f"must be an object with data, shape and dtype, got {obj!r:.200}")
    shape, dtype = obj["shape"], obj["dtype"]
    if dtype not in ROUTING_DTYPES:
        raise InvalidRequestError("routing.dtype", f"must be one of {', '.join(ROUTING_DTYPES)}, got {dtype!r}")
    if (not isinstance(shape, list) or len(shape) != 3
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        raise InvalidRequestError("routing.shape", f"must be 3 integers >= 0 [tokens, moe layers, k], got {shape!r}")
    try:
        data = base64.b64decode(obj["data"], validate=True)
    except (TypeError, ValueError, binascii.Error) as e:
        raise InvalidRequestError("routing.data", f"is not base64: {e}") from None
    want = math.prod(shape) * np.dtype(dtype).itemsize
    if len(data) != want:
        raise InvalidRequestError("routing.data", f"holds {len(data)} bytes; shape {shape} of {dtype} needs {want}")
    return np.frombuffer(data, dtype=np.dtype(dtype).newbyteorder("<")).astype(dtype).reshape(shape)
