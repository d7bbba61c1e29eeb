"""A sidecar outlives its trainer: the README's "attach it to your own loop" run twice against one real
`sidecar launch`. The second trainer attaches to a sidecar the first left asleep, and its first rollouts
are served by its own weights (version and digests), with no manual step; with sync_on_attach=False it
refuses another trainer's weights instead of generating from them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from checksum import Manifest, compare, digest_tensors
from inference.core import SamplingParams
from inference.models.tiny import default_model_dir
from tests.helpers_sidecar import Sidecar, launch
from trainer_hooks import AttachError, WeightSyncHook, collect_weights
from trainer_hooks.client import SidecarClient
from trainer_hooks.toy_policy import ToyPolicy

pytestmark = pytest.mark.slow  # every test here starts real processes or runs for seconds

SAMPLING = SamplingParams(n=2, temperature=1.0, max_tokens=4, seed=0)
PROMPTS = [[11, 12, 13], [21, 22]]


@pytest.fixture(scope="module")
def server() -> Iterator[Sidecar]:
    proc = launch()
    try:
        yield proc
    finally:
        proc.stop()


def _trainer(seed: int) -> torch.nn.Module:
    """A policy loaded from the checkpoint the sidecar serves, then moved away from it ("trained")."""
    policy = ToyPolicy.from_dir(default_model_dir())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.01)
    return policy


def _readme_loop(url: str, model: torch.nn.Module, steps: int, **hook_args: Any) -> tuple[WeightSyncHook, list[Any]]:
    """The README loop: rollouts, then a training step inside hook.training(). Returns the hook and the
    first rollouts."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    first: list[Any] = []
    hook = WeightSyncHook(SidecarClient(url, timeout=60), model, sleep_level=1, **hook_args)
    for _ in range(steps):
        outs = hook.rollouts(PROMPTS, SAMPLING)
        first = first or outs
        with hook.training():
            logits = model(torch.tensor([outs[0].prompt_token_ids + list(outs[0].outputs[0].token_ids)]))
            logits.float().logsumexp(-1).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    return hook, first


def _serves_trainer(client: SidecarClient, model: torch.nn.Module) -> bool:
    """Whether the sidecar's last sync delivered exactly this model's tensors (its received digests)."""
    received = [Manifest.from_dict(m) for m in client.checksums("target", "received")]
    named = collect_weights(model)
    mine = Manifest("target", received[0].weight_version, received[0].rank,
                    tuple(digest_tensors(named, algorithm=received[0].algorithm)), received[0].algorithm)
    return all(compare(mine, r).ok for r in received)


@pytest.mark.slow
def test_a_second_trainer_attaches_and_serves_its_own_weights(server: Sidecar) -> None:
    first_hook, _ = _readme_loop(server.url, _trainer(1), steps=2)
    first_hook.close()
    client = SidecarClient(server.url, timeout=60)
    left = client.state()
    assert left["sleeping"], "the README loop ends with the sidecar asleep (the case a new trainer meets)"
    assert left["weight_versions"]["target"] == first_hook.version

    second = _trainer(2)
    hook = WeightSyncHook(SidecarClient(server.url, timeout=60), second, sleep_level=1)
    hook.wake()  # a new hook's wake wakes the sidecar the first trainer left asleep
    assert not client.state()["sleeping"]
    outs = hook.rollouts(PROMPTS, SAMPLING)  # attach: syncs the trainer's own weights first
    assert hook.version == first_hook.version + 1
    assert {o.weight_version for o in outs} == {hook.version}
    assert all(s[1] == hook.version for o in outs for c in o.outputs for s in c.weight_version_spans)
    assert _serves_trainer(client, second) and not _serves_trainer(client, _trainer(1))
    hook.close()

    # The README loop run again from the start, against the sidecar left asleep once more.
    third = _trainer(3)
    hook, first = _readme_loop(server.url, third, steps=1)
    assert {o.weight_version for o in first} == {hook.version - 1}  # its own sync, before its first rollouts
    hook.close()

    # The loop ended with the KV cache asleep and the weights awake (its last sync): a new trainer that
    # starts by training puts the weights away too.
    assert client.state()["tags"] == {"weights": "awake", "kv_cache": "asleep_empty"}
    fourth = WeightSyncHook(SidecarClient(server.url, timeout=60), _trainer(4))
    fourth.sleep()
    assert client.state()["tags"]["weights"] == "asleep_mirrored"
    fourth.close()


def test_sync_on_attach_false_refuses_weights_that_are_not_the_trainers(server: Sidecar) -> None:
    owner = _trainer(4)
    hook, _ = _readme_loop(server.url, owner, steps=1)
    hook.close()
    other = WeightSyncHook(SidecarClient(server.url, timeout=60), _trainer(5), sync_on_attach=False)
    with pytest.raises(AttachError, match=r"serves target v\d+, not this trainer's weights.*sync_on_attach=True"):
        other.rollouts(PROMPTS, SAMPLING)
    # the trainer that holds the live weights attaches without a sync
    same = WeightSyncHook(SidecarClient(server.url, timeout=60), owner, sync_on_attach=False)
    outs = same.rollouts(PROMPTS, SAMPLING)
    assert same.syncs == 0 and {o.weight_version for o in outs} == {hook.version}


@pytest.mark.slow
def test_a_fleet_attaches_to_replicas_left_half_asleep() -> None:
    """A new hook on a Fleet whose replicas an earlier trainer (or a restart) left in different states:
    one asleep, one awake. The hook wakes what sleeps, syncs, and both replicas serve its weights."""
    from tests.helpers_sidecar import launched
    from trainer_hooks import Fleet

    with launched(["--dp-rank", "0"], ["--dp-rank", "1"]) as servers:
        SidecarClient(servers[0].url, timeout=60).sleep(1)
        with Fleet([s.url for s in servers], timeout=60) as fleet:
            trainer = _trainer(6)
            hook = WeightSyncHook(fleet, trainer)
            hook.wake()
            outs = hook.rollouts(PROMPTS * 3, SAMPLING)
            assert fleet.in_rotation == [0, 1], fleet.rotation()
            assert {o.weight_version for o in outs} == {hook.version} == {1}
            assert {o.metrics["replica"] for o in outs} == {0, 1}
            for s in servers:
                assert _serves_trainer(SidecarClient(s.url, timeout=60), trainer)
            hook.close()
