"""`sidecar launch` on the GPU: HTTP generation equals the in-process engine, TP=2 over NCCL equals
TP=1, and a level-2 sleep -> ipc weight sync -> wake cycle serves the trainer's new weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from inference.core import SamplingParams
from inference.engine.llm import LLM
from inference.models.tiny import TinyModelSpec, random_weights, write_model_dir
from inference.transfer.sender import WeightSender
from sidecar.client import SidecarClient
from tests.helpers_sidecar import KV_BYTES, launch

pytestmark = pytest.mark.cuda

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
PROMPTS = ["The river ran slowly past the old mill", [7, 8, 9, 10, 11]]


def _tokens(outs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_cuda_generate_then_ipc_sync_serves_the_new_weights(tmp_path: Path) -> None:
    want = _tokens(LLM(device="cuda", kv_cache_bytes=KV_BYTES).generate(PROMPTS, GREEDY))
    spec = TinyModelSpec(seed=1)
    want_new = _tokens(LLM(write_model_dir(spec, tmp_path / "v1"), device="cuda",
                           kv_cache_bytes=KV_BYTES).generate(PROMPTS, GREEDY))
    new = {k: v.to("cuda:0") for k, v in random_weights(spec).items()}
    server = launch("--device", "cuda")
    sender = WeightSender("ipc", num_receivers=1, timeout_s=120, device="cuda:0")
    try:
        with SidecarClient(server.url, timeout=120) as c:
            assert _tokens(c.generate(PROMPTS, GREEDY)) == want
            c.sleep(level=2)
            c.wake_up(["weights"])
            c.connect_sender(sender)
            result = c.sync_weights(sender, new, version=1, allow_cast=True)  # fp32 checkpoint, bf16 engine
            assert result["ok"], result["table"]
            c.wake_up(["kv_cache"])
            got = c.generate(PROMPTS, GREEDY)
            assert _tokens(got) == want_new and {o.weight_version for o in got} == {1}
    finally:
        sender.close()
        assert server.stop() == 0, server.log


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_cuda_tp2_over_nccl_equals_tp1() -> None:
    want = _tokens(LLM(device="cuda", dtype="float32", kv_cache_bytes=KV_BYTES).generate(PROMPTS, GREEDY))
    server = launch("--device", "cuda", "--tp", "2", "--dtype", "float32")
    try:
        with SidecarClient(server.url, timeout=120) as c:
            assert _tokens(c.generate(PROMPTS, GREEDY)) == want
            assert [r["device"] for r in c.state()["ranks"]] == ["cuda:0", "cuda:1"]
    finally:
        assert server.stop() == 0, server.log


def test_launch_on_a_qwen2_05b_shape_serves_generation(tmp_path: Path) -> None:
    from inference.models.tiny import make_tiny_model

    model = make_tiny_model(tmp_path / "q05", family="qwen2", hidden_size=896, num_layers=24, num_heads=14,
                            num_kv_heads=2, intermediate_size=4864, vocab_size=151936, dtype="bfloat16",
                            max_position_embeddings=4096)
    server = launch("--model", str(model), "--device", "cuda", "--kv-cache-bytes", str(2 << 30))
    try:
        with SidecarClient(server.url, timeout=300) as c:
            outs = c.generate([[1, 2, 3, 4, 5]] * 4 + [list(range(10, 300))],
                              SamplingParams(temperature=1.0, seed=0, max_tokens=32, ignore_eos=True))
            assert [len(o.outputs[0].token_ids) for o in outs] == [32] * 5
            assert {o.weight_version for o in outs} == {0}
            assert c.state()["ranks"][0]["device"] == "cuda:0"
    finally:
        assert server.stop() == 0, server.log
