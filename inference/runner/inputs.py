"""The inputs of a step's rows, read from the sequences on the host.

A scheduled step's rows (StepRows, built by build_step_rows every step for every row): input ids,
positions, KV slots, context lengths, block tables and the flattened index of each sampled row's last
token. A decode row is one position, one id and one slot: plain list comprehensions, the cheapest way
at one token a row; a prefill chunk's positions and slots are numpy ranges, never a Python loop over
its tokens. `BlockTables` keeps the rows' block tables in one host matrix from step to step.

Expanded decode rows (DecodeRows, decode_logits): several tokens of one sequence computed as a decode
batch of single-token rows, for speculative decoding's verify and the draft's catch-up. Every
attention layer stores the k/v of all rows before its kernel runs, so the row at position p + i reads
the k/v just written by the rows at p .. p + i - 1: the causal forward of the new tokens, as a varlen
forward would compute it, while replaying the decode CUDA graphs with a plain decode's kernel.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from itertools import chain, compress, repeat

import numpy as np
import torch
from torch import nn

from inference.batch import AttentionMetadata, to_device
from inference.runner.cuda_graphs import CUDAGraphRunner
from inference.sched.scheduler import ScheduledBatch
from inference.sched.sequence import Sequence

_TOKEN_IDS = operator.attrgetter("token_ids")


class BlockTables:
    """The host mirror of a step's block tables: int32 [rows, width], entries past a row's length 0.

    A row is rewritten only when its list is another object or has another length than the list last
    written there: the block manager only appends to a sequence's table or replaces it with a new list
    (allocation, free), so identity and length tell whether the row is current (the decode graphs'
    staging, DecodeInputs in cuda_graphs.py, relies on the same). The lists written are held, so an id
    is never recycled."""

    def __init__(self) -> None:
        self._host = np.zeros((0, 0), dtype=np.int32)
        self._objs: list[list[int]] = []  # per row: the list last written there
        self._lens: list[int] = []  # and its length then

    def update(self, tables: list[list[int]]) -> np.ndarray:
        """The rows of `tables` as an int32 [n, max(len) or 1] view, valid until the next update."""
        n = len(tables)
        lens = list(map(len, tables))
        width = max(lens, default=0) or 1
        if n > self._host.shape[0] or width > self._host.shape[1]:
            self._grow(n, width)
        objs, old = self._objs, self._lens
        # every row current: the same lists (or equal ones: their contents are in the rows), not grown
        if n > len(objs) or lens != old[:n] or tables != objs[:n]:
            stale = map(operator.or_, map(operator.is_not, tables, chain(objs, repeat(None))),
                        map(operator.ne, lens, chain(old, repeat(-1))))
            for i in compress(range(n), stale):
                self._write(i, tables[i], lens[i])
        return self._host[:n, :width]

    def _write(self, i: int, table: list[int], length: int) -> None:
        row, objs, old = self._host[i], self._objs, self._lens
        if i == len(objs):
            objs.append(table)
            old.append(0)
        start = old[i] if objs[i] is table and old[i] <= length else 0  # grown in place: the new tail only
        row[start:length] = table[start:]
        if old[i] > length:
            row[length:old[i]] = 0
        objs[i], old[i] = table, length

    def _grow(self, n: int, width: int) -> None:
        rows, cols = self._host.shape  # each dimension at least doubles when it grows
        host = np.zeros((rows if n <= rows else max(n, 2 * rows), cols if width <= cols else max(width, 2 * cols)),
                        dtype=np.int32)
        host[:rows, :cols] = self._host
        self._host = host


@dataclass
class StepRows:
    """The inputs of one step's rows (T tokens in all, B rows, m of them sampled), read from their
    sequences before the step advances them: row i computes tokens [c, c + n_i) with c its
    num_computed_tokens. Lists for decode rows, numpy arrays for a step with longer chunks."""

    ids: list[int]  # [T] input token ids (placeholders < 0 included: async scheduling)
    positions: list[int] | np.ndarray  # [T]
    slots: list[int] | np.ndarray  # [T] block_table[p // block_size] * block_size + p % block_size
    query_lens: list[int]  # [B] new tokens per row
    context_lens: list[int]  # [B] tokens each row attends to after this step
    tables: list[list[int]]  # [B] the rows' block tables
    sample_rows: list[int]  # the rows that sample
    last_index: list[int] | np.ndarray  # [m] flattened index of each sampled row's last token


def decode_rows(seqs: list[Sequence], block_size: int) -> StepRows:
    """The rows of a decode step: each row computes one token and samples. Plain list
    comprehensions: at one token per row they are cheaper than numpy (or `map` over attribute
    getters) at every batch size."""
    tables = [s.block_table for s in seqs]
    positions = [s.num_computed_tokens for s in seqs]
    rows = list(range(len(seqs)))
    return StepRows(ids=[s.token_ids[s.num_computed_tokens] for s in seqs], positions=positions,
                    slots=[t[p // block_size] * block_size + p % block_size for t, p in zip(tables, positions)],
                    query_lens=[1] * len(seqs), context_lens=[p + 1 for p in positions], tables=tables,
                    sample_rows=rows, last_index=rows)


def build_step_rows(batch: ScheduledBatch, block_size: int, mirror: BlockTables) -> tuple[StepRows, np.ndarray]:
    """The rows of `batch` and their block tables as mirror.update's int32 [B, width] view. A decode
    step takes decode_rows; a step with longer chunks finds positions and slots with numpy ranges."""
    seqs = batch.seqs
    n = len(seqs)
    if batch.num_tokens == n and batch.sample.count(True) == n:
        rows = decode_rows(seqs, block_size)
        return rows, mirror.update(rows.tables)
    tables = [s.block_table for s in seqs]
    table_rows = mirror.update(tables)
    starts_list = [s.num_computed_tokens for s in seqs]
    starts = np.array(starts_list, dtype=np.int64)
    query_lens = np.array(batch.num_new_tokens, dtype=np.int64)
    ends = starts + query_lens
    chunks = map(slice, starts_list, ends.tolist())
    ids = list(chain.from_iterable(map(operator.getitem, map(_TOKEN_IDS, seqs), chunks)))
    lasts = np.cumsum(query_lens) - 1  # each row's last token in the flattened batch
    firsts = lasts + 1 - query_lens
    positions = np.arange(len(ids), dtype=np.int64) + np.repeat(starts - firsts, query_lens)
    blocks, offsets = np.divmod(positions, block_size)
    slots = np.multiply(table_rows[np.repeat(np.arange(n), query_lens), blocks], block_size, dtype=np.int64)
    slots += offsets
    sample_rows = list(compress(range(n), batch.sample))
    return StepRows(ids=ids, positions=positions, slots=slots, query_lens=batch.num_new_tokens,
                    context_lens=ends.tolist(), tables=tables, sample_rows=sample_rows,
                    last_index=lasts[sample_rows]), table_rows


@dataclass
class DecodeRows:
    """Host lists of one expanded-row decode batch (see the module docstring). Row r is one token at
    positions[r]; its k/v is written at slots[r] and it attends over the first context_lens[r] tokens
    found through tables[r]. Rows of one sequence repeat its block table."""

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
