"""Speculative decoding's graph-friendly paths on CPU (fp32): the expanded-row verify computes the
varlen verify's logits, and the graph path (decode graphs stood in by eager replays of the same static
buffers, Triton kernels in the interpreter) keeps greedy output identical to target-only decoding."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from inference.core import SamplingParams
from inference.engine.llm import LLM
from inference.runner.cuda_graphs import CUDAGraphRunner, batch_ladder, extended_ladder
from inference.speculative.decoder import SpecDecoder
from tests.helpers_models import make_hf_checkpoint, random_prompts
from tests.test_spec_decode import perturb_checkpoint

VOCAB = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("spec-graphs")
    target = root / "target"
    make_hf_checkpoint("qwen2", target, seed=0, vocab_size=VOCAB, initializer_range=0.2)
    return target, perturb_checkpoint(target, root / "close", 0.02)


def engine(target: Path, draft: Path | None = None, k: int = 3, **kw: object) -> LLM:
    extra = {"draft_model": str(draft), "num_speculative_tokens": k} if draft is not None else {}
    return LLM(target, device="cpu", dtype="float32", block_size=4, kv_cache_bytes=2 << 20, max_num_seqs=4,
               **extra, **kw)


@pytest.mark.slow
def test_expanded_row_verify_equals_varlen_verify(pair: tuple[Path, Path],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    target, draft = pair
    llm = engine(target, draft)
    seen: list[list[int]] = []
    verify = SpecDecoder.verify_logits

    def both(self: SpecDecoder, seqs: list, ks: list[int], drafts: torch.Tensor,
             expanded: bool = True) -> torch.Tensor:
        varlen = verify(self, seqs, ks, drafts, expanded=False)
        rows = verify(self, seqs, ks, drafts, expanded=True)  # rewrites the same KV slots
        torch.testing.assert_close(rows, varlen, rtol=1e-5, atol=1e-5)
        seen.append(list(ks))
        return rows

    monkeypatch.setattr(SpecDecoder, "verify_logits", both)
    prompts = random_prompts([3, 9, 6], VOCAB, seed=1)
    ref = engine(target).generate(prompts, GREEDY)
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert any(len(ks) > 1 for ks in seen)  # several sequences in one verify
    assert len({k for ks in seen for k in ks}) > 1  # lookaheads shrink near max_tokens


class EagerGraphs(CUDAGraphRunner):
    """CUDAGraphRunner whose "graphs" rerun the captured forward eagerly over the static buffers: the
    padding, buffer views and ladder choice of the graph path, on CPU."""

    def capture(self) -> None:
        self.replays: Counter[int] = Counter()
        for bs in self.sizes:
            self.outputs[bs] = self.logits[:bs]
            self.graphs[bs] = _Replay(self, bs)  # type: ignore[assignment]


class _Replay:
    def __init__(self, runner: EagerGraphs, bs: int) -> None:
        self.runner, self.bs = runner, bs

    def replay(self) -> None:
        self.runner.replays[self.bs] += 1
        with torch.inference_mode():
            self.runner._forward(self.bs)


def install_graphs(llm: LLM, max_batch: int) -> tuple[EagerGraphs, EagerGraphs | None, EagerGraphs | None]:
    """The graphs Worker.capture_graphs would capture: the target's plain decode graphs (one row per
    sequence), with a draft also the target's verify graphs and the draft's graphs; returns
    (plain, verify, draft)."""
    worker = llm.worker
    runner = worker.runner
    assert runner is not None
    max_blocks = -(-worker.max_model_len // runner.block_size)
    spec = worker.spec
    target = EagerGraphs(runner.model, max_batch, max_blocks, runner.block_size, runner.device, runner.dtype,
                         rows_per_seq=1)
    target.capture()
    runner.graphs = target
    if spec is None:
        return target, None, None
    rows = spec.verify_rows(max_batch, worker.config.scheduler.spec_max_batch)
    verify = EagerGraphs(runner.model, rows, max_blocks, runner.block_size, runner.device, runner.dtype,
                         rows_per_seq=spec.k + 1)
    verify.capture()
    runner.verify_graphs = verify
    follows = llm._overlap is not None  # as Worker.warm_up decides: async steps are followed on graphs
    sizes = spec.draft_sizes(max_batch, rows, follows)
    draft = EagerGraphs(spec.draft, max(sizes), max_blocks, runner.block_size, runner.device, runner.dtype, sizes,
                        logits_max=rows)
    draft.capture()
    spec.graphs = draft
    if follows:
        follow = EagerGraphs(spec.draft, max_batch, max_blocks, runner.block_size, runner.device, runner.dtype,
                             logits_max=0, rows_per_seq=1)
        follow.capture()
        spec.follow_graphs = follow
    return target, verify, draft


def target_only(target: Path, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    """The tokens target-only decoding gives on its decode graphs (what a draft must not change)."""
    base = engine(target, attention_backend="triton", max_model_len=64)
    install_graphs(base, 4)
    return [o.outputs[0].token_ids for o in base.generate(prompts, params)]


@pytest.mark.slow
def test_graph_path_keeps_greedy_output_identical(pair: tuple[Path, Path]) -> None:
    target, draft = pair
    prompts = random_prompts([5, 11], VOCAB, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    base = engine(target, attention_backend="triton", max_model_len=64)
    base_graphs, _, _ = install_graphs(base, 2)
    ref = base.generate(prompts, params)
    spec = engine(target, draft, 3, attention_backend="triton", max_model_len=64)
    plain_graphs, verify_graphs, draft_graphs = install_graphs(spec, 2)
    outs = spec.generate(prompts, params)
    for r, o in zip(ref, outs):
        assert o.outputs[0].token_ids == r.outputs[0].token_ids
        torch.testing.assert_close(o.outputs[0].logprobs, r.outputs[0].logprobs, rtol=1e-4, atol=1e-4)
    assert base_graphs.replays and set(base_graphs.replays) <= {1, 2}
    assert verify_graphs is not None and max(verify_graphs.replays) == 8  # two sequences of 4 verify rows
    assert verify_graphs.sizes[-1] == 8 and plain_graphs.sizes == [1, 2]
    assert draft_graphs is not None and draft_graphs.replays[2] > 0  # both rows' one-token steps
    assert spec.spec_stats.proposed > 0


def test_extended_ladder_keeps_the_decode_sizes_and_covers_the_verify_rows() -> None:
    for max_batch, rows in ((1, 5), (16, 80), (20, 100), (256, 512)):
        sizes = extended_ladder(max_batch, rows)
        assert set(batch_ladder(max_batch)) <= set(sizes) and max(sizes) == rows
        # a plain decode of n <= max_batch rows picks the graph it picked without speculation
        for n in range(1, max_batch + 1):
            assert next(b for b in sizes if b >= n) == next(b for b in batch_ladder(max_batch) if b >= n)


@pytest.mark.slow
def test_without_a_draft_decode_launches_take_one_row_per_sequence(pair: tuple[Path, Path]) -> None:
    """No speculative decoding: the target's triton backend compiles the multi-row owner check out
    (decode_max_rows 1), and a SpecDecoder put on that target later is refused, not run unsafely; with a
    draft, the target keeps the rows verify launches need."""
    target, draft = pair
    plain = engine(target, attention_backend="triton", max_model_len=64)
    backends = {layer.backend for layer in plain.worker.models["target"].attention_layers()}
    assert len(backends) == 1 and backends.pop().tiles.decode_max_rows == 1
    spec = engine(target, draft, 3, attention_backend="triton", max_model_len=64)
    for which in ("target", "draft"):
        assert all(layer.backend.tiles.decode_max_rows >= 4 for layer in spec.worker.models[which].attention_layers())
    with pytest.raises(ValueError, match=r"needs 4 decode rows.*at most 1"):
        SpecDecoder(plain.worker.runner, spec.worker.models["draft"], 3)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = random_prompts([5, 9], VOCAB, seed=4)
    plain_out = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    spec_out = [o.outputs[0].token_ids for o in spec.generate(prompts, params)]
    assert plain_out == spec_out


def test_draft_graphs_above_the_speculating_rows_leave_the_lm_head_out(pair: tuple[Path, Path]) -> None:
    """A graph runner's sizes above logits_max (the draft's: spec_max_batch * (k + 1)) compute the hidden
    states only: a follow of a full batch's plain step needs the draft's KV, not its logits. Its logits
    buffer holds only the sizes that compute them, and can_use says which replays give logits."""
    target, draft = pair
    llm = engine(target, draft)
    runner, spec = llm.worker.runner, llm.worker.spec
    assert runner is not None and spec is not None
    max_blocks = -(-llm.worker.max_model_len // runner.block_size)
    graphs = CUDAGraphRunner(spec.draft, 8, max_blocks, runner.block_size, runner.device, runner.dtype,
                             [1, 2, 4, 8], logits_max=3)
    assert graphs.logits_top == 4 and graphs.logits.shape[0] == 4
    hidden, vocab = spec.draft.config.hidden_size, spec.draft.config.vocab_size
    with torch.inference_mode():
        graphs.inputs.reset(8)
        assert graphs._forward(8).shape == (8, hidden)
        graphs.inputs.reset(4)
        assert graphs._forward(4).shape == (4, vocab)
    graphs.graphs = dict.fromkeys(graphs.sizes)  # as if captured: can_use only asks that some exist
    assert graphs.can_use(3, 1) and graphs.can_use(4, 1) and not graphs.can_use(5, 1)
    assert graphs.can_use(8, 1, logits=False) and not graphs.can_use(9, 1, logits=False)
    full = CUDAGraphRunner(spec.draft, 8, max_blocks, runner.block_size, runner.device, runner.dtype, [1, 2, 4, 8])
    assert full.logits_top == 8  # no logits_max: every size computes logits
    assert spec.verify_rows(16, 2) == 2 * (spec.k + 1) and spec.verify_rows(16, 0) == spec.graph_rows(16)


@pytest.mark.slow
def test_async_follows_replay_one_row_graphs_without_lm_head(pair: tuple[Path, Path]) -> None:
    """With async scheduling the draft follows the plain steps of a batch over spec_max_batch on graphs
    of their own (one row per sequence, no LM head); greedy tokens stay those of target-only decoding."""
    target, draft = pair
    prompts = random_prompts([5, 11, 7], VOCAB, seed=4)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (4, 6, 14)]
    ref = target_only(target, prompts, params)
    spec = engine(target, draft, 3, attention_backend="triton", max_model_len=64, async_scheduling=True,
                  spec_max_batch=1)
    _, _, draft_graphs = install_graphs(spec, 4)
    follow = spec.worker.spec.follow_graphs
    assert isinstance(follow, EagerGraphs) and follow.logits_top == 0 and follow.rows_per_seq == 1
    # the draft's own ladder stops at a speculating step's rows (one sequence of k + 1): nothing above
    assert draft_graphs is not None and draft_graphs.sizes == batch_ladder(4) and draft_graphs.logits_top == 4
    eager_lens: list[list[int]] = []
    real_forward = SpecDecoder._forward

    def counted(self: SpecDecoder, model: torch.nn.Module, ids: torch.Tensor, starts: list[int], lens: list[int],
                tables: list[list[int]]) -> torch.Tensor:
        if model is self.draft:
            eager_lens.append(list(lens))
        return real_forward(self, model, ids, starts, lens, tables)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(SpecDecoder, "_forward", counted)
        got = [o.outputs[0].token_ids for o in spec.generate(prompts, params)]
    assert got == ref
    assert eager_lens == []  # every draft pass of a speculating step replayed a graph (prompts follow the steps)
    assert follow.replays[2] + follow.replays[4] > 0  # plain steps of 2-3 sequences, followed on their graphs
    assert spec.spec_stats.proposed > 0  # the last sequence alone speculated


@pytest.mark.slow
def test_a_plain_batchs_draft_catch_up_replays_graphs_without_lm_head(pair: tuple[Path, Path]) -> None:
    """Synchronous steps with a draft: a plain batch's draft pass only writes KV, so it replays the draft's
    graphs above a speculating step's rows (captured without the LM head) instead of running eagerly."""
    target, draft = pair
    prompts = random_prompts([5, 11, 7, 9], VOCAB, seed=5)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (6, 6, 6, 12)]
    ref = target_only(target, prompts, params)
    spec = engine(target, draft, 1, attention_backend="triton", max_model_len=64, async_scheduling=False,
                  spec_max_batch=1)
    _, _, draft_graphs = install_graphs(spec, 4)
    assert draft_graphs is not None and draft_graphs.logits_top == 2  # one sequence of k + 1 rows
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params)]
    assert got == ref
    assert draft_graphs.replays[4] > 0  # plain steps of 3-4 sequences: above logits_top, on a graph
    assert spec.spec_stats.proposed > 0
