"""The training-inference logprob gap: the trainer's logprobs of the rollout tokens against the rollout's.

An RL trainer weighs each rollout token by exp(trainer logprob - rollout logprob); when the sidecar and
the trainer compute different numbers for the same weights, that ratio drifts from 1 and the policy
gradient is biased. `measure_logprob_gap(model, rollouts)` measures it with one padded forward of the
trainer's model; `WeightSyncHook(..., logprob_gap=True)` does it after every `rollouts()` call and keeps
the `logprob_gap_*` figures in `hook.stats`. Where the rollout runs another policy on purpose (an FP8
sidecar, docs/fp8.md), `truncated_importance_weights` gives the correction FlashRL and slime apply: per
token min(exp(trainer - rollout), cap), detached, to multiply each token's policy-gradient term by.
`replay=True` (an MoE model, rollouts with return_routing) forwards under the rollout's routing
(trainer_hooks/routing_replay.py): the gap then leaves out what a different choice of experts adds.
Invariants:
- The trainer's logprobs are "raw": float32 log_softmax of the model's logits (in its own dtype) at
  temperature 1, what the engine reports by default (logprobs_mode="raw", docs/configuration.md);
  rollouts sampled with logprobs_mode="processed" carry another distribution, so their gap means nothing.
- Sequences are right-padded into one batch: under causal attention a position never sees the padding
  after it and positions still count from 0, so no attention mask is needed (ToyPolicy takes none; an
  HF model's default positions are the same).
- The model runs under torch.no_grad in eval mode, then gets its mode back. Imports torch and nothing
  of the engine (tests/test_import_layers.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from trainer_hooks.routing_replay import pad_routing, replay_routing

STATS_PREFIX = "logprob_gap_"
REPLAY_STATS_PREFIX = "logprob_gap_replay_"  # the gap under the rollout's routing (MoE, return_routing)


@dataclass(frozen=True)
class LogprobGap:
    """The gap over `tokens` completion tokens; diff = trainer logprob - rollout logprob per token.

    mean: mean of diff (signed: a systematic bias shows here, rounding noise averages out);
    mean_abs / max_abs: mean and max of |diff|; ratio_minus_one: mean of exp(diff) - 1, the importance
    weight's mean distance from 1. All 0.0 when tokens == 0; NaN when a logprob is NaN (reported, not
    raised: the gap is a monitor and must not end a training step).
    """

    tokens: int
    mean: float
    mean_abs: float
    max_abs: float
    ratio_minus_one: float

    def as_stats(self, prefix: str = STATS_PREFIX) -> dict[str, float | int]:
        """Flat `<prefix><field>` keys (`logprob_gap_<field>`), ready for a metrics logger."""
        return {f"{prefix}{k}": v for k, v in self.__dict__.items()}


def gap_of(trainer: Sequence[torch.Tensor], rollout: Sequence[Sequence[float]]) -> LogprobGap:
    """The gap between per-completion trainer logprobs and the rollout's own (same lengths, pairwise)."""
    if len(trainer) != len(rollout):
        raise ValueError(f"trainer logprobs: {len(trainer)} completions, rollout logprobs: {len(rollout)}")
    diffs = []
    for i, (t, r) in enumerate(zip(trainer, rollout)):
        if t.numel() != len(r):
            raise ValueError(f"completion {i}: {t.numel()} trainer logprobs for {len(r)} rollout logprobs")
        diffs.append(t.detach().double().cpu().view(-1) - torch.tensor(list(r), dtype=torch.float64))
    d = torch.cat(diffs) if diffs else torch.zeros(0, dtype=torch.float64)
    if d.numel() == 0:
        return LogprobGap(0, 0.0, 0.0, 0.0, 0.0)
    return LogprobGap(tokens=d.numel(), mean=d.mean().item(), mean_abs=d.abs().mean().item(),
                      max_abs=d.abs().max().item(), ratio_minus_one=torch.expm1(d).mean().item())


def truncated_importance_weights(trainer: Sequence[torch.Tensor], rollout: Sequence[Sequence[float]],
                                 cap: float = 2.0) -> list[torch.Tensor]:
    """Per completion, min(exp(trainer logprob - rollout logprob), cap) per token: float32, detached, on
    the trainer logprobs' device (truncated importance sampling: a token the rollout policy made far
    likelier than the trainer's gets at most `cap`, bounding the correction's variance)."""
    if not cap > 0:
        raise ValueError(f"cap must be positive, got {cap}")
    if len(trainer) != len(rollout):
        raise ValueError(f"trainer logprobs: {len(trainer)} completions, rollout logprobs: {len(rollout)}")
    out = []
    for i, (t, r) in enumerate(zip(trainer, rollout)):
        if t.numel() != len(r):
            raise ValueError(f"completion {i}: {t.numel()} trainer logprobs for {len(r)} rollout logprobs")
        diff = t.detach().double().view(-1) - torch.tensor(list(r), dtype=torch.float64, device=t.device)
        out.append(torch.exp(diff).clamp_max(cap).float())
    return out


def rollout_importance_weights(model: nn.Module, rollouts: Sequence[Any], cap: float = 2.0,
                               pad_id: int = 0, replay: bool = False) -> list[torch.Tensor]:
    """truncated_importance_weights of `model`'s logprobs of the rollout tokens against the rollout's, one
    tensor per non-empty completion in rollout order (as `completions` lists them); replay: under the
    rollout's routing (module docstring)."""
    items = completions(rollouts)
    routing = completion_routing(rollouts) if replay else None
    trainer = trainer_logprobs(model, [(p, c) for p, c, _ in items], pad_id, routing)
    return truncated_importance_weights(trainer, [r for _, _, r in items], cap)


def completions(rollouts: Sequence[Any]) -> list[tuple[list[int], list[int], list[float]]]:
    """(prompt ids, completion ids, rollout logprobs) of every non-empty completion, in rollout order.

    `rollouts` are RequestOutputs (or anything with .prompt_token_ids and .outputs of objects with
    .token_ids and .logprobs); a completion whose logprobs do not match its tokens is a ValueError.
    """
    out = []
    for i, req in enumerate(rollouts):
        for c in req.outputs:
            ids, logps = list(c.token_ids), list(c.logprobs)
            if len(ids) != len(logps):
                raise ValueError(f"rollout {i} completion {c.index}: {len(ids)} tokens but {len(logps)} logprobs")
            if ids:
                out.append((list(req.prompt_token_ids), ids, logps))
    return out


def completion_routing(rollouts: Sequence[Any]) -> list[Any]:
    """The routing of every non-empty completion (CompletionOutput.routing), in `completions`' order; a
    completion without one is a ValueError naming it (request it with SamplingParams(return_routing=True))."""
    out = []
    for i, req in enumerate(rollouts):
        for c in req.outputs:
            if not list(c.token_ids):
                continue
            routing = getattr(c, "routing", None)
            if routing is None:
                raise ValueError(f"rollout {i} completion {c.index} carries no routing: sample it with "
                                 "SamplingParams(return_routing=True) to replay it")
            out.append(routing)
    return out


def trainer_logprobs(model: nn.Module, sequences: Sequence[tuple[Sequence[int], Sequence[int]]],
                     pad_id: int = 0, routing: Sequence[Any] | None = None) -> list[torch.Tensor]:
    """log p(completion token | everything before it) under `model`, one float32 tensor per
    (prompt ids, completion ids) pair, from one right-padded forward (module docstring). `routing`: one
    array per pair, its rows the tokens forwarded (prompt and completion but the last, as the engine
    returns them), forced into the MoE model's routers (replay_routing)."""
    if not sequences:
        return []
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    rows = [list(p) + list(c)[:-1] for p, c in sequences]  # a last token's logits predict nothing here
    if any(len(p) == 0 for p, _ in sequences):
        raise ValueError("a rollout has an empty prompt: its first token has no logprob to compare")
    width = max(len(r) for r in rows)
    forced = None
    if routing is not None:
        if len(routing) != len(rows):
            raise ValueError(f"routing: {len(routing)} arrays for {len(rows)} completions")
        for i, (r, row) in enumerate(zip(routing, rows)):
            if len(r) != len(row):
                raise ValueError(f"completion {i}: routing for {len(r)} tokens, the forward has {len(row)} "
                                 "(prompt + completion - 1)")
        forced = pad_routing(routing, width)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, :len(r)] = torch.tensor(r, dtype=torch.long)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), replay_routing(model, forced) if forced is not None else nullcontext():
            logits = _logits(model(ids.to(device)))
    finally:
        model.train(was_training)
    out = []
    for b, (p, c) in enumerate(sequences):
        start = len(p) - 1  # the logits at position t predict token t + 1
        rows_logits = logits[b, start:start + len(c)].float()
        target = torch.tensor(list(c), dtype=torch.long, device=rows_logits.device)
        out.append(torch.log_softmax(rows_logits, dim=-1).gather(-1, target[:, None]).squeeze(-1).cpu())
    return out


def measure_logprob_gap(model: nn.Module, rollouts: Sequence[Any], pad_id: int = 0,
                        replay: bool = False) -> LogprobGap:
    """The gap between `model`'s logprobs of the rollout tokens and the rollout's (module docstring);
    replay: with the model's MoE routers forced to the rollout's routing."""
    items = completions(rollouts)
    routing = completion_routing(rollouts) if replay else None
    trainer = trainer_logprobs(model, [(p, c) for p, c, _ in items], pad_id, routing)
    return gap_of(trainer, [r for _, _, r in items])


def _logits(out: Any) -> torch.Tensor:
    """A forward's logits: the tensor itself (ToyPolicy), `.logits` (transformers) or the first item."""
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise TypeError(f"the model's forward returned {type(out).__name__}, not logits or an object with .logits")

