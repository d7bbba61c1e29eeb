"""The digests of FP8-installed weights: what an FP8 rank holds for a tensor, named so both ends agree.

An FP8 linear's HF tensor `name` is held as two tensors, digested as two records: `name:fp8` (the rule's
float8_e4m3fn values) and `name:scale` (its fp32 row scales). `installed_records` computes them from the
FULL tensor with the rule (inference/quant/fp8.py), on whatever device the tensor is on: the trainer
computes what a TP=1 rank installs without an engine (a TP>1 rank holds row or column slices of the same
bytes), and the rank's audit names the same records (inference/weights/installed.py).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from checksum import ALGORITHM, TensorRecord, digest_tensors
from inference.quant.fp8 import quantize_rows

FP8_SUFFIX, SCALE_SUFFIX = ":fp8", ":scale"
_LINEAR_PARENTS = ("self_attn", "mlp")


def is_fp8_linear(hf_name: str) -> bool:
    """Whether an FP8 engine quantizes the HF tensor `hf_name`: the decoder layers' attention and MLP
    projection weights (q, k, v, o, gate, up, down) of the shipped families; never embeddings, norms,
    biases or the LM head. tests/test_fp8_sync.py holds it equal to the engine's FP8 layers."""
    parts = hf_name.split(".")
    return (len(parts) == 6 and parts[:2] == ["model", "layers"] and parts[3] in _LINEAR_PARENTS
            and parts[4].endswith("_proj") and parts[5] == "weight")


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
