"""The model runner: a scheduled batch -> tensors -> model -> sampled tokens.

It owns the model, the KV cache tensor and the sampling generator of one rank. It knows nothing
about requests beyond the Sequence fields it reads (tokens, computed count, block table, params), and
the one it writes: an MoE model's routing rows of the sequences that asked (seq.routing), stored when
the step is read back (inference/runner/routing_capture.py).
`batch_invariant` (EngineConfig.batch_invariant): the sampling batches and graphs it builds reduce each
row alone (SamplingBatch.invariant); the model's layers were built for the mode by the worker.
"""

from __future__ import annotations

import operator
from array import array
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from functools import partial
from typing import Protocol

import numpy as np
import torch

from inference.batch import AttentionMetadata, to_device
from inference.config import ModelConfig
from inference.parallel import TPInfo
from inference.runner.cuda_graphs import CUDAGraphRunner, GreedyGraphs, SamplingGraphs
from inference.runner.inputs import BlockTables, build_step_rows, decode_rows
from inference.runner.pending_tokens import resolve_pending
from inference.runner.routing_capture import RoutingCapture, StepRouting
from inference.sample.batch import SamplingBatch, unseeded_seed
from inference.sample.penalties import apply_penalties, penalized_rows
from inference.sample.sampler import sample, sample_pairs
from inference.sched.scheduler import ScheduledBatch
from inference.sched.sequence import Sequence

SampleResult = tuple[int, float, "dict[int, float] | None"]


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: list[int]  # index into batch.seqs of each sampled row
    last_token_index: torch.Tensor  # [len(sample_rows)] flattened index of each row's last token


class Follower(Protocol):
    """A second model whose KV cache follows the runner's tokens in a launched step (the draft under
    async scheduling, inference/speculative/decoder.py): it computes the KV of every token the step computes,
    from the same resolved input ids, and nothing else."""

    def follow(self, inp: StepInputs) -> None: ...

    def graphs_fit(self, num_rows: int, max_blocks: int) -> bool: ...

    def follow_rows(self, rows: tuple[torch.Tensor, ...]) -> None: ...


class ModelRunner:
    def __init__(self, model: torch.nn.Module, model_config: ModelConfig, tp: TPInfo,
                 device: torch.device, dtype: torch.dtype, seed: int = 0, batch_invariant: bool = False,
                 max_step_tokens: int = 8192) -> None:
        """max_step_tokens: the most tokens one eager forward computes (the scheduler's budget); an MoE
        model's routing buffer holds that many rows (and the largest graph's, once captured)."""
        self.model = model
        self.batch_invariant = batch_invariant
        self.model_config = model_config
        self.tp = tp
        self.device = device
        self.dtype = dtype
        self.seed = seed  # the noise seeds of unseeded rows derive from it (unseeded_seed)
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.kv_cache: torch.Tensor | None = None
        self.block_size = 0
        self.graphs: CUDAGraphRunner | None = None  # set by capture_graphs
        # rows -> steps that ran the eager forward although decode graphs exist (a prefill chunk in the
        # batch, a size or table width past the graphs'): benchmarks read it (scripts/bench/rollout.py eager_by_batch)
        self.eager_steps: Counter[int] = Counter()
        self.verify_graphs: CUDAGraphRunner | None = None  # spec-decode verify rows (capture_graphs)
        self.greedy_graphs: GreedyGraphs | None = None
        self.sampling_graphs: SamplingGraphs | None = None
        self._tables = BlockTables()  # eager steps' block tables (the decode graphs stage their own)
        self._sb_seqs: list[Sequence] = []  # the cached SamplingBatch's rows
        self._sb_builds = 0  # lists of sampling rows built so far: the unseeded rows' seeds count them
        self._sb_rows: SamplingBatch | None = None  # their row tensors
        self._sb_positions: array | None = None  # the output positions of the last batch built on them
        self._sb: SamplingBatch | None = None  # that batch
        self._sb_penalized: list[int] = []  # its rows with a penalty (inference/sample/penalties.py)
        # async scheduling: the sampled pairs of the step launched last, where the next step's
        # placeholder input ids are read on the device (inference/runner/pending_tokens.py)
        self._pending_pairs: torch.Tensor | None = None
        self._follow: Callable[[], None] | None = None  # a Follower's part of the step being launched
        self.routing = (RoutingCapture(model, model_config, max_step_tokens, device)
                        if model_config.num_moe_layers else None)

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
    def prepare(self, batch: ScheduledBatch, pending: torch.Tensor | None = None) -> StepInputs:
        """Eager-path inputs: ids, positions, slots and last-token indices travel in one int64 copy,
        the attention metadata's int32 parts in another. Placeholder ids (async scheduling) are
        replaced on the device with the tokens of `pending`, the previous step's sampled pairs."""
        rows, table_rows = build_step_rows(batch, self.block_size, self._tables)
        t = len(rows.ids)
        packed = np.empty(3 * t + len(rows.sample_rows), dtype=np.int64)
        packed[:t] = rows.ids
        packed[t: 2 * t] = rows.positions
        packed[2 * t: 3 * t] = rows.slots
        packed[3 * t:] = rows.last_index
        dev = to_device(torch.from_numpy(packed), self.device)
        if min(rows.ids) < 0:
            assert pending is not None, "placeholder input ids without the previous step's sampled tokens"
            resolve_pending(dev[:t], pending)
        meta = AttentionMetadata.from_table_rows(rows.query_lens, rows.context_lens, dev[2 * t: 3 * t], table_rows,
                                                 self.block_size, self.device)
        return StepInputs(input_ids=dev[:t], positions=dev[t: 2 * t], meta=meta, sample_rows=rows.sample_rows,
                          last_token_index=dev[3 * t:])

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> list[SampleResult | None]:
        """Run one step; returns per scheduled sequence its sampled result, or None (mid-prefill)."""
        sampled, sample_rows, seqs, routing = self._run(batch, None)
        results = (_by_row(len(batch.seqs), sample_rows, self._to_host(sampled, seqs)) if sampled is not None
                   else [None] * len(batch.seqs))
        if routing is not None:
            routing.store()
        return results

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, follower: Follower | None = None) -> InFlightStep:
        """Launch one step and return without waiting for the device (async scheduling).

        Placeholder input ids are read on the device from the sampled pairs of the step launched
        before this one (the caller resolved the older ones). The step's results are copied to host
        memory behind its sampling, before the next step can overwrite a sampling graph's output;
        `InFlightStep.results()` then waits for this step alone. A `follower` (the draft) computes the
        step's tokens' KV after that copy is queued, so reading the results back never waits for it."""
        sampled, sample_rows, seqs, routing = self._run(batch, self._pending_pairs, follower)
        self._pending_pairs = sampled.pairs if sampled is not None else None
        host, ready = _copy_to_host(sampled) if sampled is not None else (None, None)
        follow, self._follow = self._follow, None
        if follow is not None:
            follow()
        return InFlightStep(len(batch.seqs), sample_rows, seqs, host, ready, self.collect, routing)

    def collect(self, step: InFlightStep) -> list[SampleResult | None]:
        """Per scheduled sequence of a launched step, its sampled result or None: the step's one
        host sync (it waits for that step's copy only); the routing rows it recorded are stored."""
        if step.routing is not None:
            step.routing.store()
        if step.sampled is None:
            return [None] * step.num_rows
        if step.ready is not None:
            step.ready.synchronize()
        return _by_row(step.num_rows, step.sample_rows, self._to_host(step.sampled, step.seqs))

    def _run(self, batch: ScheduledBatch, pending: torch.Tensor | None, follower: Follower | None = None
             ) -> tuple[_Sampled | None, list[int], list[Sequence], StepRouting | None]:
        """Launch a step's forward and sampling: (the sampled pairs on the device, None when no row
        samples; the batch rows that sample; their sequences; the routing rows of the sequences that
        asked, queued to the host). `pending`: see `prepare`. A follower's part is left in self._follow
        (launch runs it), its inputs resolved now, while `pending` holds."""
        assert self.kv_cache is not None, "bind_kv_cache first"
        logits = self._graph_decode(batch, pending, follower) if self.graphs is not None else None
        graphed = logits is not None
        if logits is not None:
            sample_rows = list(range(len(batch.seqs)))
            seqs = batch.seqs
        else:
            if self.graphs is not None:
                self.eager_steps[len(batch.seqs)] += 1
            inp = self.prepare(batch, pending)
            if follower is not None:
                self._follow = partial(follower.follow, inp)
            sample_rows = inp.sample_rows
            if not sample_rows:
                self.model(inp.input_ids, inp.positions, inp.meta)
                return None, [], [], self._routing(batch)
            logits = self._forward(inp)
            seqs = batch.seqs if len(sample_rows) == len(batch.seqs) else [batch.seqs[r] for r in sample_rows]
        routing = self._routing(batch)
        sb = self._sampling_batch(seqs)
        if self._sb_penalized:  # rows with a penalty: their logits change in place (graph buffer included)
            resolve = None if pending is None else partial(resolve_pending, pairs=pending)
            apply_penalties(logits, self._sb_penalized, seqs, resolve)
        return self._sample(logits, sb, graphed), sample_rows, seqs, routing

    def _routing(self, batch: ScheduledBatch) -> StepRouting | None:
        return self.step_routing(batch.seqs, batch.num_new_tokens)

    def step_routing(self, seqs: list[Sequence], counts: list[int]) -> StepRouting | None:
        """The routing rows of the target forward just launched over seqs (counts[i] rows each, in
        order), for the sequences that asked: RoutingCapture.step; None for a dense model."""
        if self.routing is None or not any(map(_ROUTING, seqs)):
            return None
        return self.routing.step(seqs, counts)

    def _forward(self, inp: StepInputs) -> torch.Tensor:
        hidden = self.model(inp.input_ids, inp.positions, inp.meta).index_select(0, inp.last_token_index)
        return self.model.compute_logits(hidden)

    def sampling_state(self) -> tuple[int, torch.Tensor]:
        """What the noise of later unseeded rows depends on: the count of row lists built, the generator."""
        return self._sb_builds, self.generator.get_state()

    def restore_sampling_state(self, state: tuple[int, torch.Tensor]) -> None:
        """Back to `sampling_state()`'s moment (a warm-up's steps leave no trace): later rows draw the
        noise they would have drawn; the cached rows and the eager-step counts are dropped."""
        self._sb_builds, generator = state
        self.generator.set_state(generator)
        self._sb_seqs, self._sb_rows, self._sb, self._sb_positions = [], None, None, None
        self.eager_steps = Counter()

    def _sampling_batch(self, seqs: list[Sequence]) -> SamplingBatch:
        """The step's SamplingBatch. Its row tensors (params and noise seeds: a seeded sequence's own,
        `unseeded_seed` of this list of rows for the others) are built only when other sequences, or
        the same in another order, sample; a step of the same rows sends just their output positions
        (one small copy, no per-row Python), and unchanged positions give back the same batch. An
        all-greedy batch needs no positions."""
        if seqs != self._sb_seqs or self._sb_rows is None:  # Sequence compares by identity
            seeds = [unseeded_seed(self.seed, self._sb_builds, row) if s.seed is None else s.seed
                     for row, s in enumerate(seqs)]
            self._sb_builds += 1
            self._sb_rows = SamplingBatch.build_rows([s.params for s in seqs], seeds, self.model_config.vocab_size,
                                                     self.device, self.batch_invariant)
            self._sb_seqs, self._sb, self._sb_positions = list(seqs), None, None
            self._sb_penalized = penalized_rows(seqs)
        if self._sb_rows.all_greedy:
            return self._sb_rows
        positions = array("q", map(operator.sub, map(len, map(_TOKEN_IDS, seqs)), map(_NUM_PROMPT, seqs)))
        if positions != self._sb_positions or self._sb is None:
            # queued without waiting for the step in flight (to_device)
            self._sb = self._sb_rows.at(to_device(torch.frombuffer(positions, dtype=torch.int64), self.device))
            self._sb_positions = positions
        return self._sb

    def _sample(self, logits: torch.Tensor, sb: SamplingBatch, graphed: bool) -> _Sampled:
        """Launch the sampling of the step (no host sync): pairs [n, 2] float64 of (token id, logprob).
        Without top logprobs a decode step replays a sampling graph (the greedy one when every row is)."""
        n = logits.shape[0]
        if sb.num_top_logprobs == 0:
            if graphed and sb.all_greedy and self.greedy_graphs is not None:
                return _Sampled(self.greedy_graphs.replay(n), None, None)
            if graphed and not sb.all_greedy and not sb.any_unseeded and self.sampling_graphs is not None:
                return _Sampled(self.sampling_graphs.replay(n, sb), None, None)
            pairs = torch.empty(n, 2, dtype=torch.float64, device=logits.device)
            return _Sampled(sample_pairs(logits, sb, pairs, self.generator), None, None)
        out = sample(logits, sb, self.generator)
        return _Sampled(torch.stack((out.token_ids.double(), out.logprobs.double()), dim=1), out.top_ids,
                        out.top_logprobs)

    @staticmethod
    def _to_host(sampled: _Sampled, seqs: list[Sequence]) -> list[SampleResult]:
        """The step's one host sync: tokens and their logprobs together."""
        pairs = sampled.pairs.tolist()
        if sampled.top_ids is None:
            return [(int(tok), lp, None) for tok, lp in pairs]
        tops = top_dicts(sampled.top_ids, sampled.top_logprobs, [s.params.logprobs for s in seqs])
        return [(int(tok), lp, top) for (tok, lp), top in zip(pairs, tops)]

    # ---- CUDA graphs ----------------------------------------------------------------------
    def capture_graphs(self, max_batch: int, max_model_len: int, verify_rows: int = 0,
                       verify_rows_per_seq: int = 0) -> None:
        """Decode graphs for batch_ladder(max_batch), one row per sequence, and per size a greedy and a
        sampling graph over their logits. With speculative decoding (verify_rows > 0) also the verify
        graphs: batch_ladder(verify_rows) of expanded rows, at most verify_rows_per_seq (k + 1) of one
        sequence (inference/speculative/decoder.py). Apart, so a plain step's attention compiles the multi-row
        check out and a verify's takes more KV splits (inference/layers/triton_attention.py)."""
        max_blocks = -(-max_model_len // self.block_size)
        if self.routing is not None:  # the graphs write their rows (padding rows too) into it
            self.routing.reserve(max(max_batch, verify_rows))
            self.routing.freeze()
        self.graphs = CUDAGraphRunner(self.model, max_batch, max_blocks, self.block_size, self.device, self.dtype,
                                      rows_per_seq=1)
        self.graphs.capture()
        if verify_rows:
            self.verify_graphs = CUDAGraphRunner(self.model, verify_rows, max_blocks, self.block_size, self.device,
                                                 self.dtype, rows_per_seq=verify_rows_per_seq)
            self.verify_graphs.capture()
        self.greedy_graphs = GreedyGraphs(self.graphs, self.batch_invariant)
        self.greedy_graphs.capture()
        # compile the placeholder kernel now rather than in the first async step (the ids of a
        # padding row are 0: nothing is written)
        resolve_pending(self.graphs.inputs.views(1)[0], self.greedy_graphs.out[:1])
        self.sampling_graphs = SamplingGraphs(self.graphs, self.model_config.vocab_size, self.batch_invariant)
        self.sampling_graphs.capture()

    def _graph_decode(self, batch: ScheduledBatch, pending: torch.Tensor | None = None,
                      follower: Follower | None = None) -> torch.Tensor | None:
        """Logits of a decode-only step replayed from a graph, or None when no graph fits. `pending`:
        see `prepare`. A follower replays its own graph from this graph's staged (resolved) rows,
        which stay put until the next step stages; without a graph of its size, its eager inputs
        are prepared now, while `pending` still holds the previous step's tokens."""
        assert self.graphs is not None
        seqs = batch.seqs
        # every n is >= 1, so the sum equals the row count only when each row computes one token
        if batch.num_tokens != len(seqs) or not all(batch.sample):
            return None
        rows = decode_rows(seqs, self.block_size)
        n, max_blocks = len(seqs), max(map(len, rows.tables))
        if not self.graphs.can_use(n, max_blocks):
            return None
        logits = self.graphs.replay_staged(rows.ids, rows.positions, rows.slots, rows.context_lens, rows.tables,
                                           pending)
        if follower is not None and follower.graphs_fit(n, max_blocks):
            views = self.graphs.inputs.views(self.graphs.size_for(n))
            self._follow = partial(follower.follow_rows, tuple(v[:n] for v in views))
        elif follower is not None:
            self._follow = partial(follower.follow, self.prepare(batch, pending))
        return logits


@dataclass
class _Sampled:
    pairs: torch.Tensor  # [n, 2] float64 on the device: token id (exact in float64) and its logprob
    top_ids: torch.Tensor | None
    top_logprobs: torch.Tensor | None


@dataclass
class InFlightStep:
    """A launched step whose results the host has not read yet (async scheduling)."""

    num_rows: int
    sample_rows: list[int]  # the batch rows that sample
    seqs: list[Sequence]  # their sequences
    sampled: _Sampled | None  # host copies of the sampled tensors, complete once `ready` is; None: none sampled
    ready: torch.cuda.Event | None  # recorded after the copies (CUDA); None: already complete
    collect: Callable[[InFlightStep], list[SampleResult | None]]  # ModelRunner.collect
    routing: StepRouting | None = None  # the routing rows of its sequences that asked (MoE models)

    def results(self) -> list[SampleResult | None]:
        """Per scheduled sequence its sampled result or None; waits for this step's copy only."""
        return self.collect(self)


def _by_row(num_rows: int, sample_rows: list[int], results: list[SampleResult]) -> list[SampleResult | None]:
    """Per row of a step its sampled result, None for the rows that do not sample."""
    if len(sample_rows) == num_rows:  # every row samples (decode steps): the rows in order
        return list(results)
    by_row: list[SampleResult | None] = [None] * num_rows
    for row, res in zip(sample_rows, results):
        by_row[row] = res
    return by_row


def _copy_to_host(sampled: _Sampled) -> tuple[_Sampled, torch.cuda.Event | None]:
    """Every tensor of `sampled` copied to pinned host memory in stream order, without waiting, and an
    event recorded after the copies. On CPU `sampled` as it is (no event): only CUDA has sampling
    graphs, whose static outputs the next step overwrites; the eager sampler's tensors are new."""
    if not sampled.pairs.is_cuda:
        return sampled, None

    def host(value: object) -> object:
        if not isinstance(value, torch.Tensor):
            return value
        return torch.empty(value.shape, dtype=value.dtype, pin_memory=True).copy_(value, non_blocking=True)

    copied = replace(sampled, **{f.name: host(getattr(sampled, f.name)) for f in fields(sampled)})
    ready = torch.cuda.Event()
    ready.record()
    return copied, ready


_TOKEN_IDS = operator.attrgetter("token_ids")
_NUM_PROMPT = operator.attrgetter("num_prompt_tokens")
_ROUTING = operator.attrgetter("routing")


def top_dicts(ids: torch.Tensor | None, lps: torch.Tensor | None, wanted: list[int]) -> list:
    if ids is None or lps is None:
        return [None] * len(wanted)
    ids_l, lps_l = ids.tolist(), lps.tolist()
    return [dict(zip(ids_l[i][:k], lps_l[i][:k])) if k else None for i, k in enumerate(wanted)]
