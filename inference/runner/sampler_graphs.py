"""CUDA graphs of the sampler for decode steps with sampled rows (runner.GreedyGraphs does all-greedy ones).

One graph per decode graph size runs `sample_pairs` over that size's static logits and a static
SamplingBatch: per-row buffers of the largest size with every filter flag set, so that one graph
serves any mix of greedy, temperature, top-k, top-p, min-p and processed-logprob rows (a row without
top-k and top-p costs the threshold search nothing; see inference/sample/kernels.py). A step
replaces a dozen launches and their allocations with one replay, plus copies of the batch's row
tensors when its rows changed and of its positions every step.
"""

from __future__ import annotations

import dataclasses

import torch

from inference.core import SamplingParams
from inference.runner.cuda_graphs import CUDAGraphRunner, capture_ladder
from inference.sample.sampler import SamplingBatch, sample_pairs

# the per-row tensors a batch brings (positions aside, which change every step)
ROW_FIELDS = ("greedy", "inv_temps", "top_ks", "top_ps", "log_min_ps", "processed_logprobs", "seeds")


class SamplingGraphs:
    """Lifecycle: capture, replay, destroy. Rows past the batch are the decode graph's padding: they
    sample with whatever settings the buffers last held (valid ones, at worst a filtered row's search)
    and their results are never read. A row's token is the one the eager `sample_pairs` picks (the
    thresholds and the race reduce each row alone, in a chunking fixed by the vocabulary); a raw
    logprob may differ in the last float32 bits (the raw log-sum-exp splits a row by batch size)."""

    def __init__(self, graphs: CUDAGraphRunner, vocab_size: int, invariant: bool = False) -> None:
        """invariant: the batch-invariant mode (SamplingBatch.invariant), fixed at capture."""
        self.decode = graphs
        cap = graphs.sizes[-1]
        rows = SamplingBatch.build_rows([SamplingParams(temperature=1.0)] * cap, [0] * cap, vocab_size, graphs.device,
                                        invariant)
        self.static = dataclasses.replace(
            rows.at(torch.zeros(cap, dtype=torch.int64, device=graphs.device)),
            any_top_k=True, any_top_p=True, any_min_p=True, any_processed=True)
        self.out = torch.empty(cap, 2, dtype=torch.float64, device=graphs.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None
        self._loaded: torch.Tensor | None = None  # the `greedy` tensor of the rows in the buffers

    @torch.inference_mode()
    def capture(self) -> None:
        def rows(bs: int) -> None:
            sample_pairs(self.decode.outputs[bs], self.static.head(bs), self.out[:bs])

        def warm_up(bs: int) -> None:  # Triton compiles before capture
            rows(bs)
            rows(bs)

        self.pool, self.graphs, _ = capture_ladder(self.decode.sizes, self.decode.device, warm_up, rows)

    def replay(self, n: int, sb: SamplingBatch) -> torch.Tensor:
        """(token id, logprob) [n, 2] of the rows of the decode graph replayed last for n rows, sampled
        with sb's settings (rows with seeds only: a graph draws nothing from a generator)."""
        assert sb.size == n and not sb.all_greedy and not sb.any_unseeded, (n, sb.size)
        assert sb.positions is not None and sb.greedy is not None
        if sb.greedy is not self._loaded:  # the runner keeps a batch's row tensors while its rows stay
            for name in ROW_FIELDS:
                getattr(self.static, name)[:n].copy_(getattr(sb, name))
            self._loaded = sb.greedy
        assert self.static.positions is not None
        self.static.positions[:n].copy_(sb.positions)
        self.graphs[self.decode.size_for(n)].replay()
        return self.out[:n]

    def destroy(self) -> None:
        self.graphs.clear()
        self.pool = None
        self._loaded = None
