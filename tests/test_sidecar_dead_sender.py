"""A trainer process SIGKILLed in the middle of a gloo sync: the sidecar lives on with its model torn,
refuses generation, and a new init + sync makes it serve again. The nccl twin (trainer and sidecar
on two GPUs) is in tests/test_multigpu_cuda.py and runs the same check."""

from __future__ import annotations

from pathlib import Path

import pytest

from inference.core import SamplingParams
from inference.engine.llm import LLM
from inference.models.tiny import TinyModelSpec, random_weights, write_model_dir
from tests.helpers_sidecar import KV_BYTES, check_killed_sender_recovers, launch

pytestmark = pytest.mark.slow  # every test here starts real processes or runs for seconds

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = ["The miller's daughter", [11, 12, 13, 14]]


def test_sender_killed_mid_update_over_gloo_leaves_the_sidecar_torn_and_a_new_init_recovers(tmp_path: Path) -> None:
    spec = TinyModelSpec(seed=6)
    reference = LLM(write_model_dir(spec, tmp_path / "v2"), device="cpu", kv_cache_bytes=KV_BYTES)
    want = [o.outputs[0].token_ids for o in reference.generate(PROMPTS, GREEDY)]
    server = launch("--transfer", "gloo")
    try:
        check_killed_sender_recovers(server, "gloo", "cpu", PROMPTS, GREEDY, random_weights(spec), want,
                                     bucket_bytes=256 << 10, dead_timeout_s=8.0)
    finally:
        assert server.stop() == 0, server.log
