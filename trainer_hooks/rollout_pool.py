"""The trainer's side of a sidecar's rollout pools (sidecar/api/rollouts.py): submit, take, counts,
and the staleness of what was taken.

A pool is named by the trainer; its groups (one prompt's n samples) live in the sidecar until taken,
so a take returns each group at most once and a restarted trainer with the same pool id takes what
its predecessor left. Staleness of a sample: how many versions its oldest token is behind the live
target version when it was taken (its weight_version_spans; without spans, its weight_version).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from inference.core import RequestOutput

DEFAULT_POOL = "default"
TAKE_MARGIN_S = 30.0  # the HTTP timeout of a take: its own wait plus this


@dataclass
class RolloutTake:
    """One take's answer: `groups` are RequestOutputs (request_id = the group id), oldest submitted first;
    `failed` maps the id of each group the ranks failed to its error message (resubmit those);
    `counts` is what the pool holds after the take; `weight_version` the live one at the take
    (a fleet's: its version)."""

    groups: list[RequestOutput]
    weight_version: int | None
    failed: dict[str, str] = field(default_factory=dict)
    counts: dict[str, Any] = field(default_factory=dict)
    submitted: list[str] = field(default_factory=list)  # the groups the call submitted (SidecarClient.rollouts)


def prompt_list(prompts: Any) -> list[Any]:
    """The client's rule: a string or a list of token ids is one prompt."""
    if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


def sync_fields(on_sync: str | None, max_staleness: int | None) -> dict[str, Any]:
    """The sync policy's fields that are set, as the generation bodies and calls carry them (an unset one
    is the sidecar's own: its --on-sync, no staleness bound); the sidecar validates them."""
    return {k: v for k, v in (("on_sync", on_sync), ("max_staleness", max_staleness)) if v is not None}


def oldest_version(completion: Any, fallback: int) -> int:
    """The version of a sample's oldest token (its spans' smallest; `fallback` when it has none)."""
    spans = getattr(completion, "weight_version_spans", None) or []
    return min((int(v) for _, v in spans), default=fallback)


def staleness(outputs: Sequence[RequestOutput], live: int | None) -> tuple[dict[int, int], dict[int, int]]:
    """Histograms {versions behind `live`: count} of the samples (by their oldest token) and of the tokens
    (each token by the version that produced it). `live` None: the newest version among the outputs."""
    if live is None:
        live = max((o.weight_version for o in outputs), default=0)
        live = max([live] + [int(v) for o in outputs for c in o.outputs for _, v in c.weight_version_spans])
    samples: Counter[int] = Counter()
    tokens: Counter[int] = Counter()
    for o in outputs:
        for c in o.outputs:
            samples[live - oldest_version(c, o.weight_version)] += 1
            spans = sorted((int(s), int(v)) for s, v in c.weight_version_spans) or [(0, o.weight_version)]
            ends = [s for s, _ in spans[1:]] + [len(c.token_ids)]
            for (start, version), end in zip(spans, ends):
                if end > start:
                    tokens[live - version] += end - start
    return dict(sorted(samples.items())), dict(sorted(tokens.items()))
