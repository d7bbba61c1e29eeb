"""Routing replay on transformers' MoE models (trainer_hooks/routing_replay.py): the routing recorded from a
forward, replayed, gives the same logits; replayed into a model whose router disagrees, it forces the
recorded experts (the model's own free routing differs) and weights them with that model's router; a
routing of the wrong shape is an error naming it."""

from __future__ import annotations

import pytest
import torch

from inference.core import InvalidRequestError
from tests.helpers_models import make_hf_checkpoint, random_prompts
from trainer_hooks.routing_replay import record_routing, replay_routing


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def hf(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    return make_hf_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


def forward(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def test_recorded_routing_replays_to_the_same_logits(hf: torch.nn.Module) -> None:
    ids = torch.tensor(random_prompts([12, 12], hf.config.vocab_size, seed=3))
    with record_routing(hf) as recorded:
        free = forward(hf, ids)
    (routing,) = recorded
    moe_layers = sum(1 for m in hf.modules() if type(m).__name__.endswith("TopKRouter"))
    assert routing.dtype == torch.uint8 and routing.shape == (24, moe_layers, 2)
    with replay_routing(hf, routing.view(2, 12, moe_layers, 2)), record_routing(hf) as again:
        replayed = forward(hf, ids)
    assert torch.equal(replayed, free)
    assert torch.equal(again[0], routing)


def test_replay_forces_the_rollouts_experts_into_a_disagreeing_router(hf: torch.nn.Module) -> None:
    ids = torch.tensor(random_prompts([40], hf.config.vocab_size, seed=4))
    with record_routing(hf) as recorded:
        forward(hf, ids)
    rollout = recorded[0]
    routers = [m for m in hf.modules() if type(m).__name__.endswith("TopKRouter")]
    saved = [r.weight.detach().clone() for r in routers]
    try:
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for r in routers:  # the trainer's router after some steps: another choice for some tokens
                r.weight.add_(0.5 * r.weight.std() * torch.randn(r.weight.shape, generator=g))
        with record_routing(hf) as free_routing:
            free = forward(hf, ids)
        assert not torch.equal(free_routing[0], rollout), "the perturbation must change some routing"
        with replay_routing(hf, rollout), record_routing(hf) as forced:
            replayed = forward(hf, ids)
        assert torch.equal(forced[0], rollout)
        assert not torch.allclose(replayed, free)
    finally:
        with torch.no_grad():
            for r, w in zip(routers, saved):
                r.weight.copy_(w)


def test_routing_of_the_wrong_shape_names_it(hf: torch.nn.Module) -> None:
    ids = torch.tensor(random_prompts([6], hf.config.vocab_size, seed=5))
    with record_routing(hf) as recorded:
        forward(hf, ids)
    with pytest.raises(InvalidRequestError, match="moe layer 0") as err, replay_routing(hf, recorded[0][:5]):
        forward(hf, ids)
    assert err.value.field == "routing"
    with pytest.raises(InvalidRequestError, match="moe layers"), replay_routing(hf, recorded[0].repeat(1, 2, 1)):
        pass
