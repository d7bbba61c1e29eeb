"""Speculative decoding in the batch-invariant mode: exact-match verification (docs/invariance.md).

Rejection sampling (inference/spec/decoder.py) keeps the target's distribution but not its draws: with
a draft, a seeded row takes other tokens than without one, and the logprobs it reports come from
another computation (a log_softmax over the verify rows) than the sampler's. In the mode, a request
must give the same tokens and logprobs with the draft on or off, so each verify position is sampled
exactly as the target alone samples that position:

- the target's logits of positions P .. P + k come from the verify rows (the same forward, bit for bit,
  as a plain decode of each position, since every layer of the mode computes a row alone);
- `sample` runs on them with the row's own parameters, noise seed and output position (the counter of
  the race's noise): the very token and logprob a plain step at that position would produce;
- draft token d_i is accepted while it equals the target's token at its position; the first mismatch
  emits the target's token there, a fully accepted run the bonus token. Every emitted token is therefore
  the target-only engine's, so the output does not depend on the draft (nor on speculating at all).
- the draft proposes with the same sampler, seeds and positions (the same noise: a coupled draw), so
  a draft close to the target proposes the target's own draws and is accepted often.

Unseeded rows draw their noise from a seed made for each speculative step and row (`unseeded_seed` of
the runner's seed, salted): proposal and verification share it, as the coupling needs; such rows are
not reproducible in any mode.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from inference.batch import to_device
from inference.runner.decode_rows import DecodeRows, decode_logits
from inference.runner.runner import SampleResult, top_dicts
from inference.sample.sampler import SamplingBatch, sample, unseeded_seed
from inference.sched.sequence import Sequence

if TYPE_CHECKING:
    from inference.spec.decoder import SpecDecoder

_SALT = 0x5BD1E995  # keeps these seeds apart from the runner's own unseeded rows


class ExactSpeculation:
    """Propose, verify and accept the rows of one speculative step by exact match (module docstring)."""

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
        for j in range(kmax):
            act = [seqs[r] for r in active]
            sb = self._batch(act, [seeds[r] for r in active], [j] * len(act))
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

