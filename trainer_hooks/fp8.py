"""What an FP8 sidecar (`sidecar launch --quantization fp8`) installs from the weights this trainer sends.

The trainer sends bf16 as always; each rank quantizes every attention and MLP projection weight as it
lands, by the one rule of inference/quant/fp8.py, and audits the installed values and scales against
that rule (docs/fp8.md). `expected_installed_digests` computes the same digests here, from the trainer's
own copy, without an engine: a TP=1 rank's `name:fp8` and `name:scale` records, under the sync's rule
(the device rule for CUDA tensors, else the host rule, as the sender picks).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from checksum import pick_algorithm
from inference.quant.installed import installed_records


def expected_installed_digests(weights: Iterable[tuple[str, torch.Tensor]],
                               algorithm: str | None = None) -> dict[str, str]:
    """`name:fp8` / `name:scale` -> digest for every (HF name, full tensor) an FP8 rank quantizes."""
    weights = list(weights)
    rule = algorithm or pick_algorithm(t for _, t in weights)
    return {r.name: r.digest for r in installed_records(weights, rule)}
