"""A LoRA adapter served unmerged on one linear layer: y = base(x) + s * (x A^T) B^T.

`LoRASlot` hangs off a linear (`layer.lora`, None without an adapter) and adds its term to the layer's
output: x A^T with A of every adapted part stacked [parts * r, in] (one GEMM for a fused qkv or gate_up),
then per part one addmm of (x A_i^T) B_i^T into its output columns (s, lora_alpha / r or / sqrt(r) with
rsLoRA, as addmm's alpha). Adapted parts only: a qkv with only q and v adapted has no k rows.
A and B are in the model dtype, also over an FP8 weight (its product is fp8_linear's; the term is added
after), in buffers outside the weight arenas: resident at every sleep level, at fixed addresses (CUDA
graphs capture them; a sync writes `regions()` in place), unseen by the base's loader and held manifest.
Tensor parallelism shards them as W: a column-parallel layer holds A whole and, of each part's B, that
part's rows of this rank; a row-parallel layer holds A's columns of its input slice and B whole, and its
term goes into the partial x_r W_r^T before the layer's all-reduce, which then sums the adapter's partials
too (sum_r (x_r A_r^T) B^T = (x A^T) B^T): counted once, no collective of its own.
Batch-invariant mode: both GEMMs run as invariant_linear and the add is elementwise, so a row's output does
not depend on the batch (and the layer's ordered all-reduce keeps the ranks' fixed order).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from inference.layers.gemm_invariant import invariant_linear


@dataclass(frozen=True)
class LoRAPart:
    """One adapted part of a (possibly fused) layer, in the FULL (unsharded) layer's terms: its HF module
    weight name and its output columns."""

    hf_name: str      # the base module's HF weight name, e.g. model.layers.0.self_attn.q_proj.weight
    offset: int       # first output column of this part in the full layer's output
    rows: int         # its output features


@dataclass(frozen=True)
class AdapterTensor:
    """One adapter tensor (A or B of one part) as this rank holds it: `held` is the whole tensor of
    `full_shape` (dim None), or this rank's `index`-th equal slice of it along `dim`."""

    held: torch.Tensor
    full_shape: tuple[int, ...]
    dim: int | None = None
    index: int = 0

    @property
    def whole(self) -> bool:
        return self.dim is None

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the full tensor (the tensor itself when held whole)."""
        assert tuple(full.shape) == self.full_shape, (tuple(full.shape), self.full_shape)
        if self.dim is None:
            return full
        n = self.held.shape[self.dim]
        return full.narrow(self.dim, self.index * n, n)

    def load(self, full: torch.Tensor) -> None:
        """Write this rank's slice of the full tensor into `held` (casting to its dtype)."""
        self.held.copy_(self.shard(full))


class LoRASlot(nn.Module):
    """The adapter of one linear layer (see the module docstring). Zeros until loaded.

    `in_features` and the parts are the full layer's; `tp_rank`/`tp_size` and `row_parallel` say which
    slice of each tensor this rank holds (every part's rows, and a row-parallel input, divide by tp_size,
    as the layer's own do)."""

    def __init__(self, parts: Sequence[LoRAPart], rank: int, in_features: int, scaling: float,
                 dtype: torch.dtype, device: torch.device | str, invariant: bool = False, *,
                 tp_rank: int = 0, tp_size: int = 1, row_parallel: bool = False) -> None:
        super().__init__()
        assert parts and rank > 0 and 0 <= tp_rank < tp_size, (parts, rank, tp_rank, tp_size)
        assert not row_parallel or len(parts) == 1, "a row-parallel layer is never fused"
        self.parts, self.rank, self.scaling, self.invariant = tuple(parts), rank, scaling, invariant
        self.in_features, self.tp_rank, self.tp_size, self.row_parallel = in_features, tp_rank, tp_size, row_parallel
        # A's columns follow W's input columns, B's rows W's output rows: one of the two is split
        in_split, out_split = (tp_size, 1) if row_parallel else (1, tp_size)
        assert in_features % in_split == 0, (in_features, tp_size)
        assert all(p.rows % out_split == 0 and p.offset % out_split == 0 for p in self.parts), (self.parts, tp_size)
        in_local = in_features // in_split
        # (local first column, local rows) of each part in this rank's output
        self.local = tuple((p.offset // out_split, p.rows // out_split) for p in self.parts)
        self.register_buffer("a", torch.zeros(len(parts) * rank, in_local, dtype=dtype, device=device),
                             persistent=False)
        for i, (_, rows) in enumerate(self.local):
            self.register_buffer(f"b{i}", torch.zeros(rows, rank, dtype=dtype, device=device), persistent=False)

    def b(self, i: int) -> torch.Tensor:
        return getattr(self, f"b{i}")

    def regions(self) -> dict[tuple[str, str], AdapterTensor]:
        """(base HF weight name, "lora_A" / "lora_B") -> where this rank holds it: contiguous buffers, in
        the full shapes PEFT gives them (A [r, in], B [rows, r]) or this rank's slices of them."""
        out: dict[tuple[str, str], AdapterTensor] = {}
        a_dim, b_dim = (1, None) if self.row_parallel else (None, 0)
        for i, part in enumerate(self.parts):
            a = self.a.narrow(0, i * self.rank, self.rank)
            out[(part.hf_name, "lora_A")] = self._tensor(a, (self.rank, self.in_features), a_dim)
            out[(part.hf_name, "lora_B")] = self._tensor(self.b(i), (part.rows, self.rank), b_dim)
        return out

    def _tensor(self, held: torch.Tensor, full_shape: tuple[int, int], dim: int | None) -> AdapterTensor:
        if self.tp_size == 1:
            dim = None
        return AdapterTensor(held, full_shape, dim, self.tp_rank if dim is not None else 0)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the layer's output for x, [T, out], or its partial before the reduction when row-parallel)
        plus the adapter's term, written into y: one GEMM for x A^T, then one addmm per part straight into
        its output columns (s as addmm's alpha: no extra launch)."""
        r = self.rank
        if self.invariant:  # the mode's GEMM for both products; the scaling and the add are elementwise
            xa = invariant_linear(x, self.a) * self.scaling
            for i, (offset, rows) in enumerate(self.local):
                y.narrow(-1, offset, rows).add_(invariant_linear(xa.narrow(-1, i * r, r), self.b(i)))
            return y
        xa = F.linear(x, self.a)  # [T, parts * r]
        for i, (offset, rows) in enumerate(self.local):
            y.narrow(-1, offset, rows).addmm_(xa.narrow(-1, i * r, r), self.b(i).t(), alpha=self.scaling)
        return y
