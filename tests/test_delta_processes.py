"""Delta syncs with real `sidecar launch` processes over gloo: a trainer's loop of AdamW steps (fp32
master weights, bf16 sent, as mixed-precision trainers do) syncs deltas after the first full sync, and
the sidecar's greedy outputs equal a fresh engine loaded with the trainer's weights; a sidecar that
slept at level 2 or missed a version gets a full sync; a fleet of three replicas takes deltas in one
group. In one process: tests/test_delta_sync.py."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from inference.core import SamplingParams
from inference.engine.llm import LLM
from inference.models.tiny import default_model_dir
from inference.transfer.sender import WeightSender
from tests.helpers_sidecar import KV_BYTES, connect_replicas, launch, launched, sync_replicas
from trainer_hooks import Fleet, WeightSyncHook, collect_weights
from trainer_hooks.client import SidecarClient
from trainer_hooks.toy_policy import ToyPolicy

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [[11, 12, 13, 14, 15], [21, 22, 23], [5, 6, 7, 8, 9, 10]]
BF16 = ("--dtype", "bfloat16")


class Trainer:
    """A tiny policy trained with AdamW on fp32 master weights; `sent()` is what it syncs (bf16)."""

    def __init__(self, lr: float = 1e-3) -> None:
        torch.manual_seed(0)
        self.policy = ToyPolicy.from_dir(default_model_dir())
        self.opt = torch.optim.AdamW(self.policy.parameters(), lr=lr)

    def step(self) -> None:
        ids = torch.tensor([PROMPTS[0] + PROMPTS[1]])
        logits = self.policy(ids)
        loss = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()

    def sent(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().to(torch.bfloat16) for n, p in collect_weights(self.policy)}


def _fresh_engine_outputs(weights: dict[str, torch.Tensor], root: Path) -> list[list[int]]:
    """Greedy tokens of a fresh in-process engine loaded from a checkpoint of `weights`."""
    out = root / "fresh"
    shutil.copytree(default_model_dir(), out)
    save_file({n: t.contiguous() for n, t in weights.items()}, str(out / "model.safetensors"))
    llm = LLM(str(out), device="cpu", dtype="bfloat16", kv_cache_bytes=KV_BYTES)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    finally:
        llm.worker.shutdown()


@pytest.fixture(scope="module")
def server() -> Iterator[Any]:
    proc = launch(*BF16)
    try:
        yield proc
    finally:
        proc.stop()


@pytest.mark.slow
def test_a_training_loop_syncs_deltas_and_serves_exactly_the_trainers_weights(server: Any, tmp_path: Path) -> None:
    trainer = Trainer()
    sender = WeightSender("gloo", timeout_s=60, delta=True)
    modes = []
    with SidecarClient(server.url, timeout=60) as client:
        try:
            client.connect_sender(sender)
            version = client.state()["weight_versions"]["target"]
            for _ in range(4):  # the first sync is full, then one per optimizer step
                version += 1
                assert client.sync_weights(sender, trainer.sent(), version)["ok"]
                modes.append((sender.last_sync["mode"], sender.last_sync["wire_bytes"],
                              sender.last_sync["full_bytes"]))
                if len(modes) < 4:
                    trainer.step()
            got = [o.outputs[0].token_ids for o in client.generate(PROMPTS, GREEDY)]

            client.sleep(level=2)  # the weights are dropped: the next sync is full, automatically
            client.wake_up()
            trainer.step()
            version += 1
            assert client.sync_weights(sender, trainer.sent(), version)["ok"]
            after_sleep = sender.last_sync["mode"]
        finally:
            sender.close()
    assert [m for m, _, _ in modes] == ["full", "delta", "delta", "delta"]
    assert all(wire < full for _, wire, full in modes[1:]), modes
    assert after_sleep == "full"
    assert got == _fresh_engine_outputs(_sent_before_sleep(), tmp_path)


def _sent_before_sleep() -> dict[str, torch.Tensor]:
    trainer = Trainer()  # the same seed and steps give the same weights
    for _ in range(3):
        trainer.step()
    return trainer.sent()


@pytest.mark.slow
def test_a_fleet_of_three_takes_deltas_and_one_that_missed_a_version_makes_the_sync_full(tmp_path: Path) -> None:
    trainer = Trainer()
    with launched(BF16, BF16, BF16) as servers:
        clients = [SidecarClient(s.url, timeout=60) for s in servers]
        sender = WeightSender("gloo", num_receivers=3, timeout_s=60, delta=True)
        try:
            connect_replicas(clients, sender)
            modes = []
            for version in (1, 2, 3):
                assert all(a["ok"] for a in sync_replicas(clients, sender, trainer.sent(), version))
                modes.append(sender.last_sync["mode"])
                trainer.step()
            assert modes == ["full", "delta", "delta"]
            # replica 2 misses version 4 (another sender brings it to 4 on its own)
            other = WeightSender("gloo", timeout_s=60)
            try:
                clients[2].connect_sender(other)
                assert clients[2].sync_weights(other, trainer.sent(), 4)["ok"]
            finally:
                other.close()
            trainer.step()
            connect_replicas(clients, sender)
            assert all(a["ok"] for a in sync_replicas(clients, sender, trainer.sent(), 5))
            assert sender.last_sync["mode"] == "full"  # replica 2 holds 4, the others 3: no common base
            trainer.step()
            assert all(a["ok"] for a in sync_replicas(clients, sender, trainer.sent(), 6))
            assert sender.last_sync["mode"] == "delta"
            outs = [[o.outputs[0].token_ids for o in c.generate(PROMPTS, GREEDY)] for c in clients]
        finally:
            sender.close()
            for c in clients:
                c.close()
        assert outs[0] == outs[1] == outs[2] == _fresh_engine_outputs(trainer.sent(), tmp_path)

        # the same through a Fleet and the hook: a bf16 policy (its parameters are what is sent)
        policy = Trainer()
        policy.policy.to(torch.bfloat16)
        policy.opt = torch.optim.AdamW(policy.policy.parameters(), lr=1e-2)
        hook_modes = []
        with Fleet([s.url for s in servers], timeout=60) as fleet, \
                WeightSyncHook(fleet, policy.policy, delta=True) as hook:
            for _ in range(3):
                with hook.training():
                    policy.step()
                hook_modes.append(fleet._group.sender.last_sync["mode"])
            hook.wake()
        hook_outs = []
        for s in servers:
            with SidecarClient(s.url, timeout=60) as client:
                hook_outs.append([o.outputs[0].token_ids for o in client.generate(PROMPTS, GREEDY)])
        assert hook_modes == ["full", "delta", "delta"]
        assert hook_outs[0] == hook_outs[1] == hook_outs[2] == _fresh_engine_outputs(policy.sent(), tmp_path / "hook")
