"""The experts chosen for one sequence's tokens (SamplingParams.return_routing), kept by position.

Row p is token p's routing: `row_bytes` bytes, the expert ids of every MoE layer (moe layers x k, in the
routing dtype). Pure Python (bytes), filled by the runner when a step that computed the token is read
back, or copied from the prefix cache at admission (inference/sched/block_manager.py).

Invariants:
- A write lands at its position, so a recompute (preemption, a sync's "recompute") or a position
  computed again (a rejected speculative token's) overwrites rather than appends.
- `length`: rows [0, length) are all written (the routing of those tokens is known). `fresh`: rows
  [0, fresh) were written since the sequence last got its blocks (admission), i.e. by the computation
  whose KV it now holds; only those are handed to the prefix cache. fresh <= length.
- `clear` (a restart to the prompt) forgets every row.
"""

from __future__ import annotations


class RoutingRows:
    """One sequence's routing rows (module docstring)."""

    def __init__(self, row_bytes: int) -> None:
        assert row_bytes > 0, row_bytes
        self.row_bytes = row_bytes
        self.data = bytearray()
        self.length = 0
        self.fresh = 0
        self.published = 0  # full blocks of rows [0, fresh) handed to the prefix cache (BlockManager)

    def write(self, position: int, rows: bytes | memoryview) -> None:
        """Rows for tokens position, position + 1, ... (len(rows) // row_bytes of them)."""
        rb = self.row_bytes
        assert len(rows) % rb == 0, (len(rows), rb)
        end = position + len(rows) // rb
        if len(self.data) < end * rb:
            self.data.extend(bytes(end * rb - len(self.data)))
        self.data[position * rb:end * rb] = rows
        if position <= self.length:
            self.length = max(self.length, end)
        if position <= self.fresh:
            self.fresh = max(self.fresh, end)

    def read(self, start: int, end: int) -> bytes:
        """The rows of tokens [start, end); all written (end <= length)."""
        assert 0 <= start <= end <= self.length, (start, end, self.length)
        return bytes(self.data[start * self.row_bytes:end * self.row_bytes])

    def admitted(self, hit_tokens: int, hit_blocks: int) -> None:
        """The sequence got its blocks: `hit_tokens` from the prefix cache (their rows already written),
        the rest to compute. Rows written before (a preempted computation) are no longer fresh."""
        assert hit_tokens <= self.length, (hit_tokens, self.length)
        self.fresh, self.published = hit_tokens, hit_blocks

    def released(self) -> None:
        """The sequence's blocks were freed (preemption, finish): nothing it holds is fresh."""
        self.fresh = self.published = 0

    def clear(self) -> None:
        """Back to no rows (the sequence restarted from its prompt: its tokens changed)."""
        self.data.clear()
        self.length = self.fresh = self.published = 0
