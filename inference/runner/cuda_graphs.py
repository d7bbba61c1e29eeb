"""The decode step's CUDA graphs: the model's forward (CUDAGraphRunner) and the sampler's that
replay after it over its static logits (GreedyGraphs, SamplingGraphs). Lifecycle: capture, can_use,
pad, replay, destroy; the runner keeps an eager path for every step no graph fits.

Decode steps (one new token per sequence) replay a graph captured for the smallest ladder size that
holds the batch; the rows beyond the batch are padding: slot -1 (their k/v are not stored), context
length 0 and block table zeros, so they attend to nothing and touch no real cache entry. The model's
graph covers the forward up to the final norm and the LM head, whose logits land in one static buffer.
Inputs live in static buffers that every replay reads; the KV cache and the weights are read at the
addresses captured, which is why they live in arenas whose addresses survive sleep and wake. Every
ladder is captured largest first into one pool of its own by `capture_ladder`, which also keeps
cuBLAS's workspace of the captured GEMMs inside that pool (see there).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import operator
import time
from collections.abc import Callable
from typing import TypeVar

import torch

from inference.batch import AttentionMetadata
from inference.core import SamplingParams
from inference.runner.pending_tokens import resolve_pending
from inference.sample.batch import SamplingBatch
from inference.sample.sampler import greedy_rows, sample_pairs

log = logging.getLogger(__name__)
T = TypeVar("T")


def capture_ladder(sizes: list[int], device: torch.device, warm_up: Callable[[int], object],
                   record: Callable[[int], T]) -> tuple[object, dict[int, torch.cuda.CUDAGraph], dict[int, T]]:
    """Capture record(bs) for every size, largest first, into one new pool: (pool, graphs, what record
    returned), after warm_up(bs) ran eagerly (Triton compiles, cuBLAS picks its kernels).

    The warm-ups run on one side stream and the captures on another that never runs anything eagerly.
    That matters for cuBLAS: torch keeps its GEMM workspace per (handle, stream), made on the stream's
    first GEMM, and anyone in the process may free it: torch.compile's CUDA graph trees clear every
    workspace before each warm-up and recording (transformers' static-cache generate, a compiled reward
    model or trainer beside the engine). Had the captures run on the warm-up stream, the graphs would
    hold a workspace from the common pool and, once it is freed, write into memory given to other
    tensors or unmapped (seen on the H200: an illegal address at the first batch-128 replay after
    transformers' compiled generate). On the capture-only stream the first captured GEMM allocates the
    workspace inside `pool`: a clear hands it back to that pool, which stays mapped while its graphs
    live and serves no other allocation. No one else's workspace is touched. The capture stream is one
    of our own (`new_capture_stream`), not one from torch's pool, which any code may have run GEMMs on."""
    gc.collect()  # another engine's graphs, freed by the collector mid-capture, would void the capture
    pool = torch.cuda.graph_pool_handle()
    current = torch.cuda.current_stream(device)
    warm, capture = torch.cuda.Stream(device), new_capture_stream(device)
    warm.wait_stream(current)
    graphs: dict[int, torch.cuda.CUDAGraph] = {}
    outputs: dict[int, T] = {}
    collecting = gc.isenabled()
    gc.disable()  # nor may the collector destroy one (cudaGraphExecDestroy) while this thread captures
    try:
        for bs in sorted(sizes, reverse=True):
            with torch.cuda.stream(warm):
                warm_up(bs)
            capture.wait_stream(warm)
            graph = torch.cuda.CUDAGraph()
            # thread_local: another thread of the process (a rank's pipe, a hasher) may free memory meanwhile
            with torch.cuda.graph(graph, pool=pool, stream=capture, capture_error_mode="thread_local"):
                outputs[bs] = record(bs)
            graphs[bs] = graph
            warm.wait_stream(capture)
    finally:
        if collecting:
            gc.enable()
    current.wait_stream(warm)
    torch.cuda.synchronize(device)
    return pool, graphs, outputs


_CAPTURE_STREAMS: list[torch.cuda.Stream] = []  # held for the process's life: see new_capture_stream


def new_capture_stream(device: torch.device) -> torch.cuda.Stream:
    """A stream that has never run anything, created outside torch's stream pool and never destroyed.

    torch hands its pooled streams out round robin (32 per priority and device), so a "fresh"
    `torch.cuda.Stream()` may be one on which some earlier code (a warm-up, a trainer, a test) ran a
    GEMM: its cuBLAS workspace would then come from the common pool, and captures would use it. A
    stream of our own has no workspace until the first captured GEMM, and since its handle is never
    freed, no later stream can reuse the (handle, stream) key its workspace is filed under. Falls back
    to a pooled stream, with a warning, should the stream not be created."""
    try:
        from inference.memory.vmm import load_driver

        drv = load_driver()
        with torch.cuda.device(device):
            torch.cuda.synchronize()  # a runtime call: the primary context is now current on this thread
            err, handle = drv.cuStreamCreate(drv.CUstream_flags.CU_STREAM_NON_BLOCKING)
        if int(err) != 0:
            raise RuntimeError(f"cuStreamCreate failed: CUresult {int(err)}")
        stream: torch.cuda.Stream = torch.cuda.ExternalStream(int(handle), device=device)
    except Exception as e:  # missing bindings or a driver refusal: the pooled stream still mostly works
        log.warning("CUDA graphs: no stream of our own for captures (%s); using one of torch's pooled "
                    "streams, whose cuBLAS workspace another library may free", e)
        return torch.cuda.Stream(device)
    _CAPTURE_STREAMS.append(stream)
    return stream


class DecodeInputs:
    """The static inputs of decode graphs of up to `capacity` rows, and their host staging.

    For a graph of bs rows, one int64 buffer holds input ids, positions, slots and then the int32
    context lengths (two per word), each part starting at a multiple of s = bs rounded up to even
    (16-byte aligned, as Triton's fast specializations want): one contiguous prefix, so a step sends
    its row inputs with a single copy. Padding rows (n..bs) get slot -1 and context length 0.

    Block tables live in a [capacity, max_blocks] int32 buffer shared by every size. A sequence's
    table only grows by append while it is the same list object (BlockManager assigns a new list
    when it allocates or frees), so (list identity, length) per row tells whether the device row is
    current; `stage` re-sends only the rows between the first and the last changed one, and only the
    new entries of a grown row are written to the host mirror. Entries past a row's length may be
    stale: attention reads only the blocks of its context length.

    The host buffers are reused: a staged copy must have run before the next `stage` writes them
    (the guard event). Synchronous steps wait for their sampled tokens after every replay, so the event
    is complete when `stage` checks it; with async scheduling the copy of step i sits behind step i - 1,
    which the engine has read back before it stages step i + 1, so the wait is short or none.

    Input ids may be placeholders (async scheduling: tokens the previous step samples on the device);
    `stage` replaces them on the device from that step's sampled pairs after the copy
    (inference/runner/pending_tokens.py), in stream order before the replay reads them.
    """

    def __init__(self, capacity: int, max_blocks: int, device: torch.device | str) -> None:
        self.capacity = capacity
        self.max_blocks = max_blocks
        self.device = torch.device(device)
        words = self.num_words(capacity)
        pin = self.device.type == "cuda"
        self.rows = torch.zeros(words, dtype=torch.int64, device=self.device)
        self.tables = torch.zeros(capacity, max_blocks, dtype=torch.int32, device=self.device)
        self._host_rows = torch.zeros(words, dtype=torch.int64, pin_memory=pin)
        self._host_tables = torch.zeros(capacity, max_blocks, dtype=torch.int32, pin_memory=pin)
        self._np_rows = self._host_rows.numpy()
        self._np_tables = self._host_tables.numpy()
        self._copied = torch.cuda.Event() if pin else None
        self._table_objs: list[list[int]] = []  # per row: the list last sent (held, so ids never recycle)
        self._table_lens: list[int] = []

    @staticmethod
    def num_words(bs: int) -> int:
        return 3 * (bs + bs % 2) + (bs + 1) // 2

    def views(self, bs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(input_ids, positions, slots, context_lens, block_tables) of the graph of bs rows."""
        r, s = self.rows, bs + bs % 2
        context_lens = r[3 * s: self.num_words(bs)].view(torch.int32)[:bs]
        return r[:bs], r[s: s + bs], r[2 * s: 2 * s + bs], context_lens, self.tables[:bs]

    def stage(self, bs: int, input_ids: list[int], positions: list[int], slots: list[int],
              context_lens: list[int], tables: list[list[int]], pending: torch.Tensor | None = None) -> None:
        """Send n <= bs rows from host lists; rows n..bs become padding. Negative input ids are
        placeholders for tokens of `pending`, the previous step's sampled pairs [m, 2] float64."""
        n = len(input_ids)
        assert n <= bs <= self.capacity and len(tables) == n, (n, bs, self.capacity)
        if self._copied is not None:
            self._copied.synchronize()
        rows, s = self._np_rows, bs + bs % 2
        rows[:n] = input_ids
        rows[s: s + n] = positions
        rows[2 * s: 2 * s + n] = slots
        ctx = rows[3 * s: self.num_words(bs)].view("int32")
        ctx[:n] = context_lens
        if n < bs:
            rows[n:bs] = 0
            rows[s + n: s + bs] = 0
            rows[2 * s + n: 2 * s + bs] = -1
            ctx[n:bs] = 0
        words = self.num_words(bs)
        self.rows[:words].copy_(self._host_rows[:words], non_blocking=True)
        if n and min(input_ids) < 0:
            assert pending is not None, "placeholder input ids without the previous step's sampled tokens"
            resolve_pending(self.rows[:n], pending)
        self._stage_tables(tables)
        if self._copied is not None:
            self._copied.record(torch.cuda.current_stream(self.device))

    def _stage_tables(self, tables: list[list[int]]) -> None:
        n = len(tables)
        lens = list(map(len, tables))
        objs = self._table_objs
        if n <= len(objs) and lens == self._table_lens[:n] and all(map(operator.is_, tables, objs)):
            return
        assert max(lens, default=0) <= self.max_blocks, (max(lens), self.max_blocks)
        first = last = -1
        for i, table in enumerate(tables):
            if i < len(objs) and objs[i] is table:
                if lens[i] == self._table_lens[i]:
                    continue
                start = self._table_lens[i]
            else:
                start = 0
            self._np_tables[i, start:lens[i]] = table[start:]
            first = i if first < 0 else first
            last = i
        if first >= 0:
            self.tables[first: last + 1].copy_(self._host_tables[first: last + 1], non_blocking=True)
        # rows past n keep their device contents; a later step that brings them back compares again
        self._table_objs = list(tables) + objs[n:]
        self._table_lens = lens + self._table_lens[n:]

    def write(self, bs: int, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
              context_lens: torch.Tensor, block_tables: torch.Tensor) -> None:
        """Copy n <= bs rows from tensors (on the device or pinned); rows n..bs become padding."""
        n = input_ids.shape[0]
        ids_v, pos_v, slots_v, ctx_v, tables_v = self.views(bs)
        ids_v[:n].copy_(input_ids, non_blocking=True)
        pos_v[:n].copy_(positions, non_blocking=True)
        slots_v[:n].copy_(slots, non_blocking=True)
        ctx_v[:n].copy_(context_lens, non_blocking=True)
        tables_v[:n, :block_tables.shape[1]].copy_(block_tables, non_blocking=True)
        self.forget_tables()
        if n < bs:  # padding rows: store nothing, attend to nothing, and embed token 0: their words
            # may hold another size's slots or positions, which are no token ids
            ids_v[n:bs].zero_()
            pos_v[n:bs].zero_()
            slots_v[n:bs].fill_(-1)
            ctx_v[n:bs].zero_()

    def reset(self, bs: int) -> None:
        """Every row of the graph of bs rows a padding row (capture runs the model over them)."""
        ids, positions, slots, context_lens, _ = self.views(bs)
        ids.zero_()
        positions.zero_()
        slots.fill_(-1)
        context_lens.zero_()

    def forget_tables(self) -> None:
        """The device tables were written elsewhere: the next `stage` sends every row."""
        self._table_objs = []
        self._table_lens = []


def batch_ladder(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to 256, every 32 up to 512, every 64 up to 1024 (the step is an
    eighth of the power of two at or below the size, at least 16), and max_batch itself.

    Capture time grows with the number of sizes, so above 256 the ladder gets coarser with the
    batch while a replay's padding stays under an eighth of its rows: 36 sizes reach 1024 (every
    16 would take 68). The sizes below max_batch do not depend on max_batch (extended_ladder
    relies on it).
    """
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch]
    b = 16
    while b < max_batch:
        sizes.append(b)
        b += max(16, (1 << (b.bit_length() - 1)) // 8)
    return sorted({*sizes, max_batch})


def extended_ladder(max_batch: int, max_rows: int) -> list[int]:
    """batch_ladder(max_batch) plus the sizes up to max_rows (speculative decoding's expanded-row
    batches). Every size of batch_ladder(max_batch) stays, so a plain decode replays the same graph."""
    return sorted({*batch_ladder(max_batch), *batch_ladder(max(max_rows, max_batch))})


class CUDAGraphRunner:
    """Decode graphs of one model over the KV cache bound to it (the target's, or the draft's).

    `sizes` overrides the ladder (speculative decoding captures extended_ladder); a row of a replay
    is one token with its own position, slot, context length and block table row. `logits_max`: sizes
    above the smallest one holding that many rows capture the forward without the LM head, and replay
    the hidden states (a draft following a full batch's plain step writes its KV and needs no logits);
    0: no size does; None: every size does. `rows_per_seq`: the most rows of one sequence a replay holds
    (AttentionMetadata.rows_per_seq: 1 for plain decode, k + 1 for spec-decode verify; 0: the backend's).
    """

    def __init__(self, model: torch.nn.Module, max_batch: int, max_blocks_per_seq: int, block_size: int,
                 device: torch.device, dtype: torch.dtype, sizes: list[int] | None = None,
                 logits_max: int | None = None, rows_per_seq: int = 0) -> None:
        self.model = model
        self.rows_per_seq = rows_per_seq
        self.block_size = block_size
        self.max_blocks = max_blocks_per_seq
        self.device = device
        self.sizes = sorted(set(sizes)) if sizes else batch_ladder(max_batch)
        n = self.sizes[-1]
        # the largest size that computes logits
        self.logits_top = (n if logits_max is None or logits_max >= n
                           else 0 if logits_max == 0 else self.size_for(logits_max))
        self.inputs = DecodeInputs(n, max_blocks_per_seq, device)
        self.cu_query_lens = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.logits = torch.empty(self.logits_top, model.config.vocab_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None
        self.capture_seconds = 0.0

    def _meta(self, bs: int) -> AttentionMetadata:
        _, _, slots, context_lens, tables = self.inputs.views(bs)
        return AttentionMetadata(
            query_lens=[1] * bs, context_lens_host=[1] * bs, cu_query_lens=self.cu_query_lens[: bs + 1],
            context_lens=context_lens, slot_mapping=slots, block_tables=tables, block_size=self.block_size,
            max_query_len=1, max_context_len=self.max_blocks * self.block_size, is_decode=True,
            rows_per_seq=self.rows_per_seq)

    def _forward(self, bs: int) -> torch.Tensor:
        input_ids, positions = self.inputs.views(bs)[:2]
        hidden = self.model(input_ids, positions, self._meta(bs))
        if bs > self.logits_top:
            return hidden
        return self.model.compute_logits(hidden, out=self.logits[:bs])

    def _warm_up(self, bs: int) -> None:
        self.inputs.reset(bs)
        for _ in range(2):
            self._forward(bs)

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        self.pool, self.graphs, self.outputs = capture_ladder(self.sizes, self.device, self._warm_up, self._forward)
        self.capture_seconds = time.perf_counter() - start
        log.info("captured %d decode graphs (batch %d..%d) in %.2f s", len(self.graphs), self.sizes[0],
                 self.sizes[-1], self.capture_seconds)

    def can_use(self, num_seqs: int, max_blocks: int, logits: bool = True) -> bool:
        """Whether a replay holds num_seqs rows of max_blocks-wide tables (with logits: and gives them)."""
        top = self.logits_top if logits else self.sizes[-1]
        return bool(self.graphs) and num_seqs <= top and max_blocks <= self.max_blocks

    def size_for(self, num_seqs: int) -> int:
        """The captured batch size that replays num_seqs rows."""
        return next(b for b in self.sizes if b >= num_seqs)

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
               context_lens: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
        """Logits [n, vocab] of one decode step of n sequences (inputs on the device or pinned); hidden
        states [n, hidden] from a size above logits_top."""
        n = input_ids.shape[0]
        bs = self.size_for(n)
        self.inputs.write(bs, input_ids, positions, slots, context_lens, block_tables)
        self.graphs[bs].replay()
        return self.outputs[bs][:n]

    def replay_staged(self, input_ids: list[int], positions: list[int], slots: list[int],
                      context_lens: list[int], tables: list[list[int]],
                      pending: torch.Tensor | None = None) -> torch.Tensor:
        """`replay` from host lists: one copy of the row inputs, block-table rows only when they changed.
        Negative input ids are placeholders for tokens of `pending` (see DecodeInputs.stage)."""
        n = len(input_ids)
        bs = self.size_for(n)
        self.inputs.stage(bs, input_ids, positions, slots, context_lens, tables, pending)
        self.graphs[bs].replay()
        return self.outputs[bs][:n]

    def destroy(self) -> None:
        self.graphs.clear()
        self.outputs.clear()
        self.pool = None


class GreedyGraphs:
    """Per decode graph size, a graph of `greedy_rows` over that graph's logits: an all-greedy step
    without top logprobs samples with one replay instead of a dozen launches. Rows past the batch
    are the decode graph's padding; their results are never read. The per-row statistics reduce
    each row alone, so a row's token is the one `sample` picks; its logprob may differ from an
    eager `sample` over n rows in the last float32 bits (the reduction splits a row by batch size), except
    in the batch-invariant mode (`invariant`), where every row is reduced as a lone row is.
    """

    def __init__(self, graphs: CUDAGraphRunner, invariant: bool = False) -> None:
        self.decode = graphs
        self.invariant = invariant
        self.out = torch.empty(graphs.sizes[-1], 2, dtype=torch.float64, device=graphs.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None

    @torch.inference_mode()
    def capture(self) -> None:
        def rows(bs: int) -> None:
            greedy_rows(self.decode.outputs[bs], self.out[:bs], self.invariant)

        def warm_up(bs: int) -> None:  # Triton compiles before capture
            rows(bs)
            rows(bs)

        self.pool, self.graphs, _ = capture_ladder(self.decode.sizes, self.decode.device, warm_up, rows)

    def replay(self, n: int) -> torch.Tensor:
        """(token id, logprob) [n, 2] of the rows of the decode graph replayed last for n rows."""
        self.graphs[self.decode.size_for(n)].replay()
        return self.out[:n]

    def destroy(self) -> None:
        self.graphs.clear()
        self.pool = None


# the per-row tensors a batch brings (positions aside, which change every step)
ROW_FIELDS = ("greedy", "inv_temps", "top_ks", "top_ps", "log_min_ps", "processed_logprobs", "seeds")


class SamplingGraphs:
    """Per decode graph size, a graph of `sample_pairs` over that graph's logits, for decode steps with
    sampled rows (GreedyGraphs does all-greedy ones). A static SamplingBatch holds per-row buffers of
    the largest size with every filter flag set, so that one graph serves any mix of greedy,
    temperature, top-k, top-p, min-p and processed-logprob rows (a row without top-k and top-p costs
    the threshold search nothing; see inference/sample/kernels.py). A step replaces a dozen launches
    and their allocations with one replay, plus copies of the batch's row tensors when its rows
    changed and of its positions every step.

    Rows past the batch are the decode graph's padding: they sample with whatever settings the buffers
    last held (valid ones, at worst a filtered row's search) and their results are never read. A row's
    token is the one the eager `sample_pairs` picks (the thresholds and the race reduce each row alone,
    in a chunking fixed by the vocabulary); a raw logprob may differ in the last float32 bits (the raw
    log-sum-exp splits a row by batch size)."""

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
