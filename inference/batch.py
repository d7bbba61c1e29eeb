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


def to_device(host: torch.Tensor | list, device: torch.device | str, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A host tensor's (or a list's, as `dtype`) copy on `device`, queued without waiting: a CUDA copy goes
    through pinned memory (torch caches pinned blocks and keeps one until its copy ran), since a pageable
    source may make the driver wait for all the work queued on the stream first (a step in flight, or a
    draft's launches)."""
    if not isinstance(host, torch.Tensor):
        host = torch.tensor(host, dtype=dtype)
    if torch.device(device).type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


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
    # decode: the most rows of one sequence this launch may hold (1: plain decode; k + 1: a spec-decode
    # verify); 0: as many as the attention backend allows (its tiles.decode_max_rows). Static per graph.
    rows_per_seq: int = 0

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
        """Build from host lists (the tests' path and speculative decoding's); slot_mapping may already
        be an int64 tensor on the device."""
        assert len(query_lens) == len(context_lens) == len(block_tables)
        assert sum(query_lens) == len(slot_mapping)
        width = max(map(len, block_tables), default=0) or 1
        tables = np.zeros((len(block_tables), width), dtype=np.int32)
        for row, table in zip(tables, block_tables):
            row[:len(table)] = table
        if not isinstance(slot_mapping, torch.Tensor):
            slot_mapping = to_device(slot_mapping, device)
        return cls.from_table_rows(list(query_lens), list(context_lens), slot_mapping, tables, block_size, device)

    @classmethod
    def from_table_rows(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        slot_mapping: torch.Tensor,
        block_tables: np.ndarray,
        block_size: int,
        device: torch.device | str,
    ) -> AttentionMetadata:
        """Build from the block tables as an int32 [B, max_blocks] array padded with 0 (the runner's
        path: inference/runner/inputs.py keeps them) and the slots on the device. The int32 parts (prefix
        sums, context lengths, block tables) go to the device in one copy. The lists are kept."""
        num_seqs = len(query_lens)
        assert len(context_lens) == num_seqs and block_tables.shape[0] == num_seqs
        is_decode = query_lens.count(1) == num_seqs
        packed = np.empty(2 * num_seqs + 1 + block_tables.size, dtype=np.int32)
        packed[0] = 0
        packed[1: num_seqs + 1] = np.arange(1, num_seqs + 1) if is_decode else list(accumulate(query_lens))
        packed[num_seqs + 1: 2 * num_seqs + 1] = context_lens
        packed[2 * num_seqs + 1:].reshape(block_tables.shape)[:] = block_tables
        dev = to_device(torch.from_numpy(packed), device)
        return cls(
            query_lens=query_lens,
            context_lens_host=context_lens,
            cu_query_lens=dev[: num_seqs + 1],
            context_lens=dev[num_seqs + 1: 2 * num_seqs + 1],
            slot_mapping=slot_mapping,
            block_tables=dev[2 * num_seqs + 1:].view(num_seqs, block_tables.shape[1]),
            block_size=block_size,
            max_query_len=min(num_seqs, 1) if is_decode else max(query_lens),
            max_context_len=max(context_lens, default=0),
            is_decode=is_decode,
        )
