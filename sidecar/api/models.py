"""Request and response bodies of the HTTP API (pydantic; they are the OpenAPI schema at /docs).

Every request model forbids unknown fields and is strict about JSON types ("5" is not an integer),
so a typo or a wrong type is a 422 naming the field instead of a silently ignored option. The
sampling fields are generated from inference.core.SamplingParams (its one declaration); every range
rule, and the checks that depend on the model (vocabulary, max_model_len), are SamplingParams' own,
so a bad value is the same 400 naming the field over HTTP as the InvalidRequestError in-process.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model

from inference.core import OnSync, SamplingParams, SyncPolicy
from sidecar.api.json_types import ExpectedJson, InitInfoJson, UpdateInfoJson

WAIT_DOC = ("when the model cannot generate now: true holds the call through a weight sync in progress, "
            "false answers 409 at once; while the sidecar sleeps, a model is torn or awaits its first sync "
            "the answer is 409 naming the state either way, unless it was launched with --hold-while-asleep "
            "(then true holds through those too)")


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


# SamplingParams travels as JSON: its tuples as lists (a lone stop string is one stop).
_JSON_SHAPES: dict[str, Any] = {"stop_token_ids": list[int], "stop": str | list[str],
                                "sample_max_tokens": list[int]}
SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


def sampling_fields(nullable: bool) -> dict[str, Any]:
    """pydantic definitions of every SamplingParams field, generated from the dataclass (its JSON type,
    default and doc). The models check JSON types only; every range rule is SamplingParams' own."""
    hints = typing.get_type_hints(SamplingParams)
    out: dict[str, Any] = {}
    for f in dataclasses.fields(SamplingParams):
        kind = _JSON_SHAPES.get(f.name, hints[f.name])
        spec = (Field(default_factory=list, description=f.metadata["doc"]) if isinstance(f.default, tuple)
                else Field(f.default, description=f.metadata["doc"]))
        out[f.name] = (kind | None if nullable else kind, spec)
    return out


class _Sampling(_Request):
    def to_params(self) -> SamplingParams:
        """The SamplingParams of this body: the fields it set (null counts as unset); its validation
        raises InvalidRequestError naming the field."""
        data = self.model_dump(include=set(SAMPLING_FIELDS), exclude_unset=True)
        return SamplingParams.from_dict({k: v for k, v in data.items() if v is not None})


SamplingParamsModel = create_model(
    "SamplingParamsModel", __base__=_Sampling, __doc__="inference.core.SamplingParams as JSON; unset fields "
    "take its defaults.", **sampling_fields(nullable=False))


class SyncFields(BaseModel):
    """What a weight sync that goes live while a request runs does to it (inference.core.SyncPolicy)."""

    on_sync: OnSync | None = Field(None, description="what a weight sync that goes live while these run does "
                                   "to them: keep (continue on their KV), recompute (KV recomputed under the new "
                                   "weights, tokens kept) or abort (restarted from the prompt); null: the "
                                   "sidecar's --on-sync (recompute unless set)")
    max_staleness: int | None = Field(None, ge=0, description="a sync that leaves a completion's oldest token more "
                                      "than this many target versions behind the live one restarts it from the "
                                      "prompt; null: no bound")

    def sync_policy(self) -> SyncPolicy:
        return SyncPolicy(self.on_sync, self.max_staleness)


class GenerateRequest(_Request, SyncFields):
    prompts: list[str | list[int]] = Field(min_length=1, description="strings, or lists of token ids; prompts x "
                                           "n at most --max-request-sequences (docs/limits.md)")
    sampling_params: SamplingParamsModel | list[SamplingParamsModel] = Field(
        default_factory=SamplingParamsModel, description="one for all prompts, or one per prompt")
    wait: bool = Field(True, description=WAIT_DOC)


class RoutingOut(BaseModel):
    """One completion's routing (sampling_params.return_routing; docs/moe.md): the expert ids each MoE layer
    chose for every token the engine computed, as an array [tokens, moe layers, k] in its raw bytes."""

    data: str = Field(description="base64 of the array's bytes: C order (token, then MoE layer, then the k "
                                  "experts in the router's order), little-endian")
    shape: list[int] = Field(description="[tokens, moe layers, k]; tokens = prompt + completion - 1 (every "
                                         "token but the last, which is never computed; fewer when aborted)")
    dtype: Literal["uint8", "int16"] = Field(description="uint8, or int16 beyond 256 experts")


class CompletionOut(BaseModel):
    index: int
    text: str | None
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    stop_reason: int | str | None = None
    top_logprobs: list[dict[str, float]] | None = None
    weight_version_spans: list[tuple[int, int]] = Field(
        default_factory=list, description="[first token index, target weight version] runs: token i came from "
        "the version of the last run starting at or before i")
    draft_version_spans: list[tuple[int, int]] = Field(
        default_factory=list, description="the same runs for the draft model's version (live when each token "
                                          "was committed); empty without --draft-model")
    restarts: int = Field(0, description="times a weight sync restarted it from the prompt (on_sync abort, or "
                                         "max_staleness); its tokens are all from after the last restart")
    routing: RoutingOut | None = Field(None, description="with sampling_params.return_routing: the experts of "
                                       "every computed token (trainer_hooks decodes it); null otherwise")


class PromptOut(BaseModel):
    prompt: str | None
    prompt_token_ids: list[int]
    weight_version: int = Field(description="the oldest weight version that produced any of its tokens")
    num_cached_tokens: int
    completions: list[CompletionOut]


class GenerateResponse(BaseModel):
    outputs: list[PromptOut]


class StreamOptions(BaseModel):
    """OpenAI's stream_options; other keys are ignored (OpenAI adds them over time)."""

    model_config = ConfigDict(extra="allow", strict=True)
    include_usage: bool | None = Field(None, description="a last chunk with empty choices and the usage")


class _OpenAIBody(_Sampling):
    """What both OpenAI bodies share. Unknown fields are kept (extra="allow") so that the route answers
    them as OpenAI's server does: one 400 naming the field (sidecar/api/openai.py)."""

    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = Field(None, description="the served model's name (--served-model-name); another is a "
                                                "404; null: the served model")
    stream: bool = Field(False, description="server-sent events: data: {chunk} ... data: [DONE]")
    stream_options: StreamOptions | None = Field(None, description="with stream: include_usage")
    user: str | None = None
    wait: bool = Field(True, description=WAIT_DOC)


class _CompletionBody(_OpenAIBody):
    """The OpenAI /v1/completions subset: every SamplingParams field (so also top_k, min_p, ignore_eos,
    stop_token_ids, logprobs_mode, the penalties) plus `echo` and `wait`. Sampling fields accept null
    as unset, as OpenAI clients send it; `logprobs` null (the default) returns no logprobs."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = Field(None, description="each choice's text starts with its prompt's")

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


_completion_sampling = sampling_fields(nullable=True)
_completion_sampling["logprobs"] = (int | None, Field(None, description="top-k logprobs per token, 0..20; "
                                                                        "null: no logprobs in the response"))
CompletionRequest = create_model("CompletionRequest", __base__=_CompletionBody, __doc__=_CompletionBody.__doc__,
                                 **_completion_sampling)


class ChatContentPart(_Request):
    type: Literal["text"] = Field(description="only text parts: the engine reads text")
    text: str


class ChatMessage(_Request):
    """One message as OpenAI clients send it; the model's chat template decides what each field means."""

    role: str
    content: str | list[ChatContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def template_dict(self) -> dict[str, Any]:
        """The message as a chat template reads it: text parts joined into one string, unset fields left out."""
        out = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            out["content"] = "".join(part.text for part in self.content)
        return out


class _ChatBody(_OpenAIBody):
    """The OpenAI /v1/chat/completions subset: messages rendered with the model's own chat template,
    n, temperature, top_p, max_tokens (or max_completion_tokens; unset: the rest of max_model_len),
    stop, seed, logprobs + top_logprobs, the penalties, and every other SamplingParams field (top_k,
    min_p, ignore_eos, stop_token_ids, logprobs_mode); plus `add_generation_prompt` and
    `chat_template_kwargs` (vLLM's: extra template variables such as enable_thinking) and `wait`.
    Sampling fields accept null as unset, as OpenAI clients send it."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, description="OpenAI's newer name of max_tokens")
    top_logprobs: int | None = Field(None, description="0..20 most likely tokens per position (needs logprobs)")
    add_generation_prompt: bool = Field(True, description="end the prompt with the assistant's turn header")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="extra variables for the template")

    def sampling_dict(self) -> dict[str, Any]:
        """The SamplingParams fields this body set (null counts as unset), with OpenAI's chat names mapped:
        logprobs true -> SamplingParams.logprobs = top_logprobs (0: the sampled token's only)."""
        data = self.model_dump(include=set(SAMPLING_FIELDS), exclude_unset=True)
        data = {k: v for k, v in data.items() if v is not None and k != "logprobs"}
        if self.max_completion_tokens is not None:
            data["max_tokens"] = self.max_completion_tokens
        if self.logprobs:
            data["logprobs"] = self.top_logprobs or 0
        return data


_chat_sampling = sampling_fields(nullable=True)
_chat_sampling["logprobs"] = (bool | None, Field(None, description="return each token's logprob (and "
                                                                   "top_logprobs alternatives)"))
_chat_sampling["max_tokens"] = (int | None, Field(None, description="new tokens per choice; unset: what "
                                                                    "max_model_len leaves after the prompt"))
ChatCompletionRequest = create_model("ChatCompletionRequest", __base__=_ChatBody, __doc__=_ChatBody.__doc__,
                                     **_chat_sampling)


class TokenizeRequest(_Request):
    """vLLM's /tokenize: a text `prompt`, or chat `messages` rendered with the model's template."""

    model: str | None = Field(None, description="the served model's name; another is a 404")
    prompt: str | None = Field(None, description="text to tokenize (or messages)")
    messages: list[ChatMessage] | None = Field(None, description="chat messages, rendered with the model's "
                                                                 "chat template first (or prompt)")
    add_special_tokens: bool | None = Field(None, description="add the tokenizer's special tokens (BOS); unset: "
                                                              "true for a prompt, false for messages")
    add_generation_prompt: bool = Field(True, description="messages: end with the assistant's turn header")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="messages: extra template variables")
    return_token_strs: bool = Field(False, description="also each token's text")


class DetokenizeRequest(_Request):
    model: str | None = Field(None, description="the served model's name; another is a 404")
    tokens: list[int] = Field(description="token ids, decoded with special tokens kept")


class SleepRequest(_Request):
    level: int = Field(1, description="1: weights kept in host memory; 2: dropped (the next sync refills them)")
    in_flight: Literal["finish", "hold"] = Field("finish", description="finish running requests first, or hold them")


class WakeRequest(_Request):
    tags: list[str] | None = Field(None, description='"weights", "kv_cache"; null wakes everything')


class PauseRequest(_Request):
    lease_s: float | None = Field(None, gt=0, description="hold generation this many seconds unless renewed "
                                                          "(another /pause) or ended (/resume); at most and "
                                                          "by default --max-pause-s")


class WeightSession(_Request):
    session_id: str = Field(description="init_info.session_id of the init that opened the session")
    nonce: str = Field(description="the nonce that init answered")
    bind_sender: bool = Field(False, description="the sender presents the nonce in the transfer group's plan "
                                                 "agreement (trainer_hooks/sync.py does): the ranks refuse the "
                                                 "bytes of a sender that does not")


class WeightsInitRequest(_Request):
    init_info: InitInfoJson = Field(description="WeightSender.init_info() of the trainer")
    protocol: int | None = Field(None, description="the weight-sync protocol the client speaks "
                                                   "(trainer_hooks.sync.SYNC_PROTOCOL); another one is a 409")
    nonce: str | None = Field(None, min_length=16, max_length=128, description="the session's nonce, drawn by "
                              "the client (one for every member of a fleet's group); null: the sidecar draws it")


class WeightsStartRequest(_Request):
    model: Literal["target", "draft"] = "target"
    version: int
    manifest: dict[str, Any] | list[Any] = Field(description="WeightSender.manifest(named_tensors, version)")
    allow_cast: bool = False


class WeightsUpdateRequest(_Request):
    """The one request of a sync: open the session (`start`), receive every bucket while the sender sends,
    then compare what every rank holds with the digests the sender delivers over the transfer group
    (WeightSender.send(deliver_digests=True)) and commit; the answer is the audit."""

    start: WeightsStartRequest = Field(description="the session's model, version and manifest; a start the "
                                                   "ranks refuse is a 400 naming the field, and the sender's "
                                                   "send() fails at once (the plan agreement is refused)")
    update_info: UpdateInfoJson = Field(None, description="null or {}; or one of those per rank, in rank order")
    session: WeightSession | None = Field(None, description="the session's owner, as POST /weights/init answered "
                                                            "it; another (or none) is a 409 naming `session`")


class AuditRequest(_Request):
    model: Literal["target", "draft"] = "target"
    source: Literal["held", "received"] = Field(
        "held", description="held: the parameters each rank holds now; received: what the last sync delivered")
    expected: ExpectedJson = Field(
        None, description="manifest(s) to compare against; for source=received also a list of sender records")


class ErrorBody(BaseModel):
    type: str
    message: str
    field: str | None = None
    rank: str | None = None
    param: str | None = Field(None, description="the same as field: where OpenAI clients read it")
    code: str | None = Field(None, description="OpenAI's error code where one applies (model_not_found, ...)")


class ErrorResponse(BaseModel):
    error: ErrorBody
