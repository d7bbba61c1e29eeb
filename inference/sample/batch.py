"""The sampler's per-step batch: every row's settings as device tensors, and the noise seeds.

A row's tensors depend only on its sequence (params and noise seed never change), so the runner
builds them once per list of rows and gives each step only the rows' output positions.
"""

from __future__ import annotations

import dataclasses
import math
from array import array
from dataclasses import dataclass

import torch

from inference.batch import to_device
from inference.core import INT64_MAX
from inference.sample.kernels import MAX_INV_TEMP

_MIX = 0x9E3779B97F4A7C15
_UNSEEDED_SALT = 0x5DEECE66D


def position_seed(seed: int, position: int) -> int:
    """A 63-bit seed of (seed, position), stable across runs (spec decoding seeds its generators with it)."""
    return ((seed * 1_000_003) ^ ((position + 1) * _MIX)) & INT64_MAX


def unseeded_seed(runner_seed: int, batch_index: int, row: int) -> int:
    """The noise seed of a row without one: row `row` of the runner's `batch_index`-th list of sampling
    rows. Every TP rank has the same runner seed and runs the same schedule, so all ranks (and a TP=1
    engine beside them, in any process) draw the same noise without a collective; no two (batch_index,
    row) share a seed (position_seed is injective in each argument), and a row's output position
    moves its noise on from step to step."""
    return position_seed(position_seed(runner_seed ^ _UNSEEDED_SALT, batch_index), row)


@dataclass
class SamplingBatch:
    """Per-row sampling settings of one step. The row tensors depend only on the rows' sequences: the
    runner builds them once per list of rows (`build_rows`, one host-to-device copy) and gives each
    step its positions (`at`). Host flags skip unused work; an all-greedy batch has no tensors."""

    greedy: torch.Tensor | None  # [B] bool: temperature 0
    inv_temps: torch.Tensor | None  # [B] float32: 1 / T clamped to float32's max; 1 on greedy rows (unscaled)
    top_ks: torch.Tensor | None  # [B] int32; the vocab size where disabled
    top_ps: torch.Tensor | None  # [B] float32; 1 where disabled
    log_min_ps: torch.Tensor | None  # [B] float32: log(min_p); -inf where disabled
    processed_logprobs: torch.Tensor | None  # [B] bool: report logprobs of the processed distribution
    seeds: torch.Tensor | None  # [B] int64: the row's noise seed; 0 on `unseeded` rows
    unseeded: torch.Tensor | None  # [B] bool: built without a seed; `sample` draws one from its generator
    positions: torch.Tensor | None  # [B] int64: output position of the token drawn (the noise counter)
    size: int
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    any_processed: bool  # never set on an all-greedy batch (it reports raw logprobs)
    any_unseeded: bool
    num_top_logprobs: int  # max over rows; 0 for none
    # the engine's batch-invariant mode: every reduction of a row as if it were alone (inference/sample/sampler.py)
    invariant: bool = False

    @classmethod
    def build(cls, params: list, seeds: list[int | None], positions: list[int], vocab_size: int,
              device: torch.device | str, invariant: bool = False) -> SamplingBatch:
        """params: SamplingParams per row; seeds: the rows' noise seeds (None: from the generator);
        positions: output positions; invariant: the batch-invariant mode."""
        rows = cls.build_rows(params, seeds, vocab_size, device, invariant)
        if rows.all_greedy:
            return rows
        return rows.at(to_device(positions, device))

    @classmethod
    def build_rows(cls, params: list, seeds: list[int | None], vocab_size: int,
                   device: torch.device | str, invariant: bool = False) -> SamplingBatch:
        """The row tensors of `build`, without positions."""
        all_greedy = all(p.greedy for p in params)
        top_ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        flags = dict(size=len(params), all_greedy=all_greedy, any_top_k=min(top_ks, default=vocab_size) < vocab_size,
                     any_top_p=any(p.top_p < 1.0 for p in params), any_min_p=any(p.min_p > 0.0 for p in params),
                     any_processed=not all_greedy and any(p.logprobs_mode == "processed" for p in params),
                     any_unseeded=not all_greedy and any(s is None for s in seeds),
                     num_top_logprobs=max((p.logprobs for p in params), default=0), invariant=invariant)
        if all_greedy:  # the common RL-eval case needs no per-row tensors at all
            return cls(None, None, None, None, None, None, None, None, None, **flags)
        tensors = _to_device(torch.device(device), [
            (array("b", [p.greedy for p in params]), torch.bool),
            (array("f", [1.0 if p.greedy else min(1.0 / p.temperature, MAX_INV_TEMP) for p in params]), torch.float32),
            (array("i", top_ks), torch.int32),
            (array("f", [p.top_p for p in params]), torch.float32),
            (array("f", [math.log(p.min_p) if p.min_p > 0 else -math.inf for p in params]), torch.float32),
            (array("b", [p.logprobs_mode == "processed" for p in params]), torch.bool),
            (array("q", [s or 0 for s in seeds]), torch.int64),
            (array("b", [s is None for s in seeds]), torch.bool)])
        return cls(*tensors, None, **flags)

    def at(self, positions: torch.Tensor) -> SamplingBatch:
        """These rows at output positions [B] int64 (on the device)."""
        return dataclasses.replace(self, positions=positions)

    def head(self, n: int) -> SamplingBatch:
        """The first n rows (views)."""
        cut = {f.name: getattr(self, f.name)[:n] for f in dataclasses.fields(self)
               if isinstance(getattr(self, f.name), torch.Tensor)}
        return dataclasses.replace(self, size=n, **cut)

    @property
    def row_seeds(self) -> list[tuple[int, int] | None]:
        """(noise seed, position) per row, None on greedy rows: read back from the device (tests, logs)."""
        if self.all_greedy:
            return [None] * self.size
        assert self.greedy is not None and self.seeds is not None and self.positions is not None
        return [None if g else (s, p) for g, s, p in zip(self.greedy.tolist(), self.seeds.tolist(),
                                                         self.positions.tolist())]


def _to_device(device: torch.device, columns: list[tuple[array, torch.dtype]]) -> list[torch.Tensor]:
    """Host arrays to device tensors of the given dtypes through one copy (segments 8-byte aligned)."""
    blob = bytearray()
    spans = []
    for values, _ in columns:
        start = len(blob)
        blob += values.tobytes()
        spans.append((start, len(blob)))
        blob += bytes(-len(blob) % 8)
    host = torch.frombuffer(blob, dtype=torch.uint8)
    # pinned: a pageable source may make the copy wait for the step in flight (async scheduling)
    dev = host.clone() if device.type == "cpu" else host.pin_memory().to(device, non_blocking=True)
    return [dev[a:b].view(dtype) for (a, b), (_, dtype) in zip(spans, columns)]
