"""The tensors an FP8 rank installs for a weight, named so both ends agree, and their digests.

An FP8 linear's HF tensor `name` is held as two tensors, digested as two records: `name:fp8` (the rule's
float8_e4m3fn values) and `name:scale` (its fp32 row scales). `is_fp8_linear` is THE choice of which HF
tensors are quantized: the engine's FP8 layers (tests/test_fp8_sync.py holds them equal), the sender that
quantizes on send (inference/transfer/fp8_payload.py) and the sender's expected installed digests all ask
it. `installed_records` computes a rank's records from the FULL tensor with the rule
(inference/quant/fp8.py), on whatever device the tensor is on; a TP>1 rank holds row or column slices of
the same bytes (a row's bytes are its own), and `tp_share` cuts out TP rank r's: the rows of a
column-parallel projection (q, k, v, gate, up; values and scales alike), the columns of a row-parallel
one (o, down; `share_axis`), whose scales every rank holds whole.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from checksum import ALGORITHM, TensorRecord, digest_tensors
from inference.quant.fp8 import quantize_rows

FP8_SUFFIX, SCALE_SUFFIX = ":fp8", ":scale"
PARTS = {FP8_SUFFIX: "fp8", SCALE_SUFFIX: "scale"}
_LINEAR_PARENTS = ("self_attn", "mlp")
_ROW_PARALLEL = ("o_proj", "down_proj")  # their input dimension is split over the TP ranks


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


def installed_records(named: Iterable[tuple[str, torch.Tensor]], algorithm: str = ALGORITHM, tp_size: int = 1,
                      tp_rank: int = 0) -> list[TensorRecord]:
    """The records of what FP8 rank `tp_rank` of `tp_size` installs for each (HF name, full weight) that
    is_fp8_linear selects (the others are held as sent), quantized by the rule: what a sync's sender
    expects of that rank (inference/transfer/installed_digests.py computes them beside the wire)."""
    items: list[tuple[str, torch.Tensor]] = []
    for name, w in named:
        if is_fp8_linear(name):
            q, scale = quantize_rows(w.detach(), name)
            items += installed_items(name, tp_share(q, name, "fp8", tp_size, tp_rank),
                                     tp_share(scale, name, "scale", tp_size, tp_rank))
    return digest_tensors(items, algorithm=algorithm)


def share_axis(hf_name: str) -> int:
    """The dimension of an FP8 linear's [N, K] values that its TP ranks split: 1 (columns) for the
    row-parallel projections (o, down), 0 (rows) for the column-parallel ones (q, k, v, gate, up)."""
    return 1 if hf_name.split(".")[-2] in _ROW_PARALLEL else 0


def tp_share(full: torch.Tensor, hf_name: str, part: str, tp_size: int, tp_rank: int) -> torch.Tensor:
    """TP rank `tp_rank`'s share (of `tp_size`) of an installed tensor of the FP8 linear `hf_name`, computed
    whole: `part` "fp8" (q [N, K]) or "scale" ([N]). Rows of a column-parallel layer's values and scales,
    columns of a row-parallel layer's values, a row-parallel layer's scales whole. Contiguous, ready to
    digest; ValueError when the dimension does not split over `tp_size`."""
    assert part in ("fp8", "scale") and 0 <= tp_rank < tp_size, (part, tp_rank, tp_size)
    axis = share_axis(hf_name)
    if tp_size == 1 or (part == "scale" and axis == 1):
        return full
    if full.shape[axis] % tp_size:
        raise ValueError(f"{hf_name}: dimension {axis} ({full.shape[axis]}) does not split over {tp_size} TP ranks")
    n = full.shape[axis] // tp_size
    return full.narrow(axis, tp_rank * n, n).contiguous()
