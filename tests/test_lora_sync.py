"""LoRA served unmerged: a PEFT adapter loaded at launch and synced adapter-only; greedy outputs equal an
engine loaded with the merged weights; a flipped adapter byte fails the audit naming the tensor; unsupported
PEFT options are refused by name. Tiny fp32 Qwen2 (tied, qkv bias) on CPU."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from checksum import ChecksumMismatch
from inference.core import InvalidRequestError, SamplingParams
from inference.models.lora_adapter import read_adapter
from tests.helpers_lora import TARGETS, merged_dir, peft_model
from tests.helpers_weight_update import DIMS, Link

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [20, 21, 22, 23]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def _greedy(model_dir: Path, **options: Any) -> list[list[int]]:
    from inference.engine.llm import LLM

    llm = LLM(str(model_dir), device="cpu", dtype="float32", **options)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.fixture
def dirs(tmp_path: Path) -> dict[str, Path]:
    from tests.helpers_weight_update import tiny_model_dirs

    return tiny_model_dirs(tmp_path)


@pytest.mark.slow
def test_unmerged_adapter_equals_merged_weights(dirs: dict[str, Path], tmp_path: Path) -> None:
    model = peft_model(dirs["target"])
    model.save_pretrained(str(tmp_path / "adapter"))
    served = _greedy(dirs["target"], lora=str(tmp_path / "adapter"))
    assert served == _greedy(merged_dir(model, dirs["target"], tmp_path / "merged"))
    assert served != _greedy(dirs["target"])  # the adapter changes the outputs: the test can fail


@pytest.mark.parametrize(("option", "value"), [("use_dora", True), ("bias", "all"), ("modules_to_save", ["lm_head"]),
                                               ("rank_pattern", {"q_proj": 8}), ("fan_in_fan_out", True)])
def test_unsupported_peft_option_is_refused_by_name(tmp_path: Path, option: str, value: Any) -> None:
    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], option: value}
    (tmp_path / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(InvalidRequestError) as e:
        read_adapter(tmp_path)
    assert e.value.field == f"lora.{option}"


def test_adapter_only_sync_audits_the_adapter_and_a_flipped_byte_names_it(dirs: dict[str, Path],
                                                                          tmp_path: Path) -> None:
    from tests.helpers_fault import flipped_on_arrival
    from trainer_hooks.sources import peft_adapter_weights

    model = peft_model(dirs["target"])
    model.save_pretrained(str(tmp_path / "adapter"))
    worker = make_worker_with_adapter(dirs, tmp_path / "adapter")
    link = Link(worker)
    named = dict(peft_adapter_weights(model))
    assert len(named) == 2 * len(TARGETS) * DIMS["num_layers"]  # A and B of every adapted module
    with torch.no_grad():
        named = {n: t + 0.01 for n, t in named.items()}
    assert link.sync(named, 1).report.ok
    bad = "model.layers.1.self_attn.v_proj.lora_B.weight"
    with flipped_on_arrival(bad), pytest.raises(ChecksumMismatch) as e:
        link.sync(named, 2)
    assert [m.tensor for m in e.value.report.mismatches] == [bad] and bad in str(e.value)
    # a failed sync tears the model: an adapter-only sync is refused until the base comes with it
    with pytest.raises(InvalidRequestError, match="base weights are not intact"):
        link.sync(named, 3)


def make_worker_with_adapter(dirs: dict[str, Path], adapter: Path) -> Any:
    from inference.config import EngineConfig
    from inference.engine.worker import Worker

    worker = Worker(EngineConfig(model=str(dirs["target"]), device="cpu", dtype="float32", lora=str(adapter)))
    worker.init_device()
    worker.load_model()
    return worker


@pytest.mark.slow
def test_peft_model_trained_three_steps_syncs_adapter_only_to_sidecar_launch(dirs: dict[str, Path],
                                                                            tmp_path: Path) -> None:
    """The sidecar's first sync flips a byte of one adapter tensor: the audit fails naming it, the model is
    torn, and the hook's next sync carries the base beside the adapter; then adapter-only syncs."""
    from tests.helpers_fault import flip_env
    from tests.helpers_sidecar import launch
    from trainer_hooks import AuditError, SidecarClient, WeightSyncHook

    model = peft_model(dirs["target"])
    model.save_pretrained(str(tmp_path / "adapter"))
    bad = "model.layers.0.mlp.down_proj.lora_A.weight"
    server = launch("--model", str(dirs["target"]), "--lora", str(tmp_path / "adapter"), "--dtype", "float32",
                    env=flip_env(bad, times=1))
    try:
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        batch = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10]])
        with SidecarClient(server.url, timeout=60) as client, \
                WeightSyncHook(client, model, adapter_only=True, log_path=server.log_path) as hook:
            with pytest.raises(AuditError, match=bad.replace(".", r"\.")):
                hook.sync()
            assert client.state()["torn"]["target"]
            for _ in range(3):
                with hook.training():
                    model.train()
                    loss = model(input_ids=batch, labels=batch).loss
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad()
                    model.eval()
                    hook.after_optimizer_step()
                assert hook.stats["audit"] == "ok"
            out = hook.rollouts(PROMPTS, GREEDY)
            served = [o.outputs[0].token_ids for o in out]
            assert all(o.weight_version == hook.version == 3 for o in out)
        assert served == _greedy(merged_dir(model, dirs["target"], tmp_path / "merged"))
    finally:
        server.stop()


@pytest.mark.slow
def test_sleep_levels_keep_the_adapter(dirs: dict[str, Path], tmp_path: Path) -> None:
    """Level 1: outputs bit-identical after the wake. Level 2 drops the base but not the adapter: an
    adapter-only sync is refused, and a sync of the base alone brings the adapted outputs back."""
    from inference.engine.llm import LLM
    from inference.models.loader import iter_hf_tensors
    from trainer_hooks.sources import peft_adapter_weights

    model = peft_model(dirs["target"])
    model.save_pretrained(str(tmp_path / "adapter"))
    llm = LLM(str(dirs["target"]), device="cpu", dtype="float32", lora=str(tmp_path / "adapter"),
              kv_cache_bytes=2 << 20, block_size=4)
    before = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    llm.sleep(1)
    llm.wake_up()
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == before
    llm.sleep(2)
    llm.wake_up()
    link = Link(llm.worker)
    with pytest.raises(InvalidRequestError, match="base weights are not intact"):
        link.sync(dict(peft_adapter_weights(model)), 1)
    assert link.sync(dict(iter_hf_tensors(dirs["target"])), 1).report.ok
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == before


@pytest.mark.slow
def test_the_draft_serves_its_own_adapter_synced_adapter_only(dirs: dict[str, Path], tmp_path: Path) -> None:
    from inference.config import EngineConfig
    from inference.engine.worker import Worker
    from inference.models.lora_adapter import adapter_regions
    from trainer_hooks.sources import peft_adapter_weights

    target, draft = peft_model(dirs["target"]), peft_model(dirs["draft"], rank=2)
    target.save_pretrained(str(tmp_path / "target-adapter"))
    draft.save_pretrained(str(tmp_path / "draft-adapter"))
    worker = Worker(EngineConfig(model=str(dirs["target"]), draft_model=str(dirs["draft"]), device="cpu",
                                 dtype="float32", lora=str(tmp_path / "target-adapter"),
                                 draft_lora=str(tmp_path / "draft-adapter")))
    worker.init_device()
    worker.load_model()
    held = {n: t.held for n, t in adapter_regions(worker.models["draft"]).items()}
    named = dict(peft_adapter_weights(draft))
    assert held.keys() == named.keys() and all(torch.equal(held[n], t) for n, t in named.items())
    link = Link(worker)
    assert link.sync({n: t + 0.5 for n, t in named.items()}, 1, which="draft").report.ok
    assert all(torch.equal(held[n], t + 0.5) for n, t in named.items())
    with pytest.raises(InvalidRequestError, match="does not match the draft model's adapter"):
        link.sync(dict(peft_adapter_weights(target)), 2, which="draft")  # rank 4 into the rank-2 slots


@pytest.mark.slow
def test_launch_refuses_an_adapter_it_cannot_serve_before_spawning(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "use_dora": True}
    (tmp_path / "adapter_config.json").write_text(json.dumps(cfg))
    proc = subprocess.run([sys.executable, "-m", "sidecar.cli.main", "launch", "--device", "cpu", "--lora",
                           str(tmp_path), "--tp", "2"], cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "lora.use_dora" in proc.stderr, proc.stderr


def test_the_hook_sends_the_base_only_after_level_2_or_a_failed_sync(dirs: dict[str, Path]) -> None:
    """adapter_only: a level-1 step sends the adapter alone; after a level-2 sleep (the base dropped) and
    after a failed sync (the rank torn) the base comes with it, once."""
    from trainer_hooks import AuditError, WeightSyncHook

    sent: list[set[str]] = []
    reports = [{"ok": True}, {"ok": True}, {"ok": False, "summary": "x"}, {"ok": True}, {"ok": True}]

    class Client:
        def state(self) -> dict[str, Any]:
            return {"weight_versions": {"target": 0}}

        def sleep(self, level: int) -> dict[str, Any]:
            return {}

        def wake_up(self, tags: Any) -> dict[str, Any]:
            return {}

        def sync_weights(self, sender: Any, named: Any, version: int, **kw: Any) -> dict[str, Any]:
            sent.append({"base" if ".lora_" not in n else "adapter" for n, _ in named})
            return reports.pop(0)

    model = peft_model(dirs["target"])
    hook = WeightSyncHook(Client(), model, adapter_only=True)
    hook._sender = object()  # type: ignore[assignment]  # the fake client never uses it
    for level in (1, 2):
        hook.sleep_level = level
        with hook.training():
            pass
        hook.wake()  # as rollouts() does
    with pytest.raises(AuditError):
        hook.sync()
    hook.sync()
    hook.sync()
    assert sent == [{"adapter"}, {"base", "adapter"}, {"adapter"}, {"base", "adapter"}, {"adapter"}]
