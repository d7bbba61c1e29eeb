"""Request and response bodies of the HTTP API (pydantic; they are the OpenAPI schema at /docs).

Every request model forbids unknown fields and is strict about JSON types ("5" is not an integer),
so a typo or a wrong type is a 422 naming the field instead of a silently ignored option. Range
checks that depend on the model (vocabulary, KV cache) stay in inference.core / the engine.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from inference.core import SamplingParams

MAX_PROMPTS = 4096  # prompts in one call; n more samples each still count against the queue limit


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class SamplingParamsModel(_Request):
    """inference.core.SamplingParams as JSON; unset fields take its defaults."""

    n: int = Field(1, description=f"completions per prompt, 1..{SamplingParams.MAX_N}")
    temperature: float = Field(1.0, description="0 is greedy")
    top_k: int = Field(0, description="0 or -1 disable")
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = Field(None, description="a seeded completion does not depend on the rest of the batch")
    max_tokens: int = 16
    stop_token_ids: list[int] = Field(default_factory=list)
    stop: str | list[str] = Field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int = Field(0, description=f"top-k logprobs per token, 0..{SamplingParams.MAX_LOGPROBS}")
    logprobs_mode: Literal["raw", "processed"] = "raw"

    def to_params(self) -> SamplingParams:
        return SamplingParams.from_dict(self.model_dump(exclude_unset=True))


class GenerateRequest(_Request):
    prompts: list[str | list[int]] = Field(min_length=1, max_length=MAX_PROMPTS,
                                           description="strings, or lists of token ids")
    sampling_params: SamplingParamsModel | list[SamplingParamsModel] = Field(
        default_factory=SamplingParamsModel, description="one for all prompts, or one per prompt")
    wait: bool = Field(True, description="while asleep or torn: wait (true) or get 409 at once (false)")


class CompletionOut(BaseModel):
    index: int
    text: str | None
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    stop_reason: int | str | None = None
    top_logprobs: list[dict[str, float]] | None = None
    weight_version_spans: list[tuple[int, int]] = Field(
        default_factory=list, description="(first token index, weight version) runs")


class PromptOut(BaseModel):
    prompt: str | None
    prompt_token_ids: list[int]
    weight_version: int = Field(description="the oldest weight version that produced any of its tokens")
    num_cached_tokens: int
    completions: list[CompletionOut]


class GenerateResponse(BaseModel):
    outputs: list[PromptOut]


class CompletionRequest(_Request):
    """The OpenAI /v1/completions subset (plus top_k, min_p, ignore_eos, stop_token_ids, wait)."""

    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: int | None = None
    stream: bool = False
    user: str | None = None
    top_k: int = 0
    min_p: float = 0.0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    wait: bool = True

    def to_params(self) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              min_p=self.min_p, seed=self.seed, max_tokens=self.max_tokens, stop=stop,
                              stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
                              logprobs=self.logprobs or 0)

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class SleepRequest(_Request):
    level: int = Field(1, description="1: weights kept in host memory; 2: dropped (the next sync refills them)")
    in_flight: Literal["finish", "hold"] = Field("finish", description="finish running requests first, or hold them")


class WakeRequest(_Request):
    tags: list[str] | None = Field(None, description='"weights", "kv_cache"; null wakes everything')


class WeightsInitRequest(_Request):
    init_info: dict[str, Any] = Field(description="WeightSender.init_info() of the trainer")


class WeightsStartRequest(_Request):
    model: Literal["target", "draft"] = "target"
    version: int
    manifest: dict[str, Any] | list[Any] = Field(description="WeightSender.manifest(named_tensors, version)")
    allow_cast: bool = False


class WeightsUpdateRequest(_Request):
    update_info: Any = None


class WeightsFinishRequest(_Request):
    digests: list[dict[str, Any]] | dict[str, Any] = Field(
        description="the sender's digests: records {name, dtype, shape, digest} or a manifest")


class AuditRequest(_Request):
    model: Literal["target", "draft"] = "target"
    source: Literal["held", "received"] = Field(
        "held", description="held: the parameters each rank holds now; received: what the last sync delivered")
    expected: list[dict[str, Any]] | dict[str, Any] | None = Field(
        None, description="manifest(s) to compare against; for source=received also a list of sender records")


class ErrorBody(BaseModel):
    type: str
    message: str
    field: str | None = None
    rank: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
