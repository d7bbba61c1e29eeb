"""A LoRA adapter served unmerged on one linear layer: y = base(x) + s * (x A^T) B^T.

`LoRASlot` hangs off a linear (`layer.lora`, None without an adapter) and adds its term after the
layer's own output, as a separate small GEMM pair: x A^T with A of every adapted part stacked
[parts * r, in] (one GEMM for a fused qkv or gate_up), then per part one addmm of (x A_i^T) B_i^T
into that part's output columns: 1 + parts launches per layer. Adapted parts only: a qkv with only
q and v adapted has no k rows. The scaling s (lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA) is fixed at launch.
A and B are buffers, not parameters: the base's loader, arenas and held manifest see the base alone;
the adapter stays resident at every sleep level (its bytes are a few MB), at fixed addresses, so
CUDA graphs capture it and a sync writes it in place (`regions()` are the exact tensors a sync fills).
Batch-invariant mode: both GEMMs run as invariant_linear (each row's bits independent of the others)
and the add is elementwise, so a row's output still does not depend on the batch.
TP > 1 is refused at launch. How it would shard: a column-parallel layer keeps A whole and shards B by
rows like W; a row-parallel layer shards A by columns like W, all-reduces the small x A^T [T, r], and
keeps B whole (its term is then added once, after the layer's own reduction).
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
    """One adapted part of a (possibly fused) layer: its HF module weight name and output columns."""

    hf_name: str      # the base module's HF weight name, e.g. model.layers.0.self_attn.q_proj.weight
    offset: int       # first output column of this part in the layer's output
    rows: int         # its output features


class LoRASlot(nn.Module):
    """The adapter of one linear layer (see the module docstring). Zeros until loaded."""

    def __init__(self, parts: Sequence[LoRAPart], rank: int, in_features: int, scaling: float,
                 dtype: torch.dtype, device: torch.device | str, invariant: bool = False) -> None:
        super().__init__()
        assert parts and rank > 0, (parts, rank)
        self.parts, self.rank, self.scaling, self.invariant = tuple(parts), rank, scaling, invariant
        self.register_buffer("a", torch.zeros(len(parts) * rank, in_features, dtype=dtype, device=device),
                             persistent=False)
        for i, part in enumerate(self.parts):
            self.register_buffer(f"b{i}", torch.zeros(part.rows, rank, dtype=dtype, device=device),
                                 persistent=False)

    def b(self, i: int) -> torch.Tensor:
        return getattr(self, f"b{i}")

    def regions(self) -> dict[tuple[str, str], torch.Tensor]:
        """(base HF weight name, "lora_A" / "lora_B") -> the tensor holding it, contiguous, in the
        shapes PEFT gives them (A [r, in], B [rows, r])."""
        out: dict[tuple[str, str], torch.Tensor] = {}
        for i, part in enumerate(self.parts):
            out[(part.hf_name, "lora_A")] = self.a.narrow(0, i * self.rank, self.rank)
            out[(part.hf_name, "lora_B")] = self.b(i)
        return out

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the layer's output for x, [T, out]) plus the adapter's term, written into y: one GEMM for x A^T,
        then one addmm per part straight into its output columns (s as addmm's alpha: no extra launch)."""
        r = self.rank
        if self.invariant:  # the mode's GEMM for both products; the scaling and the add are elementwise
            xa = invariant_linear(x, self.a) * self.scaling
            for i, part in enumerate(self.parts):
                y.narrow(-1, part.offset, part.rows).add_(invariant_linear(xa.narrow(-1, i * r, r), self.b(i)))
            return y
        xa = F.linear(x, self.a)  # [T, parts * r]
        for i, part in enumerate(self.parts):
            y.narrow(-1, part.offset, part.rows).addmm_(xa.narrow(-1, i * r, r), self.b(i).t(), alpha=self.scaling)
        return y
