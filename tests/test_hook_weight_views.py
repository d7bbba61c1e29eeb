"""WeightSyncHook reuses a plain module's collected weights (views of its parameters) between syncs, sees
an optimizer step through them, and collects afresh as soon as a parameter or a submodule is replaced."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from trainer_hooks import WeightSyncHook, collect_weights


class Sink:
    """A client whose sync_weights keeps what it was handed."""

    def __init__(self) -> None:
        self.sent: list[list[tuple[str, torch.Tensor]]] = []

    def state(self) -> dict[str, Any]:
        return {"weight_versions": {"target": 0}, "transfer": {"num_receivers": 1}}

    def sync_weights(self, sender: Any, named: Any, version: int, model: str = "target", **kw: Any) -> dict[str, Any]:
        self.sent.append(list(named))
        return {"ok": True, "table": ""}


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 2)))


def sync(hook: WeightSyncHook, sink: Sink) -> dict[str, torch.Tensor]:
    hook.sync()
    return dict(sink.sent[-1])


def test_views_are_reused_and_show_an_in_place_optimizer_step() -> None:
    net, sink = model(), Sink()
    hook = WeightSyncHook(sink, net)
    hook._sender = object()  # type: ignore[assignment]  # the sink never uses it
    first = sync(hook, sink)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(1.0)  # what optimizer.step() does: same Parameter, same storage
    second = sync(hook, sink)
    assert all(second[n] is first[n] for n in first), "a valid view was collected again"
    assert {n: t.tolist() for n, t in second.items()} == {n: t.tolist() for n, t in collect_weights(net)}


def test_a_replaced_parameter_or_submodule_is_collected_afresh() -> None:
    net, sink = model(), Sink()
    hook = WeightSyncHook(sink, net)
    hook._sender = object()  # type: ignore[assignment]
    sync(hook, sink)
    net[0].weight = nn.Parameter(torch.full((8, 4), 3.0))
    assert torch.equal(sync(hook, sink)["0.weight"], torch.full((8, 4), 3.0))
    net[2] = nn.Sequential(nn.Linear(8, 2))
    nn.init.constant_(net[2][0].bias, 7.0)
    assert torch.equal(sync(hook, sink)["2.0.bias"], torch.full((2,), 7.0))
    net[2][0].bias.data = torch.full((2,), 5.0)  # new storage under the same Parameter
    assert torch.equal(sync(hook, sink)["2.0.bias"], torch.full((2,), 5.0))
    net.extra = nn.Linear(2, 2)  # a new submodule: its weights must be sent too
    assert {"extra.weight", "extra.bias"} <= set(sync(hook, sink))
