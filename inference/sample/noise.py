"""The random draws of speculative decoding (inference/speculative/decoder.py): the draft's proposals, the
acceptance test and the residual draw, all from the sampler's counter-based generator
(inference/sample/kernels.py), every row of a call in one launch, no per-row torch.Generator.

A seeded, sampled row is keyed by (stream_seed(seed, output position, stream), output position), so
its draws depend only on its own seed and position, never on the batch; the three streams never share
a key. Every other row takes a seed drawn once per call from the rank's generator (TP ranks draw the
same)."""

from __future__ import annotations

import torch

from inference.batch import to_device
from inference.core import INT64_MAX
from inference.sample.batch import position_seed
from inference.sample.kernels import triton, uniforms_torch
from inference.sched.sequence import Sequence

if triton is not None:
    from inference.sample.kernels import uniforms_triton

# stream salts of a seeded row's random draws, so the three never share a generator seed
DRAFT, ACCEPT, RESIDUAL = 1, 2, 3


def stream_seed(seed: int, position: int, stream: int) -> int:
    """The generator seed of one random draw of a seeded row (stable across runs and processes)."""
    return position_seed((seed + stream * 0x632BE59BD9B4E019) & INT64_MAX, position)


def uniforms(seqs: list[Sequence], positions: list[int], stream: int, n_cols: int,
             generator: torch.Generator) -> torch.Tensor:
    """[rows, n_cols] uniforms in (0, 1) on the generator's device, row i keyed as the module says."""
    device = generator.device
    own = [stream_seed(q.seed, pos, stream) if q.seed is not None and not q.params.greedy else -1
           for q, pos in zip(seqs, positions)]
    seeds = to_device(own, device)
    if min(own, default=0) < 0:
        drawn = torch.randint(0, 1 << 62, (len(seqs),), dtype=torch.int64, device=device, generator=generator)
        seeds = torch.where(seeds >= 0, seeds, drawn)
    pos = to_device(positions, device)
    draw = uniforms_triton if (triton is not None and device.type == "cuda") else uniforms_torch
    return draw(seeds, pos, n_cols)


def exponential(seqs: list[Sequence], positions: list[int], stream: int, n_cols: int,
                generator: torch.Generator) -> torch.Tensor:
    """E ~ Exp(1), [rows, n_cols], from the uniforms of the same keys."""
    return torch.log1p(uniforms(seqs, positions, stream, n_cols, generator).neg_()).neg_()


def race(logprobs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """argmax(log p - log E), E ~ Exp(1): an exact draw from p (rows with zeros allowed)."""
    return (logprobs - noise.log()).argmax(dim=-1)
