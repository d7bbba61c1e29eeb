"""A real `sidecar launch --quantization fp8` on the tiny model: a trainer's hook syncs bf16-side weights
into it (each rank quantizing as they land, its audits passing, its installed bytes checked against the
trainer's own application of the rule before it goes live) and it generates what an engine loaded from
the same weights quantized offline generates."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from inference.core import SamplingParams
from inference.engine.llm import LLM
from inference.models.tiny import TinyModelSpec, default_model_dir, random_weights
from inference.quant.installed import is_fp8_linear
from tests.test_fp8_engine import dequantized_copy
from trainer_hooks import WeightSyncHook, collect_weights
from trainer_hooks.toy_policy import ToyPolicy

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [[11, 12, 13, 14, 15], [40, 2, 7]]


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_fp8_sidecar_syncs_from_a_hook_and_generates(tmp_path: Path, tp: int) -> None:
    """At TP=2 each rank quantizes the full rows and installs its slice: both ranks' audits pass, each
    checks its share against the trainer's, and the tokens are TP=1's (fp32 on CPU: only the reduction
    order differs)."""
    from tests.helpers_sidecar import launch
    from trainer_hooks.client import SidecarClient

    model_dir = default_model_dir()
    policy = ToyPolicy.from_dir(model_dir).eval()
    new = random_weights(TinyModelSpec(seed=9))
    with torch.no_grad():
        for name, p in policy.named_parameters():
            p.copy_(new[name])
    trained = tmp_path / "trained"
    trained.mkdir()
    for f in Path(model_dir).iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            (trained / f.name).write_bytes(f.read_bytes())
    save_file({n: t.detach().contiguous() for n, t in collect_weights(policy)}, str(trained / "model.safetensors"))
    offline = LLM(dequantized_copy(trained, tmp_path / "deq"), device="cpu", dtype="float32")
    want = [o.outputs[0].token_ids for o in offline.generate(PROMPTS, GREEDY)]

    server = launch("--quantization", "fp8", "--tp", str(tp))
    try:
        with SidecarClient(server.url, timeout=60) as client, \
                WeightSyncHook(client, policy, log_path=server.log_path) as hook:
            with hook.training():
                pass  # the "training" already happened: the new weights above
            linears = sum(is_fp8_linear(n) for n, _ in collect_weights(policy))
            assert hook.stats["audit"] == "ok" and hook.stats["installed_checked"] == 2 * linears * tp
            # the linears are held in FP8: a quarter of the fp32 bytes the CPU rank holds otherwise
            unquantized = sum(t.numel() * 4 for _, t in collect_weights(policy))
            ranks = client.state()["ranks"]
            assert len(ranks) == tp and sum(ranks[0]["weights_bytes"].values()) < 0.75 * unquantized
            out = hook.rollouts(PROMPTS, GREEDY)
            assert [o.outputs[0].token_ids for o in out] == want
            assert out[0].weight_version == hook.version
    finally:
        server.stop()


@pytest.mark.slow
def test_a_fleet_of_tp2_and_tp1_fp8_replicas_checks_every_rank_and_leaves_out_a_skewed_one() -> None:
    """One sync into FP8 replicas of TP 2 and TP 1: the sender's one section of expected installed digests
    covers both TP sizes, and every rank checks its share before going live. The TP=2 replica's second rank
    installs other bytes (tests/fault_injection): that replica fails alone (neither of its ranks goes live)
    and is left out of rotation; the TP=1 replica passes its check and serves."""
    from tests.helpers_fault import skew_env
    from tests.helpers_sidecar import launch
    from trainer_hooks import Fleet

    policy = ToyPolicy.from_dir(default_model_dir()).eval()
    linears = sum(is_fp8_linear(n) for n, _ in collect_weights(policy))
    skewed = "model.layers.2.self_attn.v_proj.weight"
    servers = [launch("--quantization", "fp8", "--tp", "2", "--dp-rank", "0", env=skew_env(skewed, "dp0:pp0:tp1")),
               launch("--quantization", "fp8", "--dp-rank", "1")]
    try:
        with Fleet([s.url for s in servers], timeout=60) as fleet, WeightSyncHook(fleet, policy) as hook:
            with hook.training():
                pass
            assert hook.stats["installed_checked"] == 2 * linears  # the TP=1 replica's, which passed
            out = hook.stats["out_of_rotation"]
            assert list(out) == [fleet.replicas[0].name]
            assert skewed in out[fleet.replicas[0].name] and "dp0:pp0:tp1" in out[fleet.replicas[0].name]
            assert all(o.weight_version == hook.version for o in hook.rollouts(PROMPTS, GREEDY))
    finally:
        for s in servers:
            s.stop()
