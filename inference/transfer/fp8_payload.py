"""Quantize on send: the FP8 form a sync takes on the wire (WeightSender(send_fp8=True), InitInfo.send_fp8).

Each tensor that `is_fp8_linear` selects (inference/quant/installed.py: the one choice every end makes)
travels as the two tensors an FP8 rank installs for it, quantized by THE rule (inference/quant/fp8.py) on
the sender's device: `name:fp8` (float8_e4m3fn, the full [N, K]) and `name:scale` (fp32 [N]); every other
tensor travels as given. The linears then take about half of bf16's bytes (N*K + 4N against 2*N*K), the
sender's digests are of these bytes, and a rank installs exactly what a rank that quantizes the bf16
tensor on receive installs (the rule is bit-exact across devices). The manifest says it by its names and
dtypes alone: a rank reads each payload tensor back with `installed_part`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from checksum import dtype_name
from inference.core import InvalidRequestError
from inference.quant.fp8 import FP8_DTYPE, SOURCE_DTYPES, check_finite, quantize_rows
from inference.quant.installed import FP8_SUFFIX, SCALE_SUFFIX, installed_items, is_fp8_linear
from inference.transfer.plan import TensorSpec

FP8_NAME = dtype_name(FP8_DTYPE)
SCALE_DTYPE = "float32"
_SOURCE_NAMES = tuple(dtype_name(d) for d in SOURCE_DTYPES)


def payload_specs(specs: Sequence[TensorSpec]) -> list[TensorSpec]:
    """The wire specs of a sync whose sender quantizes: each FP8 linear's spec replaced by its two.
    InvalidRequestError naming a selected tensor that is not a 2-D bf16/fp16/fp32 weight."""
    out: list[TensorSpec] = []
    for spec in specs:
        if not is_fp8_linear(spec.name):
            out.append(spec)
            continue
        if len(spec.shape) != 2 or spec.dtype not in _SOURCE_NAMES:
            raise InvalidRequestError(spec.name, f"FP8 on send quantizes 2-D {'/'.join(_SOURCE_NAMES)} weights, "
                                      f"not {spec.dtype} of shape {list(spec.shape)}")
        out += [TensorSpec(spec.name + FP8_SUFFIX, FP8_NAME, spec.shape),
                TensorSpec(spec.name + SCALE_SUFFIX, SCALE_DTYPE, spec.shape[:1])]
    return out


def payload_tensors(items: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The wire tensors of `items` (HF name, full tensor), each selected one quantized on its device. One
    host read checks every scale is finite (a non-finite weight gives a non-finite scale), then names the
    first tensor holding inf or NaN (InvalidRequestError): e4m3fn has neither."""
    out: list[tuple[str, torch.Tensor]] = []
    checked: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    with torch.no_grad():
        for name, t in items:
            if not is_fp8_linear(name):
                out.append((name, t))
                continue
            q, scale = quantize_rows(t.detach(), name, check=False)
            checked.append((name, t, torch.isfinite(scale).all()))
            out += installed_items(name, q, scale)
        if checked:
            device = checked[0][2].device
            if not bool(torch.stack([ok.to(device) for _, _, ok in checked]).all()):
                for name, t, ok in checked:
                    if not bool(ok):
                        check_finite(t.detach(), name)
    return out
