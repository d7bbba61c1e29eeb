"""Weight sync of an MoE model through a real `sidecar launch` (CPU, gloo): the trainer's changed expert
tensors (one HF tensor per expert and projection, as a checkpoint holds them) land in the fused expert
parameters, and the sidecar then generates what transformers generates from the trainer's weights; a byte
flipped in one expert's tensor on arrival fails the audit naming that tensor and the rank. A WeightSyncHook
over a transformers 5 MoE model (experts fused in memory) syncs the same way."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from inference.core import SamplingParams
from inference.models.tiny import make_tiny_model
from inference.transfer.sender import WeightSender
from tests.helpers_fault import flip_env
from tests.helpers_sidecar import launch
from tests.helpers_weight_update import RANK
from trainer_hooks import WeightSyncHook
from trainer_hooks.client import SidecarChecksumError, SidecarClient

pytestmark = pytest.mark.slow
PROMPTS = [[5, 6, 7, 8, 9], [100, 200, 300, 7, 8], [42, 43]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
FLIPPED = "model.layers.1.mlp.experts.3.up_proj.weight"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("moe") / "m", "qwen3_moe", seed=3, num_layers=2)


@pytest.fixture
def sender() -> Iterator[WeightSender]:
    s = WeightSender("gloo", num_receivers=1, timeout_s=60.0)
    try:
        yield s
    finally:
        s.close()


def trained(model_dir: Path) -> dict[str, torch.Tensor]:
    """The checkpoint with every expert of layer 0 redrawn: what a trainer holds after its steps."""
    gen = torch.Generator().manual_seed(9)
    state = load_file(str(model_dir / "model.safetensors"))
    for name, t in state.items():
        if name.startswith("model.layers.0.mlp.experts."):
            state[name] = torch.randn(t.shape, generator=gen) / t.shape[1] ** 0.5
    return state


def hf_greedy(model_dir: Path, state: dict[str, torch.Tensor], out: Path) -> list[list[int]]:
    """What transformers generates from `state` (the trainer's model's prediction)."""
    import transformers

    shutil.copytree(model_dir, out)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    got = []
    for p in PROMPTS:
        ids = torch.tensor([p])
        gen = hf.generate(ids, max_new_tokens=GREEDY.max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                          attention_mask=torch.ones_like(ids))
        got.append(gen[0, len(p):].tolist())
    return got


def test_a_sync_of_changed_experts_changes_the_output_as_the_trainer_predicts(
        model_dir: Path, sender: WeightSender, tmp_path: Path) -> None:
    state = trained(model_dir)
    want = hf_greedy(model_dir, state, tmp_path / "trained")
    proc = launch("--model", str(model_dir))
    try:
        with SidecarClient(proc.url, timeout=120) as c:
            before = [o.outputs[0].token_ids for o in c.generate(PROMPTS, GREEDY)]
            assert before != want, "the redrawn experts must change the output for this test to mean anything"
            c.connect_sender(sender)
            result = c.sync_weights(sender, state, version=1)
            assert result["ok"] and result["tensors_checked"] == len(state), result["table"]
            assert [o.outputs[0].token_ids for o in c.generate(PROMPTS, GREEDY)] == want
    finally:
        assert proc.stop() == 0, proc.log


def test_a_hook_over_a_transformers_moe_model_syncs_its_fused_experts(model_dir: Path, sender: WeightSender,
                                                                      tmp_path: Path) -> None:
    """transformers 5 holds a layer's experts fused ([E, 2I, H] gate_up, [E, H, I] down): WeightSyncHook
    sends them as they are, and each fills our fused parameter whole."""
    import transformers

    state = trained(model_dir)
    want = hf_greedy(model_dir, state, tmp_path / "trained")
    trainer = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "trained", dtype=torch.float32).eval()
    assert "model.layers.0.mlp.experts.gate_up_proj" in dict(trainer.named_parameters())
    proc = launch("--model", str(model_dir))
    try:
        with SidecarClient(proc.url, timeout=120) as c:
            result = WeightSyncHook(c, trainer, sender=sender).sync()
            assert result is not None and result["ok"], result
            assert [o.outputs[0].token_ids for o in c.generate(PROMPTS, GREEDY)] == want
    finally:
        assert proc.stop() == 0, proc.log


def test_a_flipped_expert_byte_fails_the_audit_naming_the_tensor_and_rank(model_dir: Path,
                                                                         sender: WeightSender) -> None:
    state = trained(model_dir)
    assert FLIPPED in state
    proc = launch("--model", str(model_dir), env=flip_env(FLIPPED))
    try:
        with SidecarClient(proc.url, timeout=120) as c:
            c.connect_sender(sender)
            with pytest.raises(SidecarChecksumError) as err:
                c.sync_weights(sender, state, version=1)
            assert FLIPPED in err.value.message and err.value.rank == RANK, err.value.message
            assert c.state()["torn"] == {"target": True}
    finally:
        assert proc.stop() == 0, proc.log
