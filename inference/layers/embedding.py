"""Vocab-parallel embedding and LM head.

The vocabulary is padded up to a multiple of the TP size (padded_vocab = ceil(vocab / tp) * tp) so
that every rank holds an equal shard of rows [rank * shard, (rank + 1) * shard). Padding rows are
zero-filled by the loader (so that every replica holds the same bytes for the checksum audit), are
never looked up (token ids are < vocab_size), and their logits are cut off: compute_logits returns
exactly vocab_size columns on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from inference.layers.gemm_invariant import invariant_linear
from inference.layers.linear import HeldPart, ShardId, new_param
from inference.parallel import TPInfo


@dataclass(frozen=True)
class VocabShard:
    """Which rows of the (padded) vocabulary one rank holds."""

    vocab_size: int
    padded_vocab_size: int
    start: int
    end: int

    @classmethod
    def of(cls, vocab_size: int, tp: TPInfo) -> VocabShard:
        padded = -(-vocab_size // tp.size) * tp.size
        shard = padded // tp.size
        return cls(vocab_size, padded, tp.rank * shard, (tp.rank + 1) * shard)

    @property
    def size(self) -> int:
        return self.end - self.start

    def load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        """Copy rows [start, end) of the full [vocab_size, hidden] tensor; zero the padding rows."""
        assert shard_id is None, shard_id
        assert loaded.shape == (self.vocab_size, param.shape[1]), tuple(loaded.shape)
        n_real = max(0, min(self.end, self.vocab_size) - self.start)
        param.data[:n_real].copy_(loaded[self.start:self.start + n_real])
        param.data[n_real:].zero_()

    def held_part(self, param: nn.Parameter, shard_id: ShardId = None) -> HeldPart:
        """Where `load` writes the full tensor's rows (the padding rows after them stay zero)."""
        assert shard_id is None, shard_id
        n_real = max(0, min(self.end, self.vocab_size) - self.start)
        return param.data[:n_real], (0, self.start, n_real)


class VocabParallelEmbedding(nn.Module):
    """Each rank looks up the ids in its shard, writes zeros elsewhere; all_reduce sums the shards."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPInfo, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.tp = tp
        self.shard = VocabShard.of(vocab_size, tp)
        self.weight = new_param((self.shard.size, hidden_size), dtype, device, self.shard.load, self.shard.held_part)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        # Masked lookup without host syncs: out-of-shard ids read row 0 and are zeroed.
        start, end = self.shard.start, self.shard.end
        in_shard = (input_ids >= start) & (input_ids < end)
        local_ids = torch.where(in_shard, input_ids - start, 0)
        out = F.embedding(local_ids, self.weight) * in_shard.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(out)


class ParallelLMHead(nn.Module):
    """logits = h W^T over this rank's vocab shard, gathered to the full vocab on every rank.

    With `tied_to`, the weight IS the embedding's Parameter (same storage): named_parameters()
    lists it once, under the embedding's name, and a weight update of one updates both.
    `invariant` (the batch-invariant mode): the product is gemm_invariant.invariant_linear, so a row's
    logits do not depend on how many rows the step computes.
    """

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPInfo, dtype: torch.dtype,
                 device: torch.device | str, tied_to: VocabParallelEmbedding | None = None,
                 invariant: bool = False) -> None:
        super().__init__()
        self.tp = tp
        self.invariant = invariant
        self.shard = VocabShard.of(vocab_size, tp)
        if tied_to is not None:
            assert tied_to.shard == self.shard
            self.weight = tied_to.weight
        else:
            self.weight = new_param((self.shard.size, hidden_size), dtype, device, self.shard.load,
                                    self.shard.held_part)

    def forward(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[N, hidden] -> [N, vocab_size] logits (full vocab, every rank, in the weight's dtype).

        With `out` ([N, vocab_size]) the logits are written there (straight from the matmul at TP=1),
        which is how a CUDA graph leaves them in a static buffer.
        """
        if self.invariant:
            local = invariant_linear(hidden, self.weight)
        elif out is not None and self.tp.size == 1:
            return torch.mm(hidden, self.weight.t(), out=out)
        else:
            local = F.linear(hidden, self.weight)
        logits = self.tp.all_gather_last_dim(local)
        if self.shard.padded_vocab_size != self.shard.vocab_size:
            logits = logits[..., :self.shard.vocab_size]
        return logits if out is None else out.copy_(logits)
