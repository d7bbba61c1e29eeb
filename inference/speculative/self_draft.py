"""The batch-invariant mode's own draft: the target model itself, run on the default mode's kernels.

In the mode every row is computed alone (docs/invariance.md), which costs most where a step is bound by
reading the weights: a decode batch of 1-16 rows runs the invariant GEMM and separate norm, rotary and
SiLU launches where the default runs fused GEMVs. Speculation moves that cost off the critical path
(verify-and-rollback): the default kernels propose k tokens per sequence, the invariant forward verifies
the k + 1 positions in one pass (a weight read for k + 1 rows instead of k + 1 reads of one row), and
ExactSpeculation (decoder.py) accepts a proposal only while it equals the token the invariant forward
samples at its position. Every token and logprob a request gets is therefore the invariant forward's,
bit for bit, whatever the draft proposed; a proposal differs only where the two kernels' roundings flip
a sampled token.

SelfDraft is that draft. It holds no weights and no KV cache of its own: it runs the target's modules
with their `invariant` flags cleared and the default attention backend swapped in, for the duration of
a forward (eagerly, or while its CUDA graphs are captured: a replay then runs the default kernels with no
flag touched). Weight syncs, sleep levels, LoRA adapters and FP8 weights are the target's, so the draft
always proposes with the live weights. It writes the KV of the positions it proposes from into the
target's cache; the verify pass rewrites every position it covers, so a position becomes final only with
the invariant forward's KV, and the prefix cache registers nothing else (Scheduler, draft_shares_kv).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from inference.batch import AttentionMetadata
from inference.layers.attention import AttentionBackend


class SelfDraft:
    """The target model (a DecoderForCausalLM built in the batch-invariant mode) on the default kernels.

    `backend`: the attention backend the default mode would give the target (not its batch-invariant
    form). Quacks as the draft model SpecDecoder drives: forward, compute_logits, config,
    attention_layers, kv_cache_spec; binding a KV cache is the target's business."""

    shares_target_kv = True

    def __init__(self, target: nn.Module, backend: AttentionBackend) -> None:
        self.target = target
        self.backend = backend
        self.config = target.config

    @contextmanager
    def default_kernels(self) -> Iterator[None]:
        """The target's layers compute as in the default mode inside the block; restored on exit."""
        switched = [m for m in self.target.modules() if getattr(m, "invariant", None) is True]
        layers = self.target.attention_layers()
        backends = [layer.backend for layer in layers]
        for m in switched:
            m.invariant = False
        for layer in layers:
            layer.backend = self.backend
        try:
            yield
        finally:
            for m in switched:
                m.invariant = True
            for layer, backend in zip(layers, backends):
                layer.backend = backend

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        with self.default_kernels():
            return self.target(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        with self.default_kernels():
            return self.target.compute_logits(hidden, out)

    def attention_layers(self) -> list[Any]:
        return self.target.attention_layers()

    def kv_cache_spec(self) -> Any:
        return self.target.kv_cache_spec()
