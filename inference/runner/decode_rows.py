"""Expanded decode rows: several tokens of one sequence computed as a decode batch of single-token rows.

Row r is one token at positions[r]; its k/v is written at slots[r] and it attends over the first
context_lens[r] tokens found through tables[r]. Rows of one sequence repeat its block table. Every
attention layer stores the k/v of all rows before its attention kernel runs, so a row at position
p + i, with context length p + i + 1, reads the k/v just written by the rows at p .. p + i - 1: the
rows of a sequence compute exactly the causal forward of its new tokens, as a varlen (prefill-style)
forward would. Being a decode batch, it can replay the model's decode CUDA graphs, and each row runs
the same attention kernel as a plain decode step (speculative decoding's verify and draft catch-up).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from inference.batch import AttentionMetadata, to_device
from inference.runner.cuda_graphs import CUDAGraphRunner


@dataclass
class DecodeRows:
    """Host lists of one expanded-row decode batch (see the module docstring)."""

    block_size: int
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    context_lens: list[int] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=list)

    def add(self, table: list[int], start: int, count: int) -> None:
        """Rows for positions start .. start + count - 1 of a sequence whose blocks are `table`."""
        bs = self.block_size
        assert -(-(start + count) // bs) <= len(table), (start, count, len(table))
        for p in range(start, start + count):
            self.positions.append(p)
            self.slots.append(table[p // bs] * bs + p % bs)
            self.context_lens.append(p + 1)
            self.tables.append(table)

    def __len__(self) -> int:
        return len(self.positions)

    @property
    def width(self) -> int:
        return max((len(t) for t in self.tables), default=1) or 1


def decode_logits(model: nn.Module, graphs: CUDAGraphRunner | None, input_ids: torch.Tensor,
                  rows: DecodeRows, device: torch.device, logits: bool = True) -> torch.Tensor:
    """Logits [len(rows), vocab] of the rows, replayed from a graph when one fits (then a view of the
    graph's static buffer, valid until its next replay), else run eagerly. logits=False: only the rows'
    KV is wanted, so graphs captured without the LM head fit too (what comes back is then not logits)."""
    n, width = len(rows), rows.width
    assert input_ids.shape == (n,), (input_ids.shape, n)
    if graphs is not None and graphs.can_use(n, width, logits=logits):
        packed = to_device([rows.positions, rows.slots, rows.context_lens], device)
        tables = to_device([t + [0] * (width - len(t)) for t in rows.tables], device, torch.int32)
        return graphs.replay(input_ids, packed[0], packed[1], packed[2].to(torch.int32), tables)
    meta = AttentionMetadata.build([1] * n, rows.context_lens, rows.slots, rows.tables, rows.block_size, device)
    hidden = model(input_ids, to_device(rows.positions, device), meta)
    return model.compute_logits(hidden) if logits else hidden
