"""SamplingParams: declared once (inference/core.py), validated when built, one max_model_len policy
in-process and over HTTP, and only values float32 can carry."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from inference.core import InvalidRequestError, SamplingParams
from inference.engine.llm import LLM
from sidecar.api.app import ApiError, check_params
from sidecar.api.models import CompletionRequest, SamplingParamsModel

FIELDS = [f.name for f in dataclasses.fields(SamplingParams)]


@pytest.mark.parametrize("temperature", [1e-45, 1e-40, 1e-39, 1e-6, 9.99e-6, 0, 0.0])
def test_tiny_temperatures_are_greedy(temperature: float) -> None:
    p = SamplingParams(temperature=temperature)
    assert p.greedy and p.temperature == 0.0


def test_temperatures_from_1e_5_sample() -> None:
    assert not SamplingParams(temperature=1e-5).greedy and SamplingParams(temperature=3.0e38).temperature == 3.0e38


@pytest.mark.parametrize(("fields", "name", "message"), [
    ({"temperature": 1e39}, "temperature", "float32"),
    ({"temperature": float("inf")}, "temperature", "finite"),
    ({"temperature": float("nan")}, "temperature", "finite"),
    ({"temperature": -1e-9}, "temperature", ">= 0"),
    ({"top_p": 1e-300}, "top_p", "underflows float32"),
    ({"top_p": 1e-39}, "top_p", "underflows float32"),
    ({"top_p": 0.0}, "top_p", "(0, 1]"),
    ({"top_p": 1.0000001}, "top_p", "(0, 1]"),
    ({"min_p": 1e-300}, "min_p", "underflows float32"),
    ({"min_p": 1.5}, "min_p", "[0, 1]"),
    ({"top_k": 2**31}, "top_k", "integer"),
    ({"seed": 2**63}, "seed", "integer"),
    ({"seed": -1}, "seed", "integer"),
    ({"n": True}, "n", "integer"),
    ({"n": 1025}, "n", "integer"),
    ({"max_tokens": 0}, "max_tokens", "integer"),
    ({"logprobs": 21}, "logprobs", "integer"),
    ({"logprobs_mode": "softmax"}, "logprobs_mode", "raw"),
    ({"stop": ["ok", ""]}, "stop", "non-empty"),
    ({"stop_token_ids": [-1]}, "stop_token_ids", "integer"),
    ({"ignore_eos": 1}, "ignore_eos", "true or false"),
])
def test_bad_values_are_refused_when_built_naming_the_field(fields: dict, name: str, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message.replace("(", r"\(").replace("[", r"\[")) as e:
        SamplingParams(**fields)
    assert e.value.field == f"sampling_params.{name}"


def test_values_float32_carries_are_kept() -> None:
    p = SamplingParams(top_p=1e-30, min_p=2e-38, top_k=2**31 - 1, seed=2**63 - 1, stop="x", stop_token_ids=[3, 4])
    assert (p.top_p, p.min_p, p.stop, p.stop_token_ids) == (1e-30, 2e-38, ("x",), (3, 4))
    assert dataclasses.replace(p, n=2) == SamplingParams(**{**dataclasses.asdict(p), "n": 2})


def test_max_model_len_policy_refuses_instead_of_cutting_short() -> None:
    p = SamplingParams(max_tokens=54)
    p.check_limits(vocab_size=100, max_model_len=64, num_prompt_tokens=10)  # exactly fits
    with pytest.raises(InvalidRequestError, match="at most 54 fit") as e:
        SamplingParams(max_tokens=55).check_limits(100, 64, 10)
    assert e.value.field == "sampling_params.max_tokens"
    SamplingParams(max_tokens=63).check_limits(100, 64)  # before tokenization: a prompt has >= 1 token
    with pytest.raises(InvalidRequestError, match="any prompt"):
        SamplingParams(max_tokens=64).check_limits(100, 64)
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams().check_limits(100, 64, 64)
    assert e.value.field == "prompt"
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(stop_token_ids=(100,)).check_limits(100, 64, 3)
    assert e.value.field == "sampling_params.stop_token_ids"


def test_http_models_are_generated_from_the_dataclass() -> None:
    model_fields = SamplingParamsModel.model_fields
    assert list(model_fields) == FIELDS
    for f in dataclasses.fields(SamplingParams):
        assert model_fields[f.name].description == f.metadata["doc"]
        default = model_fields[f.name].get_default(call_default_factory=True)
        assert (tuple(default) if isinstance(default, list) else default) == f.default
    assert set(FIELDS) <= set(CompletionRequest.model_fields)
    body = CompletionRequest.model_validate({"prompt": "x", "stop": None, "seed": None, "logprobs_mode": "processed"})
    assert body.to_params() == SamplingParams(logprobs_mode="processed")


@pytest.mark.parametrize(("body", "field", "message"), [
    ({"top_p": 1e-300}, "sampling_params.top_p", "underflows float32"),
    ({"temperature": 1e39}, "sampling_params.temperature", "float32"),
    ({"max_tokens": 64}, "sampling_params.max_tokens", "exceed max_model_len"),
    ({"stop_token_ids": [100]}, "sampling_params.stop_token_ids", "outside the vocabulary"),
])
def test_http_refuses_with_the_same_rules_naming_the_field(body: dict, field: str, message: str) -> None:
    state = SimpleNamespace(vocab_size=100, plans=[SimpleNamespace(max_model_len=64)])
    with pytest.raises(ApiError, match=message) as e:
        check_params(SamplingParamsModel.model_validate(body), state, "sampling_params")
    assert (e.value.status, e.value.field) == (400, field)
    with pytest.raises(ApiError) as e:
        check_params(CompletionRequest.model_validate({"prompt": "x", **body}), state, "")
    assert e.value.field == field.removeprefix("sampling_params.")


@pytest.fixture(scope="module")
def tiny() -> LLM:
    return LLM(device="cpu", dtype="float32", kv_cache_bytes=4 << 20, max_model_len=64)


@pytest.mark.slow
def test_a_subnormal_temperature_gives_the_greedy_tokens(tiny: LLM) -> None:
    prompt = [5, 9, 13, 2, 7]
    greedy = tiny.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    tiny_t = tiny.generate(prompt, SamplingParams(temperature=1e-40, max_tokens=12, ignore_eos=True, seed=1))[0]
    assert tiny_t.outputs[0].token_ids == greedy.outputs[0].token_ids


@pytest.mark.slow
def test_the_engine_applies_the_same_max_model_len_policy(tiny: LLM) -> None:
    prompt = list(range(1, 11))
    (out,) = tiny.generate(prompt, SamplingParams(temperature=0.0, max_tokens=54, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 54 and out.outputs[0].finish_reason.value == "length"
    with pytest.raises(InvalidRequestError, match="at most 54 fit") as e:
        tiny.generate(prompt, SamplingParams(max_tokens=55))
    assert e.value.field.startswith("sampling_params.max_tokens")
    assert not tiny.has_unfinished()
