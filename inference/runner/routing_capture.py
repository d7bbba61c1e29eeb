"""The routing record of the target model's forwards (SamplingParams.return_routing; docs/moe.md).

`RoutingCapture` owns a static [rows, moe layers, k] buffer (uint8; int16 beyond 256 experts) bound to
an MoE model: every forward writes each token's expert ids into the buffer's first rows, in the order
of the forward's tokens, inside the forward, so the decode graphs capture the write. The buffer is
sized before graphs are captured (`reserve`) and never moves once they are (`freeze`).

After a forward whose rows include a sequence that asked, `step` queues the copy of those rows to the
host in stream order (pinned memory behind an event on CUDA, a clone on CPU: the next forward
overwrites the buffer) and notes where each such sequence's rows go; `StepRouting.store`, called when
the step is read back, writes them into seq.routing by position (inference/sched/routing_rows.py).
Positions are read from the sequences in `step`, so it runs before the step is committed.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from checksum.dtypes import dtype_from_name
from inference.config import ModelConfig
from inference.core import routing_dtype
from inference.sched.sequence import Sequence


@dataclass
class StepRouting:
    """The routing rows of one forward, on the host (complete once `ready` is), and per sequence that
    asked: (its index among the forward's sequences, the sequence, its first position, its first row
    in `rows`, its row count)."""

    rows: torch.Tensor
    spans: list[tuple[int, Sequence, int, int, int]]
    ready: torch.cuda.Event | None

    def store(self, kept: Seq[int] | None = None) -> None:
        """Write each sequence's rows into seq.routing (finished sequences are skipped: their output is
        out). kept[i]: at most that many rows of the forward's i-th sequence are valid (a speculative
        run's accepted positions; the rejected ones are computed again later)."""
        if self.ready is not None:
            self.ready.synchronize()
        data = self.rows.numpy()
        for i, seq, start, row, n in self.spans:
            if seq.is_finished or seq.routing is None:
                continue
            if kept is not None:
                n = min(n, kept[i])
            seq.routing.write(start, data[row:row + n].tobytes())


class RoutingCapture:
    """The routing buffer of one MoE model, and the host copies of its rows (module docstring)."""

    def __init__(self, model: torch.nn.Module, config: ModelConfig, rows: int, device: torch.device) -> None:
        assert config.num_moe_layers > 0, "a dense model routes nothing"
        self.model = model
        self.device = device
        self.dtype = dtype_from_name(routing_dtype(config.num_experts))
        self.shape = (config.num_moe_layers, config.num_experts_per_tok)
        self.row_bytes = self.shape[0] * self.shape[1] * self.dtype.itemsize
        self.frozen = False  # graphs captured the buffer's address
        self.buffer = torch.zeros(0, *self.shape, dtype=self.dtype, device=device)
        self.reserve(rows)

    def reserve(self, rows: int) -> None:
        """Room for forwards of up to `rows` tokens. Growing rebinds the model: only before `freeze`."""
        if rows <= self.buffer.shape[0]:
            return
        assert not self.frozen, f"the routing buffer ({self.buffer.shape[0]} rows) must hold {rows} after graph capture"
        self.buffer = torch.zeros(rows, *self.shape, dtype=self.dtype, device=self.device)
        self.model.bind_routing(self.buffer)

    def freeze(self) -> None:
        """Graphs now write into the buffer: it must stay where it is."""
        self.frozen = True

    def step(self, seqs: Seq[Sequence], counts: Seq[int]) -> StepRouting | None:
        """After a forward over the rows of seqs (counts[i] consecutive rows for seqs[i], from row 0,
        at positions from its num_computed_tokens on): the rows of those that asked, queued to the host;
        None when none asked."""
        spans = []
        row = end = 0
        for i, (seq, n) in enumerate(zip(seqs, counts)):
            if seq.routing is not None:
                spans.append((i, seq, seq.num_computed_tokens, row, n))
                end = row + n
            row += n
        if not spans:
            return None
        assert row <= self.buffer.shape[0], f"{row} tokens past the routing buffer's {self.buffer.shape[0]} rows"
        rows = self.buffer[:end]
        if not rows.is_cuda:
            return StepRouting(rows.clone(), spans, None)
        host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
        host.copy_(rows, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return StepRouting(host, spans, ready)
