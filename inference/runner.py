"""The model runner: a scheduled batch -> tensors -> model -> sampled tokens.

It owns the model, the KV cache tensor and the sampling generator of one rank. It knows nothing
about requests beyond the Sequence fields it reads (tokens, computed count, block table, params).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inference.batch import AttentionMetadata
from inference.config import ModelConfig
from inference.cuda_graphs import CUDAGraphRunner
from inference.parallel import TPInfo
from inference.sampler import SamplingBatch, sample
from inference.scheduler import ScheduledBatch

SampleResult = tuple[int, float, "dict[int, float] | None"]


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: list[int]  # index into batch.seqs of each sampled row
    last_token_index: torch.Tensor  # [len(sample_rows)] flattened index of each row's last token


class ModelRunner:
    def __init__(self, model: torch.nn.Module, model_config: ModelConfig, tp: TPInfo,
                 device: torch.device, dtype: torch.dtype, seed: int = 0) -> None:
        self.model = model
        self.model_config = model_config
        self.tp = tp
        self.device = device
        self.dtype = dtype
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.kv_cache: torch.Tensor | None = None
        self.block_size = 0
        self.graphs: CUDAGraphRunner | None = None  # set by capture_graphs

    # ---- KV cache -------------------------------------------------------------------------
    def kv_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return self.model.kv_cache_spec().shape(num_blocks, block_size)

    def kv_bytes_per_block(self, block_size: int) -> int:
        return self.model.kv_cache_spec().bytes_per_block(block_size, self.dtype)

    def bind_kv_cache(self, kv: torch.Tensor, block_size: int) -> None:
        """Bind a [2, layers, blocks, block_size, kv_heads, head_dim] tensor (it may live in an arena)."""
        assert kv.dtype == self.dtype, (kv.dtype, self.dtype)
        self.kv_cache = kv
        self.block_size = block_size
        self.model.bind_kv_cache(kv)

    # ---- one step -------------------------------------------------------------------------
    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        context_lens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        last_index: list[int] = []
        bs = self.block_size
        for row, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            start = seq.num_computed_tokens
            end = start + n
            ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            context_lens.append(end)
            tables.append(table)
            if end == seq.num_tokens:
                sample_rows.append(row)
                last_index.append(len(ids) - 1)
        meta = AttentionMetadata.build(batch.num_new_tokens, context_lens, slots, tables, bs, self.device)
        return StepInputs(
            input_ids=torch.tensor(ids, dtype=torch.int64).to(self.device, non_blocking=True),
            positions=torch.tensor(positions, dtype=torch.int64).to(self.device, non_blocking=True),
            meta=meta,
            sample_rows=sample_rows,
            last_token_index=torch.tensor(last_index, dtype=torch.int64).to(self.device, non_blocking=True),
        )

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> list[SampleResult | None]:
        """Run one step; returns per scheduled sequence its sampled result, or None (mid-prefill)."""
        assert self.kv_cache is not None, "bind_kv_cache first"
        logits = self._graph_decode(batch) if self.graphs is not None else None
        if logits is not None:
            sample_rows = list(range(len(batch.seqs)))
        else:
            inp = self.prepare(batch)
            sample_rows = inp.sample_rows
            if not sample_rows:
                self.model(inp.input_ids, inp.positions, inp.meta)
                return [None] * len(batch.seqs)
            hidden = self.model(inp.input_ids, inp.positions, inp.meta).index_select(0, inp.last_token_index)
            logits = self.model.compute_logits(hidden)
        seqs = [batch.seqs[r] for r in sample_rows]
        sb = SamplingBatch.build([s.params for s in seqs], [s.seed for s in seqs],
                                 [s.num_generated for s in seqs], self.model_config.vocab_size, self.device)
        out = sample(logits, sb, self.generator)
        # the step's one host sync: tokens and their logprobs together (float64 holds the ids exactly)
        tokens, logprobs = torch.stack((out.token_ids.double(), out.logprobs.double())).tolist()
        tops = top_dicts(out.top_ids, out.top_logprobs, [s.params.logprobs for s in seqs])
        results: list[SampleResult | None] = [None] * len(batch.seqs)
        for i, row in enumerate(sample_rows):
            results[row] = (int(tokens[i]), logprobs[i], tops[i])
        return results

    # ---- CUDA graphs ----------------------------------------------------------------------
    def capture_graphs(self, max_batch: int, max_model_len: int, sizes: list[int] | None = None) -> None:
        """Decode graphs for batch_ladder(max_batch), or for `sizes` (speculative decoding adds the
        sizes of its expanded-row verify batches; see inference/spec_decode.py)."""
        max_blocks = -(-max_model_len // self.block_size)
        self.graphs = CUDAGraphRunner(self.model, max_batch, max_blocks, self.block_size, self.device, self.dtype,
                                      sizes)
        self.graphs.capture()

    def _graph_decode(self, batch: ScheduledBatch) -> torch.Tensor | None:
        """Logits of a decode-only step replayed from a graph, or None when no graph fits."""
        assert self.graphs is not None
        seqs = batch.seqs
        if any(n != 1 for n in batch.num_new_tokens) or any(s.num_computed_tokens + 1 != s.num_tokens for s in seqs):
            return None
        width = max(len(s.block_table) for s in seqs)
        if not self.graphs.can_use(len(seqs), width):
            return None
        bs = self.block_size
        pos = [s.num_computed_tokens for s in seqs]
        rows = torch.tensor([[s.token_ids[-1] for s in seqs], pos,
                             [s.block_table[p // bs] * bs + p % bs for s, p in zip(seqs, pos)],
                             [p + 1 for p in pos]], dtype=torch.int64).to(self.device, non_blocking=True)
        tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in seqs],
                              dtype=torch.int32).to(self.device, non_blocking=True)
        return self.graphs.replay(rows[0], rows[1], rows[2], rows[3].to(torch.int32), tables)


def top_dicts(ids: torch.Tensor | None, lps: torch.Tensor | None, wanted: list[int]) -> list:
    if ids is None or lps is None:
        return [None] * len(wanted)
    ids_l, lps_l = ids.tolist(), lps.tolist()
    return [dict(zip(ids_l[i][:k], lps_l[i][:k])) if k else None for i, k in enumerate(wanted)]
