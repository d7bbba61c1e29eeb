"""What an FP8 sidecar (`sidecar launch --quantization fp8`) installs from the weights this trainer sends,
computed here, and the check of what each rank reports it installed.

Each rank quantizes every attention and MLP projection weight by the one rule of inference/quant/fp8.py,
on receive or (WeightSender(send_fp8=True)) on send, and reports the digests of what it holds: `name:fp8`
and `name:scale` (a TP>1 rank: its rows or columns of them). The rule is bit-exact on CPU and GPU, so the
trainer quantizes its own copy, digests what each rank should hold, and compares (`installed_report`):
that proves every rank computes with exactly what the trainer expects, not only that it stayed
consistent with what it received. `expected_installed_digests` gives a TP=1 rank's digests.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from checksum import Mismatch, Report, digest_tensors, parse_rank_key, pick_algorithm
from inference.quant.fp8 import quantize_rows
from inference.quant.installed import (
    FP8_SUFFIX,
    SCALE_SUFFIX,
    installed_part,
    installed_records,
    is_fp8_linear,
    rank_slice,
)


def expected_installed_digests(weights: Iterable[tuple[str, torch.Tensor]],
                               algorithm: str | None = None) -> dict[str, str]:
    """`name:fp8` / `name:scale` -> digest for every (HF name, full tensor) an FP8 rank quantizes."""
    weights = list(weights)
    rule = algorithm or pick_algorithm(t for _, t in weights)
    return {r.name: r.digest for r in installed_records(weights, rule)}


def installed_report(weights: Iterable[tuple[str, torch.Tensor]], installed: Mapping[str, Sequence[Mapping[str, Any]]],
                     algorithm: str, model: str = "target") -> Report:
    """Every rank's reported installed records ({rank key: [{name, dtype, shape, digest}]}, as a sync's audit
    answers them under "installed") against the rule applied to `weights` (HF name, full tensor) and cut to
    what that rank holds (its TP index read from its key, its share from the record's shape). Names the
    tensor and the rank of each difference; a rank that reports records misses none of the quantized
    tensors. Each tensor is quantized once, on its own device, whatever the number of ranks."""
    by_name = {name: t for name, t in weights}
    quantized: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    mismatches: list[Mismatch] = []
    checked = 0
    for rank, records in installed.items():
        tp = _tp_index(rank)
        items, reported = [], {}
        for record in records:
            name, shape = str(record["name"]), tuple(record["shape"])
            part = installed_part(name)
            source = by_name.get(part[0]) if part is not None else None
            if part is None or source is None or not is_fp8_linear(part[0]):
                mismatches.append(Mismatch("extra", rank, model, name, "-", "installed, not sent as an FP8 linear"))
                continue
            if part[0] not in quantized:
                quantized[part[0]] = quantize_rows(source.detach(), part[0])
            full = quantized[part[0]][0 if part[1] == "fp8" else 1]
            piece = rank_slice(full, shape, tp)
            if piece is None:
                mismatches.append(Mismatch("shape", rank, model, name, f"a TP share of {list(full.shape)}",
                                           str(list(shape))))
                continue
            items.append((name, piece))
            reported[name] = str(record["digest"])
        for expected in digest_tensors(items, algorithm=algorithm):
            checked += 1
            if expected.digest != reported[expected.name]:
                mismatches.append(Mismatch("digest", rank, model, expected.name, expected.digest,
                                           reported[expected.name]))
        if records:
            sent = {n + s for n in by_name if is_fp8_linear(n) for s in (FP8_SUFFIX, SCALE_SUFFIX)}
            mismatches += [Mismatch("missing", rank, model, n, "installed", "-")
                           for n in sorted(sent - {str(r["name"]) for r in records})]
    return Report.build(mismatches, installed, checked)


def _tp_index(rank: str) -> int:
    """The TP index of a rank key ("dp0:pp0:tp1" -> 1); 0 for a key of another form (a TP=1 rank's)."""
    try:
        return parse_rank_key(rank)[2]
    except ValueError:
        return 0
