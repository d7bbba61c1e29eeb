"""Per-step metadata of one forward pass, passed explicitly to the model (never a global).

Tokens of all sequences in a step are flattened into one 1-D batch of T tokens. Sequence i
contributes query_lens[i] new tokens (a prefill chunk, or 1 for a decode), whose keys and values
are written at `slot_mapping` (slot = block_id * block_size + offset in block) before attention,
then attends over its first context_lens[i] cached tokens (its earlier tokens plus the new ones),
found through block_tables[i]. A decode-only step has query_lens all 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    query_lens: list[int]  # host copy: new tokens per sequence
    context_lens_host: list[int]  # host copy: tokens attended per sequence after this step
    cu_query_lens: torch.Tensor  # [B + 1] int32, device: prefix sums of query_lens
    context_lens: torch.Tensor  # [B] int32, device
    slot_mapping: torch.Tensor  # [T] int64, device: where each new token's k/v is written
    block_tables: torch.Tensor  # [B, max_blocks] int32, device; unused entries are 0
    block_size: int
    max_query_len: int
    max_context_len: int
    is_decode: bool  # every query_len is 1 (the CUDA-graph case)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        slot_mapping: list[int] | torch.Tensor,
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str,
    ) -> AttentionMetadata:
        """Build from host lists (the runner's path and the tests'); slot_mapping may already be an
        int64 tensor on the device. The int32 parts (prefix sums, context lengths, block tables) go
        to the device in one copy."""
        num_seqs = len(query_lens)
        assert num_seqs == len(context_lens) == len(block_tables)
        assert sum(query_lens) == len(slot_mapping)
        width = max(map(len, block_tables), default=0) or 1
        packed = np.zeros(2 * num_seqs + 1 + num_seqs * width, dtype=np.int32)
        packed[1: num_seqs + 1] = list(accumulate(query_lens))
        packed[num_seqs + 1: 2 * num_seqs + 1] = context_lens
        tables = packed[2 * num_seqs + 1:].reshape(num_seqs, width)
        for row, table in zip(tables, block_tables):
            row[:len(table)] = table
        dev = torch.from_numpy(packed).to(device, non_blocking=True)
        if not isinstance(slot_mapping, torch.Tensor):
            slot_mapping = torch.tensor(slot_mapping, dtype=torch.int64).to(device, non_blocking=True)
        return cls(
            query_lens=list(query_lens),
            context_lens_host=list(context_lens),
            cu_query_lens=dev[: num_seqs + 1],
            context_lens=dev[num_seqs + 1: 2 * num_seqs + 1],
            slot_mapping=slot_mapping,
            block_tables=dev[2 * num_seqs + 1:].view(num_seqs, width),
            block_size=block_size,
            max_query_len=max(query_lens, default=0),
            max_context_len=max(context_lens, default=0),
            is_decode=all(q == 1 for q in query_lens),
        )
