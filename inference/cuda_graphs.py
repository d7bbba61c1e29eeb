"""CUDA graphs for decode steps: capture, can_use, pad, replay, destroy.

Decode steps (one new token per sequence) replay a graph captured for the smallest ladder size that
holds the batch; the rows beyond the batch are padding: slot -1 (their k/v are not stored), context
length 0 and block table zeros, so they attend to nothing and touch no real cache entry. Graphs are
captured largest first into one shared memory pool. The graph covers the model's forward up to the
final norm and the LM head, whose logits land in one static buffer; the sampler runs after it.

Inputs live in static buffers that every replay reads; the KV cache and the weights are read at the
addresses captured, which is why they live in arenas whose addresses survive sleep and wake.
"""

from __future__ import annotations

import logging
import time

import torch

from inference.batch import AttentionMetadata

log = logging.getLogger(__name__)


def batch_ladder(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_batch (max_batch itself always included)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sorted({*sizes, max_batch})


def extended_ladder(max_batch: int, max_rows: int) -> list[int]:
    """batch_ladder(max_batch) plus the sizes up to max_rows (speculative decoding's expanded-row
    batches). Every size of batch_ladder(max_batch) stays, so a plain decode replays the same graph."""
    return sorted({*batch_ladder(max_batch), *batch_ladder(max(max_rows, max_batch))})


class CUDAGraphRunner:
    """Decode graphs of one model over the KV cache bound to it (the target's, or the draft's).

    `sizes` overrides the ladder (speculative decoding captures extended_ladder); a row of a replay
    is one token with its own position, slot, context length and block table row.
    """

    def __init__(self, model: torch.nn.Module, max_batch: int, max_blocks_per_seq: int, block_size: int,
                 device: torch.device, dtype: torch.dtype, sizes: list[int] | None = None) -> None:
        self.model = model
        self.block_size = block_size
        self.max_blocks = max_blocks_per_seq
        self.device = device
        self.sizes = sorted(set(sizes)) if sizes else batch_ladder(max_batch)
        n = self.sizes[-1]
        i32, i64 = torch.int32, torch.int64
        self.input_ids = torch.zeros(n, dtype=i64, device=device)
        self.positions = torch.zeros(n, dtype=i64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=i64, device=device)
        self.context_lens = torch.zeros(n, dtype=i32, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=i32, device=device)
        self.cu_query_lens = torch.arange(n + 1, dtype=i32, device=device)
        self.logits = torch.empty(n, model.config.vocab_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None
        self.capture_seconds = 0.0

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_lens=[1] * bs, context_lens_host=[1] * bs, cu_query_lens=self.cu_query_lens[: bs + 1],
            context_lens=self.context_lens[:bs], slot_mapping=self.slot_mapping[:bs],
            block_tables=self.block_tables[:bs], block_size=self.block_size, max_query_len=1,
            max_context_len=self.max_blocks * self.block_size, is_decode=True)

    def _forward(self, bs: int) -> torch.Tensor:
        hidden = self.model(self.input_ids[:bs], self.positions[:bs], self._meta(bs))
        return self.model.compute_logits(hidden, out=self.logits[:bs])

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        self.pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for bs in reversed(self.sizes):
                for _ in range(2):  # warm-up: Triton compiles, cuBLAS picks its kernels
                    self._forward(bs)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                    self.outputs[bs] = self._forward(bs)
                self.graphs[bs] = graph
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - start
        log.info("captured %d decode graphs (batch %d..%d) in %.2f s", len(self.graphs), self.sizes[0],
                 self.sizes[-1], self.capture_seconds)

    def can_use(self, num_seqs: int, max_blocks: int) -> bool:
        return bool(self.graphs) and num_seqs <= self.sizes[-1] and max_blocks <= self.max_blocks

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
               context_lens: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
        """Logits [n, vocab] of one decode step of n sequences (inputs on the device or pinned)."""
        n = input_ids.shape[0]
        bs = next(b for b in self.sizes if b >= n)
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(slots, non_blocking=True)
        self.context_lens[:n].copy_(context_lens, non_blocking=True)
        width = block_tables.shape[1]
        self.block_tables[:n, :width].copy_(block_tables, non_blocking=True)
        if n < bs:  # padding rows: store nothing, attend to nothing
            self.slot_mapping[n:bs].fill_(-1)
            self.context_lens[n:bs].zero_()
        self.graphs[bs].replay()
        return self.outputs[bs][:n]

    def destroy(self) -> None:
        self.graphs.clear()
        self.outputs.clear()
        self.pool = None
