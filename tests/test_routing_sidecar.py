"""Routing over HTTP, through a real `sidecar launch` of a tiny Qwen3-MoE model (CPU): /generate and the
rollout pool's takes carry each completion's routing as base64 with its shape and dtype, the client
decodes it into the array the engine returns in-process (bit for bit, in the batch-invariant mode), and
the OpenAI routes refuse the field naming it. Without a sidecar: the intake refuses it on a dense model
and counts its rows in the answer's size bound."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from inference.core import InvalidRequestError, SamplingParams
from inference.engine.llm import LLM
from inference.models.tiny import make_tiny_model
from sidecar.api.common import ApiError
from sidecar.api.intake import Intake
from tests.helpers_sidecar import KV_BYTES, Sidecar, launch
from trainer_hooks.client import SidecarClient

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [100, 200, 300, 7, 8], [42, 43, 44, 45, 46, 47, 48, 49, 50]]
SAMPLING = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True, return_routing=True)
ENGINE = ("--batch-invariant", "--block-size", "4")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("moe") / "m", "qwen3_moe", seed=3, num_layers=2)


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[Sidecar]:
    proc = launch("--model", str(model_dir), *ENGINE)
    try:
        yield proc
    finally:
        assert proc.stop() == 0, proc.log


def in_process(model_dir: Path) -> list[list[np.ndarray]]:
    llm = LLM(model_dir, device="cpu", kv_cache_bytes=KV_BYTES, batch_invariant=True, block_size=4)
    return [[c.routing for c in o.outputs] for o in llm.generate(PROMPTS, SAMPLING)]


@pytest.mark.slow
def test_generate_and_rollouts_carry_the_engines_routing(server: Sidecar, model_dir: Path) -> None:
    want = in_process(model_dir)
    with SidecarClient(server.url, timeout=60) as c:
        outs = c.generate(PROMPTS, SAMPLING)
        take = c.rollouts(PROMPTS, SAMPLING, min_groups=len(PROMPTS), timeout_s=120)
    for got in ([[x.routing for x in o.outputs] for o in outs],
                [[x.routing for x in o.outputs] for o in sorted(take.groups, key=lambda g: take.submitted.index(
                    g.request_id))]):
        for g, w in zip(got, want, strict=True):
            for a, b in zip(g, w, strict=True):
                assert a.dtype == np.uint8 and np.array_equal(a, b)
    for prompt, o in zip(PROMPTS, outs):
        assert all(x.routing.shape == (len(prompt) + len(x.token_ids) - 1, 2, 2) for x in o.outputs)
    with httpx.Client(base_url=server.url, timeout=60) as http:
        body = {"prompts": PROMPTS[:1], "sampling_params": {"max_tokens": 3, "return_routing": True}}
        wire = http.post("/generate", json=body).json()["outputs"][0]["completions"][0]["routing"]
        assert set(wire) == {"data", "shape", "dtype"} and wire["dtype"] == "uint8"
        assert len(base64.b64decode(wire["data"])) == int(np.prod(wire["shape"]))
        plain = http.post("/generate", json={"prompts": PROMPTS[:1], "sampling_params": {"max_tokens": 3}}).json()
        assert plain["outputs"][0]["completions"][0]["routing"] is None
        refused = http.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 3, "return_routing": True})
        assert refused.status_code == 400 and refused.json()["error"]["field"] == "return_routing"


def intake(routing_row_bytes: int, max_response_tokens: int = 1 << 27) -> Intake:
    return Intake(None, vocab_size=500, max_model_len=256, max_prompt_chars=1000, max_request_sequences=64,
                  max_response_tokens=max_response_tokens, routing_row_bytes=routing_row_bytes)


def test_the_intake_refuses_routing_on_a_dense_model_and_counts_its_rows() -> None:
    with pytest.raises(InvalidRequestError, match="dense") as e:
        intake(0).check_params(SamplingParams(return_routing=True))
    assert e.value.field == "sampling_params.return_routing"
    intake(4).check_params(SamplingParams(return_routing=True))
    # 2 x (100 + 16) rows of one 8-byte word, over the 16 x 2 tokens: past a bound of 256
    params = [SamplingParams(n=2, max_tokens=16, return_routing=True)]
    assert intake(8, 256).encode([[1] * 100], [SamplingParams(n=2, max_tokens=16)])
    with pytest.raises(ApiError) as refused:
        intake(8, 256).encode([[1] * 100], params)
    assert (refused.value.status, refused.value.field) == (400, "sampling_params.return_routing")
    assert intake(8, 300).encode([[1] * 100], params)
