"""The tensors an FP8 rank installs for a weight, named so both ends agree, and their digests.

An FP8 linear's HF tensor `name` is held as two tensors, digested as two records: `name:fp8` (the rule's
float8_e4m3fn values) and `name:scale` (its fp32 row scales). `is_fp8_linear` is THE choice of which HF
tensors are quantized: the engine's FP8 layers (tests/test_fp8_sync.py holds them equal), the sender that
quantizes on send (inference/transfer/fp8_payload.py) and the trainer's expected digests all ask it.
`installed_records` computes a TP=1 rank's records from the FULL tensor with the rule
(inference/quant/fp8.py), on whatever device the tensor is on; a TP>1 rank holds row or column slices of
the same bytes, and `rank_slice` cuts them out by the shape the rank reports.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from checksum import ALGORITHM, TensorRecord, digest_tensors
from inference.quant.fp8 import quantize_rows

FP8_SUFFIX, SCALE_SUFFIX = ":fp8", ":scale"
PARTS = {FP8_SUFFIX: "fp8", SCALE_SUFFIX: "scale"}
_LINEAR_PARENTS = ("self_attn", "mlp")


def is_fp8_linear(hf_name: str) -> bool:
    """Whether an FP8 engine quantizes the HF tensor `hf_name`: the decoder layers' attention and MLP
    projection weights (q, k, v, o, gate, up, down) of the shipped families; never embeddings, norms,
    biases or the LM head."""
    parts = hf_name.split(".")
    return (len(parts) == 6 and parts[:2] == ["model", "layers"] and parts[3] in _LINEAR_PARENTS
            and parts[4].endswith("_proj") and parts[5] == "weight")


def installed_part(name: str) -> tuple[str, str] | None:
    """(HF name, "fp8" or "scale") of an installed record's (or FP8 payload tensor's) name; None for any
    other name. The HF name is not checked here: the caller says whether is_fp8_linear selects it."""
    for suffix, part in PARTS.items():
        if name.endswith(suffix) and len(name) > len(suffix):
            return name[:-len(suffix)], part
    return None


def installed_items(name: str, q: torch.Tensor, scale: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The two named tensors an installed FP8 weight is digested as."""
    return [(name + FP8_SUFFIX, q), (name + SCALE_SUFFIX, scale)]


def installed_records(named: Iterable[tuple[str, torch.Tensor]], algorithm: str = ALGORITHM) -> list[TensorRecord]:
    """The records of what a TP=1 FP8 rank installs for each (HF name, full weight) that is_fp8_linear
    selects (the others are held as sent), quantized by the rule."""
    items: list[tuple[str, torch.Tensor]] = []
    for name, w in named:
        if is_fp8_linear(name):
            items += installed_items(name, *quantize_rows(w.detach(), name))
    return digest_tensors(items, algorithm=algorithm)


def rank_slice(full: torch.Tensor, shape: tuple[int, ...], tp_rank: int) -> torch.Tensor | None:
    """The part of a FULL installed tensor (q [N, K] or scale [N]) that TP rank `tp_rank` holds when it
    holds `shape` of it: all of it, its rows (a column-parallel layer: q and scale split by rows) or its
    columns (a row-parallel layer: q split by columns, the scales whole), the rank's share in rank order.
    None when no such share has that shape. Contiguous, ready to digest."""
    if tuple(full.shape) == tuple(shape):
        return full
    if len(shape) != full.dim() or not all(shape) or tp_rank < 0:
        return None
    for dim in range(full.dim()):
        others = [d for d in range(full.dim()) if d != dim]
        n = shape[dim]
        if all(shape[d] == full.shape[d] for d in others) and full.shape[dim] % n == 0 \
                and (tp_rank + 1) * n <= full.shape[dim]:
            return full.narrow(dim, tp_rank * n, n).contiguous()
    return None
