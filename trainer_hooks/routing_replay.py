"""Routing replay: the trainer's forward of an HF MoE model under the experts the rollout chose.

The router of an MoE model can pick other experts in the trainer's forward than in the rollout for the
same tokens (other kernels, other batch, a near tie), and then the trainer's logprobs of the rollout's
tokens are those of another computation. Replay forces the rollout's experts; each expert's weight is
still the trainer's (softmax of its router logits at the forced experts, renormalised as the family
does), so gradients reach the router as in a free forward.

Routing is one array in both directions (docs/moe.md): uint8 (int16 beyond 256 experts) expert ids
[tokens, moe layers, k] in the router's order, batched [batch, tokens, moe layers, k]. The engine
returns it per completion (CompletionOutput.routing, numpy) for prompt + completion[:-1], the tokens a
trainer forwards to score the completion. `record_routing` captures it from a forward, `replay_routing`
forces it, `pad_routing` lays several out for a right-padded batch. They hook the routers of
transformers' MoE models (a module with `top_k`, `num_experts` and a [num_experts, hidden] `weight`
whose forward returns (logits, weights, ids)), the hooks removed on exit. Imports torch only.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from checksum.dtypes import dtype_from_name
from inference.core import InvalidRequestError
from inference.core import routing_dtype as routing_dtype_name


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The routers of `model` in layer order; InvalidRequestError naming "model" if it has none."""
    routers = [m for m in model.modules() if _is_router(m)]
    if not routers:
        raise InvalidRequestError("model", f"{type(model).__name__} has no MoE router to record or replay")
    return routers


def routing_dtype(num_experts: int) -> torch.dtype:
    """The engine's rule (inference.core.routing_dtype) as a torch dtype."""
    dtype: torch.dtype = dtype_from_name(routing_dtype_name(num_experts))
    return dtype


def pad_routing(routings: Sequence[Any], width: int) -> torch.Tensor:
    """[batch, width, moe layers, k]: routing b (a [tokens_b, moe layers, k] numpy array or tensor, as a
    completion carries it) in row b, for a right-padded batch of `width` positions. Padding positions
    route to experts 0..k-1: they are never attended to and their logits are not read."""
    if not routings:
        raise InvalidRequestError("routing", "no routing to pad")
    arrays = [torch.as_tensor(r) for r in routings]
    first = arrays[0]
    if first.dim() != 3:
        raise InvalidRequestError("routing", f"routing 0 has shape {list(first.shape)}; expected [tokens, "
                                             "moe layers, k]")
    out = torch.arange(first.shape[2], dtype=first.dtype).expand(len(arrays), width, *first.shape[1:]).clone()
    for b, r in enumerate(arrays):
        if r.dim() != 3 or r.shape[1:] != first.shape[1:] or r.shape[0] > width:
            raise InvalidRequestError("routing", f"routing {b} has shape {list(r.shape)}; expected [at most "
                                                 f"{width} tokens, {first.shape[1]} moe layers, {first.shape[2]}]")
        out[b, : r.shape[0]] = r
    return out


@contextmanager
def record_routing(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Inside: every forward of `model` appends its routing [tokens, moe layers, k] (tokens flattened over
    the batch, as the routers see them) to the yielded list."""
    routers = moe_routers(model)
    layers: list[list[torch.Tensor]] = [[] for _ in routers]
    out: list[torch.Tensor] = []

    def hook(index: int) -> Any:
        def record(module: nn.Module, args: Any, output: tuple) -> None:
            layers[index].append(output[2].detach().to(routing_dtype(module.num_experts)))
            if index == len(routers) - 1:
                out.append(torch.stack([layer.pop() for layer in layers], dim=1).cpu())
        return record

    handles = [r.register_forward_hook(hook(i)) for i, r in enumerate(routers)]
    try:
        yield out
    finally:
        for h in handles:
            h.remove()


@contextmanager
def replay_routing(model: nn.Module, routing: Any) -> Iterator[None]:
    """Inside: the forwards of `model` route each token to the experts `routing` names ([tokens, moe
    layers, k], or [batch, tokens, moe layers, k] for a batched forward of that shape; a tensor or a
    numpy array, as the engine returns it). A forward of another token count, or routing of another layer
    count or k, is an InvalidRequestError naming it."""
    routers = moe_routers(model)
    routing = torch.as_tensor(routing)
    forced = routing.reshape(-1, *routing.shape[-2:]) if routing.dim() >= 3 else routing
    if forced.dim() != 3 or forced.shape[1] != len(routers):
        raise InvalidRequestError("routing", f"shape {list(routing.shape)}: expected [..., tokens, "
                                  f"{len(routers)} moe layers, k]")

    def hook(index: int) -> Any:
        def replay(module: nn.Module, args: Any, output: tuple) -> tuple:
            logits = output[0]
            ids = forced[:, index].to(device=logits.device, dtype=torch.long)
            if ids.shape != (logits.shape[0], module.top_k):
                raise InvalidRequestError("routing", f"moe layer {index}: routing for {list(ids.shape)} "
                                          f"(tokens, k) but the forward routes {logits.shape[0]} tokens "
                                          f"to {module.top_k} experts")
            weights = torch.softmax(logits.float(), dim=-1).gather(1, ids)
            if getattr(module, "norm_topk_prob", True):  # Mixtral's routers always renormalise
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return logits, weights.to(output[1].dtype), ids
        return replay

    handles = [r.register_forward_hook(hook(i)) for i, r in enumerate(routers)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _is_router(m: nn.Module) -> bool:
    weight = getattr(m, "weight", None)
    experts = getattr(m, "num_experts", None)
    return (hasattr(m, "top_k") and isinstance(experts, int) and isinstance(weight, torch.Tensor)
            and weight.dim() == 2 and weight.shape[0] == experts)
