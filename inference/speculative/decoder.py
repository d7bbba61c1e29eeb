"""Speculative decoding with a draft model: the draft proposes, the target verifies, lossless.

Rows the scheduler gave a lookahead k_r > 0 (decodes only) speculate: the draft proposes k_r tokens,
the target computes the k_r + 1 positions [last token, d_1 .. d_k] as decode rows (replaying its
verify graphs, the attention tiles of a plain decode step), and the accepted run comes back in the
step's one host transfer. Two rules accept: rejection sampling (SpecDecoder; every emitted token is
distributed as target-only sampling, greedy output is identical) and, in the batch-invariant mode,
exact match (ExactSpeculation; the output is the target-only engine's, bit for bit). Rows without
lookahead run through the target's ModelRunner as usual, and the draft mirrors the same chunk.

Invariants: the draft and the target share block ids and tables (one BlockManager); the draft's KV
lives in a tensor of its own shape, bound once. seq.token_ids never holds a proposal. Every uniform
and noise comes from the sampler's counter-based generator (inference/sample/noise.py), so a seeded
completion does not depend on the rest of the batch. Reported logprobs are the target's, and so is the
routing of an MoE target: a run keeps the verify rows of the positions it accepted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from inference.batch import AttentionMetadata, to_device
from inference.runner.cuda_graphs import CUDAGraphRunner, batch_ladder, extended_ladder
from inference.runner.inputs import DecodeRows, decode_logits
from inference.runner.runner import ModelRunner, SampleResult, StepInputs, top_dicts
from inference.sample.batch import SamplingBatch, unseeded_seed
from inference.sample.noise import ACCEPT, DRAFT, RESIDUAL, exponential, race, uniforms
from inference.sample.sampler import process_logits, sample
from inference.sched.scheduler import ScheduledBatch, StepResult
from inference.sched.sequence import Sequence

# expanded-row verify batches up to this many rows replay graphs (when max_num_seqs * (k + 1) exceeds it)
MAX_GRAPH_ROWS = 512
_SALT = 0x5BD1E995  # keeps the exact rule's unseeded seeds apart from the runner's own unseeded rows


@dataclass
class SpecDecodeStats:
    """Engine counters since construction: draft tokens proposed and accepted by the target."""

    proposed: int = 0
    accepted: int = 0
    steps: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


def _check_decode_rows(model: nn.Module, num_speculative_tokens: int) -> None:
    """Refuse a k whose verify rows (k + 1 of one sequence per decode launch) exceed what the model's
    attention backend supports (TritonAttentionTiles.decode_max_rows): past it, a row could read keys
    that another row of the launch has not written yet."""
    for layer in model.attention_layers():
        limit = getattr(getattr(layer.backend, "tiles", None), "decode_max_rows", None)
        if limit is not None and num_speculative_tokens + 1 > limit:
            raise ValueError(f"num_speculative_tokens: {num_speculative_tokens} needs {num_speculative_tokens + 1} "
                             f"decode rows per sequence; the {layer.backend.name} attention backend handles at "
                             f"most {limit} (tiles.decode_max_rows)")


class SpecDecoder:
    """Drives a target ModelRunner and a draft model over one scheduled batch, by rejection sampling.

    1. The draft proposes k_r tokens autoregressively, sampling each from its processed distribution q
       (the target's temperature / top-k / top-p / min-p rules; greedy rows take the argmax). Its first
       pass also fills the draft KV the draft lacks (the token after a fully accepted run).
    2. The target computes p at the k_r + 1 positions (`verify_logits`).
    3. Rejection sampling (Leviathan et al. 2023, Chen et al. 2023): d_i is accepted with probability
       min(1, p(d_i) / q(d_i)); at the first rejection a token is drawn from normalize(max(0, p - q));
       if all k_r are accepted a bonus token is drawn from p. Greedy rows use one-hot p and q: accept
       while d_i == argmax p, then argmax p. An all-greedy step never forms q.
    The draft's one-token steps and its catch-up pass replay the draft's own decode graphs.
    """

    def __init__(self, runner: ModelRunner, draft: nn.Module, num_speculative_tokens: int) -> None:
        assert num_speculative_tokens >= 1
        vocab, draft_vocab = runner.model_config.vocab_size, draft.config.vocab_size
        if vocab != draft_vocab:
            raise ValueError(f"draft_model: vocab size {draft_vocab} differs from the target's {vocab}")
        for model in (runner.model, draft):  # a verify launch holds k + 1 decode rows of one sequence
            _check_decode_rows(model, num_speculative_tokens)
        self.runner = runner
        self.draft = draft
        # the batch-invariant mode's SelfDraft (self_draft.py): the target on the default kernels, over
        # the target's own KV cache (nothing to bind, follow or catch up)
        self.shares_kv = bool(getattr(draft, "shares_target_kv", False))
        self.k = num_speculative_tokens
        self.vocab_size = vocab
        self.block_size = 0
        self.graphs: CUDAGraphRunner | None = None  # the draft's decode graphs (capture_graphs)
        self.follow_graphs: CUDAGraphRunner | None = None  # its one-row graphs without LM head (follows)
        # the batch-invariant mode verifies by exact match, so a draft never changes a token or logprob
        self.exact = ExactSpeculation(self) if runner.batch_invariant else None

    def bind_draft_kv(self, kv: torch.Tensor | None, block_size: int) -> None:
        """The draft's KV cache (None for a draft that shares the target's)."""
        assert (kv is None) == self.shares_kv, "a SelfDraft binds no KV cache; any other draft does"
        if kv is not None:
            self.draft.bind_kv_cache(kv)
        self.block_size = block_size

    def graph_rows(self, max_batch: int) -> int:
        """Rows of the largest decode graph speculation wants: a verify of max_batch rows of k + 1."""
        return min(max_batch * (self.k + 1), max(max_batch, MAX_GRAPH_ROWS))

    def draft_sizes(self, max_batch: int, verify_rows: int, follows_async: bool) -> list[int]:
        """The sizes of the draft's graphs (capture_graphs; with logits up to verify_rows). With async
        scheduling a plain step's draft pass runs on follow_graphs, so only a speculating step's rows
        are needed; synchronous steps also replay sizes up to graph_rows, without LM head, for a plain
        batch's catch-up. A draft sharing the target's KV steps one row per speculating sequence only."""
        if self.shares_kv:
            return batch_ladder(max(1, verify_rows // (self.k + 1)))
        if follows_async:
            return batch_ladder(verify_rows)
        return extended_ladder(max_batch, self.graph_rows(max_batch))

    def verify_rows(self, max_batch: int, spec_max_batch: int) -> int:
        """Rows of the largest verify graph: spec_max_batch sequences (0: no bound) of k + 1 rows."""
        rows = self.graph_rows(max_batch)
        return min(rows, spec_max_batch * (self.k + 1)) if spec_max_batch else rows

    def capture_graphs(self, sizes: list[int], max_model_len: int, logits_max: int | None = None,
                       follow_batch: int = 0) -> None:
        """Capture the draft's decode graphs at `sizes` over its bound KV (bind_draft_kv first). Sizes
        beyond `logits_max` rows (what a speculating step runs: verify_rows) only follow plain steps:
        they are captured without the LM head (a full vocabulary GEMM per step). `follow_batch` > 0: also
        the graphs that follow a plain step (async scheduling) up to that many rows, one row per sequence
        and no LM head, so their attention compiles the multi-row check out (as the target's plain graphs
        do) at every size, not only above logits_max. Without them a follow runs eagerly."""
        assert self.block_size, "bind_draft_kv first"
        max_blocks = -(-max_model_len // self.block_size)
        self.graphs = CUDAGraphRunner(self.draft, max(sizes), max_blocks, self.block_size, self.device,
                                      self.runner.dtype, sizes, logits_max=logits_max)
        self.graphs.capture()
        if follow_batch:
            self.follow_graphs = CUDAGraphRunner(self.draft, follow_batch, max_blocks, self.block_size, self.device,
                                                 self.runner.dtype, logits_max=0, rows_per_seq=1)
            self.follow_graphs.capture()

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def generator(self) -> torch.Generator:
        return self.runner.generator  # one generator per rank: TP ranks draw the same values

    # ---- async scheduling: the draft follows plain steps (runner.Follower) -----------------------
    # A step without draft tokens (a full batch: SchedulerConfig.spec_max_batch) launches as the
    # target's plain step; the draft computes the same tokens' KV behind it, from the same resolved
    # input ids, so its cache stays complete (num_draft_computed advances with the target's) and a
    # later speculative step needs no catch-up.
    def follow(self, inp: StepInputs) -> None:
        self.draft(inp.input_ids, inp.positions, inp.meta)

    def graphs_fit(self, num_rows: int, max_blocks: int) -> bool:
        graphs = self.follow_graphs
        return graphs is not None and graphs.can_use(num_rows, max_blocks, logits=False)

    def follow_rows(self, rows: tuple[torch.Tensor, ...]) -> None:
        """(input_ids, positions, slots, context_lens, block_tables) of a target decode graph's rows."""
        assert self.follow_graphs is not None
        self.follow_graphs.replay(*rows)

    # ---- one step -------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> list[StepResult]:
        """Per row: a SampleResult (plain row that samples), None (mid-prefill), or the accepted run."""
        assert self.block_size, "bind_draft_kv first"
        seqs = batch.seqs
        spec = [i for i, k in enumerate(batch.num_lookahead) if k > 0]
        plain = [i for i, k in enumerate(batch.num_lookahead) if k == 0]
        first_logits = self._draft_first_pass(batch, spec)
        results: list[StepResult] = [None] * len(seqs)
        if plain:
            sub = ScheduledBatch([seqs[i] for i in plain], [batch.num_new_tokens[i] for i in plain])
            for i, res in zip(plain, self.runner.execute(sub)):
                results[i] = res
        if spec:
            spec_seqs, ks = [seqs[i] for i in spec], [batch.num_lookahead[i] for i in spec]
            runs = self._speculate(spec_seqs, ks, first_logits)
            # the verify forward was the target's last: its routing rows are still in the buffer; a run
            # keeps the rows of the positions it accepted (the rest are computed again next step)
            routing = self.runner.step_routing(spec_seqs, [k + 1 for k in ks])
            if routing is not None:
                routing.store([len(run) for run in runs])
            for i, run in zip(spec, runs):
                results[i] = run
        return results

    def _draft_first_pass(self, batch: ScheduledBatch, spec: list[int]) -> torch.Tensor | None:
        """One draft forward over every row: each row's chunk runs from what the draft has computed to
        what the target computes this step (spec rows: through their last token). Returns the draft
        logits at the last token of each spec row. A draft sharing the target's KV runs the spec rows'
        last tokens only: the target computes every other row's KV, and the verify rewrites these."""
        if self.shares_kv:
            if not spec:
                return None
            batch = ScheduledBatch([batch.seqs[i] for i in spec], [1] * len(spec))
            spec = list(range(len(spec)))
        ids: list[int] = []
        chunks: list[tuple[int, int]] = []
        last: list[int] = []
        spec_set = set(spec)
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            start = seq.num_computed_tokens if self.shares_kv else seq.num_draft_computed
            end = seq.num_computed_tokens + n
            assert start <= seq.num_computed_tokens < end <= seq.num_tokens, (seq, start, end)
            ids.extend(seq.token_ids[start:end])
            chunks.append((start, end))
            if i in spec_set:
                last.append(len(ids) - 1)
        if self._graph_fits(batch.seqs, chunks, logits=bool(spec)):
            rows = DecodeRows(self.block_size)
            for seq, (start, end) in zip(batch.seqs, chunks):
                rows.add(seq.block_table, start, end - start)
            logits = decode_logits(self.draft, self.graphs, to_device(ids, self.device), rows, self.device,
                                   logits=bool(spec))  # a plain batch's catch-up writes KV only
            return logits.index_select(0, to_device(last, self.device)) if spec else None
        hidden = self._forward(self.draft, to_device(ids, self.device), [c[0] for c in chunks],
                               [e - s for s, e in chunks], [seq.block_table for seq in batch.seqs])
        if not spec:
            return None
        return self.draft.compute_logits(hidden.index_select(0, to_device(last, self.device)))

    def _graph_fits(self, seqs: list[Sequence], chunks: list[tuple[int, int]], logits: bool) -> bool:
        """Whether the draft's pass over these short chunks replays a graph as expanded rows (with logits:
        one that computes them; the sizes above a speculating step's rows do not)."""
        if self.graphs is None or max(e - s for s, e in chunks) > self.k + 1:
            return False
        return self.graphs.can_use(sum(e - s for s, e in chunks), max(len(s.block_table) for s in seqs), logits)

    def _forward(self, model: nn.Module, ids: torch.Tensor, starts: list[int], lens: list[int],
                 tables: list[list[int]]) -> torch.Tensor:
        """model over rows of `lens` new tokens at positions starts[r]..; KV written through the tables."""
        bs = self.block_size
        positions = [p for s, n in zip(starts, lens) for p in range(s, s + n)]
        slots = [t[p // bs] * bs + p % bs for s, n, t in zip(starts, lens, tables) for p in range(s, s + n)]
        meta = AttentionMetadata.build(lens, [s + n for s, n in zip(starts, lens)], slots, tables, bs, self.device)
        return model(ids, to_device(positions, self.device), meta)

    def _speculate(self, seqs: list[Sequence], ks: list[int], logits: torch.Tensor) -> list[list[SampleResult]]:
        if self.exact is not None:  # the batch-invariant mode: ExactSpeculation
            return self.exact.speculate(seqs, ks, logits)
        drafts, q = self._propose(seqs, ks, logits)
        p_logits = self.verify_logits(seqs, ks, drafts)
        return self._accept(seqs, ks, drafts, q, p_logits)

    def _propose(self, seqs: list[Sequence], ks: list[int],
                 logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft tokens [R, kmax] and their draft distributions q [R, kmax, V] (zeros where unused;
        None when every row is greedy: q is one-hot at the proposal then)."""
        rows, kmax = len(seqs), max(ks)
        greedy = all(s.params.greedy for s in seqs)
        drafts = torch.zeros(rows, kmax, dtype=torch.int64, device=self.device)
        q = None if greedy else torch.zeros(rows, kmax, self.vocab_size, dtype=torch.float32, device=self.device)
        active = list(range(rows))
        for j in range(kmax):
            sel = slice(None) if len(active) == rows else to_device(active, self.device)
            if q is None:
                tokens = logits.argmax(dim=-1)
            else:
                act_seqs = [seqs[r] for r in active]
                positions = [s.num_generated + j for s in act_seqs]
                probs, _, _ = self._probs(logits, act_seqs, positions)
                tokens = race(probs.log(), exponential(act_seqs, positions, DRAFT, probs.shape[-1], self.generator))
                q[sel, j] = probs
            drafts[sel, j] = tokens
            nxt = [i for i, r in enumerate(active) if ks[r] > j + 1]
            if not nxt:
                break
            if len(nxt) < len(active):
                tokens = tokens.index_select(0, to_device(nxt, self.device))
                active = [active[i] for i in nxt]
            step = DecodeRows(self.block_size)
            for r in active:
                step.add(seqs[r].block_table, seqs[r].num_tokens + j, 1)  # d_{j+1} sits at position P + 1 + j
            logits = decode_logits(self.draft, self.graphs, tokens, step, self.device)
        return drafts, q

    def verify_logits(self, seqs: list[Sequence], ks: list[int], drafts: torch.Tensor,
                      expanded: bool = True) -> torch.Tensor:
        """Target logits [R, kmax + 1, V] at positions P..P + k_r (rows padded by repeating their last).

        expanded: the positions run as decode rows (graph-replayed when a graph fits); else as one
        varlen forward (the reference the tests hold the expanded rows to)."""
        rows, kmax = drafts.shape
        pool = torch.cat([to_device([s.last_token_id for s in seqs], self.device), drafts.flatten()])
        index: list[int] = []
        for r, k in enumerate(ks):
            index += [r] + [rows + r * kmax + j for j in range(k)]
        ids = pool.index_select(0, to_device(index, self.device))
        lens = [k + 1 for k in ks]
        model = self.runner.model
        if expanded:
            verify = DecodeRows(self.block_size)
            for s, n in zip(seqs, lens):
                verify.add(s.block_table, s.num_computed_tokens, n)
            logits = decode_logits(model, self.runner.verify_graphs, ids, verify, self.device)
        else:
            hidden = self._forward(model, ids, [s.num_computed_tokens for s in seqs], lens,
                                   [s.block_table for s in seqs])
            logits = model.compute_logits(hidden)
        offsets = [sum(lens[:r]) for r in range(rows)]
        padded = [offsets[r] + min(j, ks[r]) for r in range(rows) for j in range(kmax + 1)]
        return logits.index_select(0, to_device(padded, self.device)).view(rows, kmax + 1, -1)

    def _accept(self, seqs: list[Sequence], ks: list[int], drafts: torch.Tensor, q_draft: torch.Tensor | None,
                p_logits: torch.Tensor) -> list[list[SampleResult]]:
        """Rejection sampling over every row at once; one host transfer for the accepted runs."""
        rows, width, vocab = p_logits.shape
        flat_seqs = [s for s in seqs for _ in range(width)]
        positions = [s.num_generated + j for s in seqs for j in range(width)]
        cols = torch.arange(width, device=self.device)
        valid = cols[None, :] < to_device(ks, self.device)[:, None]
        if q_draft is None:  # every row greedy: accept while the proposal is the target's argmax
            logits = p_logits.reshape(rows * width, vocab).float()
            tokens = logits.argmax(dim=-1).view(rows, width)
            accepted = (drafts == tokens[:, : width - 1]) & valid[:, : width - 1]
            num_acc = accepted.long().cumprod(-1).sum(-1)
            dist = torch.log_softmax(logits, dim=-1)  # what the sampler reports for greedy rows
        else:
            tokens, num_acc, dist = self._reject(flat_seqs, positions, drafts, q_draft, p_logits, valid)
        lps = dist.gather(-1, tokens.reshape(-1, 1)).view(rows, width)
        host = torch.stack((tokens.double(), lps.double(), num_acc[:, None].expand(rows, width).double()))
        tok_l, lp_l, acc_l = host.tolist()
        tops = self._tops(dist, tokens, flat_seqs)
        runs = []
        for r in range(rows):
            n = int(acc_l[r][0]) + 1
            runs.append([(int(tok_l[r][j]), lp_l[r][j], tops[r * width + j]) for j in range(n)])
        return runs

    def _reject(self, flat_seqs: list[Sequence], positions: list[int], drafts: torch.Tensor,
                q_draft: torch.Tensor, p_logits: torch.Tensor,
                valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Tokens [R, W] (accepted proposals, then the residual or bonus draw), the number accepted
        [R] and the log-probabilities to report [R * W, V]."""
        rows, width, vocab = p_logits.shape
        p, x, sb = self._probs(p_logits.reshape(rows * width, vocab), flat_seqs, positions)
        p = p.view(rows, width, vocab)
        q = torch.zeros_like(p)
        q[:, : width - 1] = q_draft  # the bonus position has q = 0: its "residual" is p itself
        d = torch.zeros(rows, width, dtype=torch.int64, device=self.device)
        d[:, : width - 1] = drafts
        p_d = p.gather(-1, d[..., None]).squeeze(-1)
        q_d = q.gather(-1, d[..., None]).squeeze(-1)
        u = uniforms(flat_seqs, positions, ACCEPT, 1, self.generator).view(rows, width)
        accepted = (u * q_d < p_d) & valid  # u < p/q without dividing; q(d) > 0 for a drawn d
        num_acc = accepted.long().cumprod(-1).sum(-1)  # leading accepted draft tokens
        residual = (p - q).clamp_min(0.0)
        mass = residual.sum(-1, keepdim=True)
        residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p)  # p == q: never rejected
        noise = exponential(flat_seqs, positions, RESIDUAL, vocab, self.generator)
        fallback = race(residual.view(rows * width, vocab).log(), noise).view(rows, width)
        final = fallback.gather(1, num_acc[:, None])
        cols = torch.arange(width, device=self.device)
        tokens = torch.where(cols[None, :] < num_acc[:, None], d, final)
        dist = self._report_dist(p_logits.reshape(rows * width, vocab).float(), x, sb)
        return tokens, num_acc, dist

    # ---- distributions and noise ----------------------------------------------------------
    def _probs(self, logits: torch.Tensor, seqs: list[Sequence],
               positions: list[int]) -> tuple[torch.Tensor, torch.Tensor, SamplingBatch]:
        """The sampling distribution per row (the sampler's processing; one-hot argmax for greedy
        rows), the processed logits and the SamplingBatch."""
        logits = logits.float()
        sb = SamplingBatch.build([s.params for s in seqs], [s.seed for s in seqs], positions,
                                 self.vocab_size, self.device)
        x = logits if sb.all_greedy else process_logits(logits, sb)
        probs = torch.softmax(x, dim=-1)
        greedy = [s.params.greedy for s in seqs]
        if any(greedy):
            one_hot = torch.nn.functional.one_hot(logits.argmax(-1), self.vocab_size).float()
            probs = torch.where(to_device(greedy, self.device, torch.bool)[:, None], one_hot, probs)
        return probs, x, sb

    def _report_dist(self, logits: torch.Tensor, processed: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
        """Log-probabilities to report, as the sampler reports them ("raw" or "processed" per row)."""
        raw = torch.log_softmax(logits, dim=-1)
        if not sb.any_processed:
            return raw
        assert sb.processed_logprobs is not None
        return torch.where(sb.processed_logprobs[:, None], torch.log_softmax(processed, dim=-1), raw)

    def _tops(self, dist: torch.Tensor, tokens: torch.Tensor, seqs: list[Sequence]) -> list:
        wanted = [s.params.logprobs for s in seqs]
        if not any(wanted):
            return [None] * len(seqs)
        top_lp, top_ids = dist.topk(max(wanted), dim=-1)
        return top_dicts(top_ids, top_lp, wanted)


class ExactSpeculation:
    """Propose, verify and accept the rows of one speculative step by exact match (docs/invariance.md).

    Rejection sampling keeps the target's distribution but not its draws: with a draft, a seeded row
    takes other tokens than without one, and its logprobs come from another computation than the
    sampler's. In the batch-invariant mode a request gives the same tokens and logprobs with the draft
    on or off, so each verify position is sampled exactly as the target alone samples it:
    - the target's logits of positions P .. P + k come from the verify rows (the same forward, bit for
      bit, as a plain decode of each position, since every layer of the mode computes a row alone);
    - `sample` runs on them with the row's own parameters, noise seed and output position;
    - d_i is accepted while it equals the target's token at its position; the first mismatch emits the
      target's token there, a fully accepted run the bonus token;
    - the draft proposes with the same sampler, seeds and positions (a coupled draw), so a draft close
      to the target proposes the target's own draws and is accepted often.
    Unseeded rows draw their noise from a seed made for each speculative step and row (`unseeded_seed`
    of the runner's seed, salted): proposal and verification share it; such rows are not reproducible.
    """

    def __init__(self, spec: SpecDecoder) -> None:
        self.spec = spec
        self.steps = 0  # speculative steps run: the unseeded rows' seeds count them

    def speculate(self, seqs: list[Sequence], ks: list[int], first_logits: torch.Tensor) -> list[list[SampleResult]]:
        """Per row, the accepted run: the target's tokens (and logprobs) of positions P .. P + n - 1."""
        runner = self.spec.runner
        seeds = [s.seed if s.seed is not None else unseeded_seed(runner.seed ^ _SALT, self.steps, r)
                 for r, s in enumerate(seqs)]
        self.steps += 1
        drafts = self._propose(seqs, ks, first_logits, seeds)
        p_logits = self.spec.verify_logits(seqs, ks, drafts)
        return self._accept(seqs, ks, drafts, p_logits, seeds)

    def _batch(self, seqs: list[Sequence], seeds: list[int], offsets: list[int]) -> SamplingBatch:
        """The sampling rows of seqs at output positions num_generated + offset."""
        return SamplingBatch.build([s.params for s in seqs], list(seeds),
                                   [s.num_generated + j for s, j in zip(seqs, offsets)], self.spec.vocab_size,
                                   self.spec.device, invariant=True)

    def _propose(self, seqs: list[Sequence], ks: list[int], logits: torch.Tensor, seeds: list[int]) -> torch.Tensor:
        """Draft tokens [R, kmax] (zeros where unused), each drawn by `sample` from the draft's logits with
        the row's seed and the output position it would take."""
        spec, device = self.spec, self.spec.device
        rows, kmax = len(seqs), max(ks)
        drafts = torch.zeros(rows, kmax, dtype=torch.int64, device=device)
        active = list(range(rows))
        # every row's tensors cross to the device once; a step while all rows propose only moves positions
        first = self._batch(seqs, seeds, [0] * rows)
        for j in range(kmax):
            if len(active) == rows:
                sb = first if j == 0 or first.positions is None else first.at(first.positions + j)
            else:
                sb = self._batch([seqs[r] for r in active], [seeds[r] for r in active], [j] * len(active))
            tokens = sample(logits, sb, spec.generator).token_ids
            sel = slice(None) if len(active) == rows else to_device(active, device)
            drafts[sel, j] = tokens
            nxt = [i for i, r in enumerate(active) if ks[r] > j + 1]
            if not nxt:
                break
            if len(nxt) < len(active):
                tokens = tokens.index_select(0, to_device(nxt, device))
                active = [active[i] for i in nxt]
            step = DecodeRows(spec.block_size)
            for r in active:
                step.add(seqs[r].block_table, seqs[r].num_tokens + j, 1)  # d_{j+1} sits at position P + 1 + j
            logits = decode_logits(spec.draft, spec.graphs, tokens, step, device)
        return drafts

    def _accept(self, seqs: list[Sequence], ks: list[int], drafts: torch.Tensor, p_logits: torch.Tensor,
                seeds: list[int]) -> list[list[SampleResult]]:
        """The target's sample at every verify position; accept while the draft agrees; one host transfer."""
        rows, width, vocab = p_logits.shape
        flat = [s for s in seqs for _ in range(width)]
        sb = self._batch(flat, [seeds[r] for r in range(rows) for _ in range(width)], list(range(width)) * rows)
        out = sample(p_logits.reshape(rows * width, vocab), sb, self.spec.generator)
        tokens = out.token_ids.view(rows, width)
        valid = torch.arange(width - 1, device=drafts.device)[None, :] < to_device(ks, drafts.device)[:, None]
        num_acc = ((drafts == tokens[:, : width - 1]) & valid).long().cumprod(-1).sum(-1)
        host = torch.stack((tokens.double(), out.logprobs.view(rows, width).double(),
                            num_acc[:, None].expand(rows, width).double()))
        tok_l, lp_l, acc_l = host.tolist()
        tops = top_dicts(out.top_ids, out.top_logprobs, [s.params.logprobs for s in flat])
        return [[(int(tok_l[r][j]), lp_l[r][j], tops[r * width + j]) for j in range(int(acc_l[r][0]) + 1)]
                for r in range(rows)]
