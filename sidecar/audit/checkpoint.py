"""`sidecar audit --url URL --checkpoint DIR`: the digests a sidecar's ranks hold when they serve DIR.

A sidecar's "held" manifests name its own parameters, not the checkpoint's tensors (fused qkv_proj and
gate_up_proj, inference/models/naming.py; a tied lm_head as model.embed_tokens.weight; a TP rank's shard
with the vocabulary padded by zero rows; the served dtype), so the checkpoint's tensors as they are
would mismatch every held manifest. Here the checkpoint is laid out by the engine's own code, as
`sidecar launch --model DIR` lays it out: the model class is built on the meta device for each TP rank
and each parameter is filled from the checkpoint's full tensors by its weight_loader, as
inference/models/loader.py fills it, so the expected manifests cannot drift from what the loader
writes. One parameter at a time is materialized on the CPU (the peak is one full tensor plus one shard).

What is checked: every byte each rank holds against the checkpoint's bytes cast to the dtype that rank
holds, digested by the rule of the rank's own manifest (the dtype itself is taken from the rank, not
checked). A rank that reports a weight in FP8 (`sidecar launch --quantization fp8`) holds what the loader
installs: each HF tensor quantized by THE rule (inference/quant/fp8.py) as the checkpoint stores it, this
rank's share of the values (and of the row scales, held after the weight as `...weight_scale`) stacked as
the fused parameter stacks its parts; so the expected bytes are computed by that rule and cut by the same
share rule a sync's sender uses (inference/quant/installed.py `tp_share`). A sidecar whose weights were
synced since launch holds the trainer's bytes, and then the digests differ, as they should.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from checksum import Manifest, digest_tensors, dtype_from_name, dtype_name, parse_rank_key
from inference.config import ModelConfig
from inference.core import InvalidRequestError
from inference.models import build_model
from inference.models.hf_config import read_model_config
from inference.models.loader import hf_tensor_shapes, safetensors_files, validate_checkpoint
from inference.models.naming import param_to_hf
from inference.parallel import TPInfo
from inference.quant.fp8 import FP8_DTYPE, quantize_rows
from inference.quant.installed import is_fp8_linear, tp_share
from inference.weights.installed import fp8_layers, scale_name

FP8_NAME = dtype_name(FP8_DTYPE)


def checkpoint_manifests(model_dir: str | Path, held: Sequence[Manifest]) -> list[Manifest]:
    """One expected manifest per held manifest: the same model, rank key and digest rule, weight version
    0 (what `sidecar launch --model DIR` serves before any sync), with the digests of what that rank holds
    when it serves `model_dir`. A synced sidecar's manifests then differ by version first, which the
    report names as other weights, not corrupted bytes.

    Raises InvalidRequestError naming the tensor when the checkpoint is not a valid one of its own
    config.json (unknown, misshapen or missing tensors) or does not split over the ranks' TP size."""
    config = read_model_config(model_dir)
    validate_checkpoint(config, hf_tensor_shapes(model_dir))
    ranks = [parse_rank_key(m.rank) for m in held]
    if any(pp != 0 for _, pp, _ in ranks):
        raise InvalidRequestError("rank", "--checkpoint lays weights out for tensor-parallel ranks only "
                                          f"(pp0); the sidecar has {sorted({m.rank for m in held})}")
    tp_size = max((tp for _, _, tp in ranks), default=0) + 1
    done: dict[tuple[int, str, tuple[tuple[str, str], ...]], Manifest] = {}  # dp replicas hold the same bytes
    out = []
    with _Checkpoint(model_dir) as ckpt:
        for m, (_, _, tp) in zip(held, ranks):
            dtypes = {r.name: r.dtype for r in m.records}
            key = (tp, m.algorithm, tuple(sorted(dtypes.items())))
            if key not in done:
                done[key] = _rank_manifest(config, ckpt, m, TPInfo(tp, tp_size, _NO_GROUP) if tp_size > 1
                                           else TPInfo(), dtypes)
            out.append(Manifest(m.model, 0, m.rank, done[key].records, m.algorithm))
    return out


# The model is built only to route weights (names, shapes, weight_loaders): it never runs, so a TP
# rank needs no process group. TPInfo asks for one when size > 1; this placeholder is never used.
_NO_GROUP = object()


def _rank_manifest(config: ModelConfig, ckpt: _Checkpoint, held: Manifest, tp: TPInfo,
                   dtypes: dict[str, str]) -> Manifest:
    """The digests of every parameter of one TP rank, filled from the checkpoint by its weight_loader (an
    FP8 weight, and its scales, by the rule: `_installed`)."""
    fp8 = FP8_NAME in dtypes.values()  # the rank holds this model in FP8: its model is built so
    plain = Counter(d for d in dtypes.values() if d != FP8_NAME).most_common(1)
    default = plain[0][0] if plain else config.dtype
    model = build_model(config, tp, dtype_from_name(default), "meta", quantization="fp8" if fp8 else "none")
    layers = fp8_layers(model)
    records = []
    for name, meta in model.named_parameters():
        if name in layers:
            records += digest_tensors(_installed(config, ckpt, name, tp), algorithm=held.algorithm)
            continue
        param = torch.empty(meta.shape, dtype=dtype_from_name(dtypes.get(name, default)))
        with torch.no_grad():
            for hf_name, shard_id in param_to_hf(name, config):
                meta.weight_loader(param, ckpt.tensor(hf_name), shard_id)  # type: ignore[operator]
        records += digest_tensors([(name, param)], algorithm=held.algorithm)
    return Manifest(held.model, held.weight_version, held.rank, tuple(records), held.algorithm)


def _installed(config: ModelConfig, ckpt: _Checkpoint, name: str, tp: TPInfo) -> list[tuple[str, torch.Tensor]]:
    """The FP8 weight `name` of one TP rank and its row scales as the loader installs them: each HF part
    quantized whole by the rule (as the checkpoint stores it), this rank's share of it, stacked in the
    parameter's part order."""
    values, scales = [], []
    with torch.no_grad():
        for hf_name, _ in param_to_hf(name, config):
            assert is_fp8_linear(hf_name), hf_name  # the engine's FP8 layers are exactly these
            q, scale = quantize_rows(ckpt.tensor(hf_name), hf_name)
            values.append(tp_share(q, hf_name, "fp8", tp.size, tp.rank))
            scales.append(tp_share(scale, hf_name, "scale", tp.size, tp.rank))
    return [(name, torch.cat(values)), (scale_name(name), torch.cat(scales))]


class _Checkpoint(contextlib.AbstractContextManager):
    """The checkpoint's tensors by name, read one at a time from files kept open for the run."""

    def __init__(self, model_dir: str | Path) -> None:
        self._stack = contextlib.ExitStack()
        self._where: dict[str, Any] = {}
        self._model_dir = model_dir

    def __enter__(self) -> _Checkpoint:
        for path in safetensors_files(self._model_dir):
            f = self._stack.enter_context(safe_open(str(path), framework="pt"))
            self._where.update((name, f) for name in f.keys())  # noqa: SIM118 (safe_open is not a mapping)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def tensor(self, name: str) -> torch.Tensor:
        if name not in self._where:  # validate_checkpoint found every expected name: a bug if reached
            raise InvalidRequestError(name, "missing from the checkpoint")
        return self._where[name].get_tensor(name)
