"""Async scheduling: the engine launches step i+1 before it reads step i's tokens (placeholders on the
host, the tokens fetched on the device), and its outputs are exactly the synchronous engine's.

On CPU the path is forced on through SchedulerConfig.async_scheduling; the `cuda` tests run it through
the decode graphs. A probe counts what only the async path does (placeholder ids resolved on the
device, rows of sequences that finished while their next step was in flight), so no test passes by
silently running synchronously.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

import inference.runner.cuda_graphs as cuda_graphs_module
import inference.runner.runner as runner_module
from inference.config import SchedulerConfig
from inference.core import FinishReason, RequestOutput, SamplingParams
from inference.engine.llm import LLM
from inference.runner.pending_tokens import resolve_pending, resolve_pending_torch
from inference.sched.scheduler import ScheduledBatch, Scheduler
from inference.sched.sequence import Sequence, placeholder, placeholder_row
from tests.helpers_models import make_hf_checkpoint, random_prompts
from tests.test_scheduler import BS, VOCAB, FakeRunner, add_request, make

STOPS = tuple(range(3, 300, 9))  # about one token in nine ends a completion: stops land mid-batch


# ---- the device-side resolution of placeholder ids -------------------------------------------------
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_resolve_kernel_equals_its_twin(device: str) -> None:
    pytest.importorskip("triton")
    g = torch.Generator().manual_seed(0)
    buffer = torch.zeros(40, 2, dtype=torch.float64)
    buffer[:, 0] = torch.randint(0, 151_936, (40,), generator=g).double()
    pairs = buffer[:25].to(device)  # a view of a larger buffer, as a sampling graph's output is
    ids = torch.randint(0, 151_936, (1100,), generator=g)  # more than one program's block
    holes = torch.randperm(1100, generator=g)[:300]
    ids[holes] = -1 - torch.randint(0, 25, (300,), generator=g)
    ids = ids.to(device)
    got = resolve_pending(ids.clone(), pairs, use_triton=True)
    want = resolve_pending_torch(ids.clone(), pairs)
    assert torch.equal(got, want)
    assert torch.equal(want[holes.to(device)], pairs[:, 0].long()[-1 - ids[holes.to(device)]])
    keep = ids >= 0
    assert torch.equal(want[keep], ids[keep])


def test_placeholders_encode_the_sampled_row() -> None:
    assert [placeholder(r) for r in (0, 1, 7)] == [-1, -2, -8]
    assert [placeholder_row(placeholder(r)) for r in (0, 1, 7)] == [0, 1, 7]
    seq = Sequence("r", 0, [4, 5], SamplingParams(logprobs=2))
    seq.add_pending(3)
    assert (seq.token_ids, seq.num_generated, seq.num_pending) == ([4, 5, -4], 1, 1)
    seq.resolve_pending(9, -0.5, {9: -0.5})
    assert (seq.token_ids, seq.logprobs, seq.top_logprobs, seq.num_pending) == ([4, 5, 9], [-0.5], [{9: -0.5}], 0)


def test_async_is_on_for_cuda_with_or_without_a_draft() -> None:
    def decide(wanted: bool | None, device: str, spec: object = None) -> bool:
        return SchedulerConfig(async_scheduling=wanted).overlaps_steps(device)  # spec: no say in it

    assert decide(None, "cuda") and not decide(None, "cpu")
    assert decide(True, "cpu") and not decide(False, "cuda")
    assert decide(True, "cuda", spec=object()) and decide(True, "cpu", spec=object())
    assert decide(None, "cuda", spec=object()) and not decide(None, "cpu", spec=object())
    assert not decide(False, "cuda", spec=object())


# ---- the scheduler with a fake runner -------------------------------------------------------------
class LaunchingFakeRunner(FakeRunner):
    """FakeRunner run at launch time: a placeholder input is the token the previous launch sampled in
    that row (the device holds it), so the fake KV checks hold placeholders to the real tokens."""

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.last: list[int] = []  # tokens of the last launch's sampled rows, in row order

    def launch(self, batch: ScheduledBatch) -> list:
        swapped = [(s, s.token_ids[-1]) for s in batch.seqs if s.num_pending]
        for seq, ph in swapped:
            seq.token_ids[-1] = self.last[placeholder_row(ph)]
        try:
            out = self(batch)
        finally:
            for seq, ph in swapped:
                seq.token_ids[-1] = ph
        self.last = [o[0] for o in out if o is not None]
        return out


def run_sync(sched: Scheduler, runner: FakeRunner) -> None:
    while sched.has_unfinished():
        batch = sched.schedule()
        assert not batch.is_empty
        sched.commit(batch, runner(batch))


def run_async(sched: Scheduler, runner: LaunchingFakeRunner) -> int:
    """The engine's async loop; returns the rows whose sequence finished before their result came."""
    in_flight: tuple[ScheduledBatch, list] | None = None
    wasted = steps = 0
    while sched.has_unfinished() or in_flight is not None:
        steps += 1
        assert steps < 100_000, "no progress"
        batch = sched.schedule()
        assert batch.num_seqs <= sched.config.max_num_seqs
        assert not any(s.num_pending and s.num_tokens - s.num_computed_tokens != 1 for s in batch.seqs)
        out = runner.launch(batch) if not batch.is_empty else None
        assert out is not None or in_flight is not None, "an empty step with nothing in flight"
        if in_flight is not None:
            wasted += sum(1 for s, r in zip(in_flight[0].seqs, in_flight[1]) if r is not None and s.is_finished)
            sched.commit_pending(*in_flight)
        in_flight = None
        if out is not None:
            sched.advance(batch)
            in_flight = (batch, out)
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    return wasted


def outputs(seqs: list[Sequence]) -> dict:
    return {(s.request_id, s.index): (s.token_ids, s.logprobs, s.finish_reason, s.stop_reason) for s in seqs}


@pytest.mark.parametrize("trial", range(16))
def test_random_workloads_async_equals_sync(trial: int) -> None:
    """Random caches, budgets, seat limits, shared prefixes and stop tokens: the async loop gives the
    synchronous loop's tokens, logprobs and finish reasons, and frees every block."""
    rng = random.Random(trial)
    num_blocks, budget, max_num_seqs = rng.randrange(10, 40), rng.randrange(1, 40), rng.randrange(1, 12)
    prefix = trial % 4 != 0

    def requests(sched: Scheduler) -> list[Sequence]:
        r = random.Random(trial)
        seqs: list[Sequence] = []
        for i in range(15):
            shared = r.choice([[5] * 8, list(range(7, 16)), []])
            prompt = shared + [r.randrange(1, VOCAB) for _ in range(r.randrange(1, 25))]
            params = {"max_tokens": r.randrange(1, 20), "n": r.randrange(1, 5),
                      "stop_token_ids": tuple(r.sample(range(1, VOCAB), r.choice([0, 2, 6])))}
            if len(prompt) + params["max_tokens"] - 1 <= num_blocks * BS:  # else rejected at add
                seqs += add_request(sched, f"r{i}", prompt, **params)
        return seqs

    ref_sched, ref_runner = make(num_blocks, max_num_seqs, budget, max_model_len=60, prefix=prefix)
    ref = requests(ref_sched)
    run_sync(ref_sched, ref_runner)
    sched, _ = make(num_blocks, max_num_seqs, budget, max_model_len=60, prefix=prefix)
    seqs = requests(sched)
    run_async(sched, LaunchingFakeRunner(num_blocks))
    assert outputs(seqs) == outputs(ref)


def test_rows_are_scheduled_before_their_tokens_are_read_but_never_past_their_length() -> None:
    sched, _ = make()
    a = add_request(sched, "a", [1, 2, 3], max_tokens=6)[0]
    b = add_request(sched, "b", [4, 5, 6], max_tokens=3)[0]
    runner = LaunchingFakeRunner(64)
    first = sched.schedule()
    first_out = runner.launch(first)
    sched.advance(first)
    assert a.num_pending and b.num_pending and a.token_ids[-1] == placeholder(0)
    second = sched.schedule()  # b's pending token is its 1st of 3: both decode, before any token is read
    assert second.seqs == [a, b] and second.sample == [True, True]
    runner.launch(second)
    sched.commit_pending(first, first_out)
    sched.advance(second)
    assert a.token_ids[3] > 0 and a.num_generated == 2 and b.num_generated == 2
    third = sched.schedule()
    runner.launch(third)
    assert third.seqs == [a, b]
    sched.commit_pending(second, [(7, -0.1, None), (8, -0.2, None)])
    sched.advance(third)
    fourth = sched.schedule()  # b's pending token is its 3rd and last: b is not scheduled again
    assert fourth.seqs == [a]


def test_wasted_rows_happen_and_outputs_still_match() -> None:
    sched, runner = make(max_num_seqs=6)
    for i in range(6):
        add_request(sched, f"r{i}", [i + 1] * (3 + i), max_tokens=12, stop_token_ids=(5 + i, 11 + i, 17 + i))
    ref = list(sched.waiting)
    run_sync(sched, runner)
    sched2, _ = make(max_num_seqs=6)
    for i in range(6):
        add_request(sched2, f"r{i}", [i + 1] * (3 + i), max_tokens=12, stop_token_ids=(5 + i, 11 + i, 17 + i))
    seqs = list(sched2.waiting)
    assert run_async(sched2, LaunchingFakeRunner(64)) > 0
    assert outputs(seqs) == outputs(ref)
    assert any(s.finish_reason is FinishReason.STOP for s in seqs)


# ---- the engine on CPU ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("async-qwen2")
    make_hf_checkpoint("qwen2", path, initializer_range=0.2)
    return path


def engine(path: Path | None, async_on: bool, **kw: object) -> LLM:
    kw.setdefault("block_size", 4)
    kw.setdefault("kv_cache_bytes", 4 << 20)
    return LLM(path, device="cpu", dtype="float32", async_scheduling=async_on, **kw)


class Probe:
    """Counts placeholder ids resolved on the device and rows wasted on finished sequences."""

    def __init__(self, llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
        self.resolved = self.wasted = 0
        for module in (runner_module, cuda_graphs_module):
            monkeypatch.setattr(module, "resolve_pending", self._resolve)
        commit = llm.scheduler.commit_pending

        def counted(batch: ScheduledBatch, results: list) -> list[Sequence]:
            self.wasted += sum(1 for s, r in zip(batch.seqs, results) if r is not None and s.is_finished)
            return commit(batch, results)

        llm.scheduler.commit_pending = counted  # type: ignore[method-assign]

    def _resolve(self, ids: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
        self.resolved += int((ids < 0).sum())
        return resolve_pending(ids, pairs)


def completions(outs: list[RequestOutput]) -> list[tuple]:
    return [(o.request_id, c.index, c.token_ids, c.logprobs, c.top_logprobs, c.finish_reason, c.stop_reason,
             c.text, c.weight_version_spans) for o in outs for c in o.outputs]


def assert_completions_equal(got: list[RequestOutput], want: list[RequestOutput]) -> None:
    """Everything equal but the logprob values, which agree to 1e-5: with stops mid-batch, async rows of
    finished sequences are wasted, so steps run at other row counts, and the CPU's GEMMs may round a
    row otherwise (seen: 8e-7 on one CPU model, exact on another)."""
    for a, b in zip(completions(got), completions(want), strict=True):
        assert (a[:3], a[5:]) == (b[:3], b[5:])
        torch.testing.assert_close(torch.tensor(a[3]), torch.tensor(b[3]), atol=1e-5, rtol=0)
        assert (a[4] is None) == (b[4] is None)
        for top_a, top_b in zip(a[4] or [], b[4] or [], strict=True):
            assert list(top_a) == list(top_b)
            torch.testing.assert_close(torch.tensor(list(top_a.values())), torch.tensor(list(top_b.values())),
                                       atol=1e-5, rtol=0)


def mixed_params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=STOPS[::2]),
            SamplingParams(temperature=1.0, seed=3, max_tokens=25, n=3, stop_token_ids=STOPS),
            SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=4, max_tokens=7, logprobs=2),
            SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
            SamplingParams(temperature=1.0, min_p=0.05, seed=8, max_tokens=12, n=2, logprobs_mode="processed"),
            SamplingParams(temperature=1.0, seed=11, max_tokens=9, stop_token_ids=STOPS[1::2])]


@pytest.mark.slow
def test_engine_async_equals_sync(qwen2: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy and seeded rows, EOS, stop tokens, max_tokens, top logprobs, n > 1 sharing a prompt."""
    sync, fast = engine(qwen2, False), engine(qwen2, True)
    probe = Probe(fast, monkeypatch)
    prompts = random_prompts([3, 17, 9, 30, 5, 12], sync.model_config.vocab_size, seed=1)
    for llm in (sync, fast):
        llm.scheduler.eos_token_ids = frozenset({7, 150})  # some greedy run meets an EOS
    want, got = sync.generate(prompts, mixed_params()), fast.generate(prompts, mixed_params())
    assert_completions_equal(got, want)
    reasons = {c[5] for c in completions(want)}
    assert reasons == {FinishReason.STOP, FinishReason.LENGTH}
    assert probe.resolved > 0 and probe.wasted > 0
    assert fast.block_manager.num_free_blocks == fast.block_manager.num_blocks
    assert not fast.has_unfinished()


@pytest.mark.slow
def test_stop_strings_async_equals_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    sync, fast = (LLM(None, device="cpu", max_num_seqs=4, async_scheduling=a) for a in (False, True))
    probe = Probe(fast, monkeypatch)
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    text = sync.generate(["the cat sat"], plain)[0].outputs[0].text
    assert text and fast.generate(["the cat sat"], plain)[0].outputs[0].text == text
    prompts = ["the cat sat", "a b c d", "the cat sat", "hello"]
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[text[2:4]]), plain,
              SamplingParams(temperature=1.0, seed=1, max_tokens=12, stop=["e", "a"]), plain]
    want, got = sync.generate(prompts, params), fast.generate(prompts, params)
    assert_completions_equal(got, want)
    assert want[0].outputs[0].finish_reason is FinishReason.STOP
    assert probe.resolved > 0 and fast._num_with_stops == 0


@pytest.mark.slow
def test_abort_mid_request(qwen2: Path) -> None:
    prompts = random_prompts([6, 11, 8], 300, seed=2)
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=16, n=2, ignore_eos=True)
    results = []
    for async_on in (False, True):
        llm = engine(qwen2, async_on)
        ids = [llm.add_request(p, params) for p in prompts]
        for _ in range(4):
            assert llm.step() == []
        if async_on:  # the aborted request has a token in flight: its placeholder is dropped
            assert all(s.num_pending for s in llm._requests[ids[1]].seqs)
        llm.abort(ids[1])
        done: dict[str, RequestOutput] = {}
        while llm.has_unfinished():
            done.update((o.request_id, o) for o in llm.step())
        assert sorted(done) == sorted([ids[0], ids[2]])
        assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
        results.append(completions([done[ids[0]], done[ids[2]]]))
    assert results[0] == results[1]


@pytest.mark.slow
def test_preemption_under_a_tiny_cache(qwen2: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = random_prompts([6, 10, 14, 7, 12, 9], 300, seed=6)
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=9, max_tokens=20, stop_token_ids=STOPS)] * 3
    roomy = engine(qwen2, False)
    want = roomy.generate(prompts, params)
    tight_kw = {"kv_cache_bytes": 12 * roomy.worker.runner.kv_bytes_per_block(4), "max_num_batched_tokens": 16}
    sync, fast = engine(qwen2, False, **tight_kw), engine(qwen2, True, **tight_kw)
    probe = Probe(fast, monkeypatch)
    got_sync, got = sync.generate(prompts, params), fast.generate(prompts, params)
    assert fast.scheduler.preempted > 0 and probe.resolved > 0
    # each request reports its sequences' preemptions (sidecar's /metrics sums them)
    assert sum(o.metrics.get("preemptions", 0) for o in got) == fast.scheduler.preempted
    assert not any("preemptions" in o.metrics for o in want)
    assert fast.block_manager.num_free_blocks == fast.block_manager.num_blocks
    for out in (got_sync, got):  # recompute after preemption: same tokens, logprobs up to summation order
        for a, b in zip(completions(out), completions(want)):
            assert (a[:3], a[5]) == (b[:3], b[5])
            torch.testing.assert_close(torch.tensor(a[3]), torch.tensor(b[3]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("mode", ["hold", "finish"])
def test_sleep_mid_generation(qwen2: Path, mode: str) -> None:
    prompts = random_prompts([5, 9], 300, seed=3)
    params = SamplingParams(temperature=1.0, seed=2, max_tokens=16, ignore_eos=True, logprobs=2)
    results = []
    for async_on in (False, True):
        llm = engine(qwen2, async_on, kv_cache_bytes=2 << 20)
        ids = [llm.add_request(p, params) for p in prompts]
        for _ in range(4):
            llm.step()
        llm.sleep(1, in_flight=mode)
        assert llm.has_unfinished() == (mode == "hold")  # nothing stays in flight across a sleep
        llm.wake_up()
        done = {o.request_id: o for o in llm.take_finished()}
        while llm.has_unfinished():
            done.update((o.request_id, o) for o in llm.step())
        results.append(completions([done[i] for i in ids]))
    for a, b in zip(*results):  # held requests recompute their KV: logprobs up to summation order
        assert (a[:3], a[5]) == (b[:3], b[5])
        torch.testing.assert_close(torch.tensor(a[3]), torch.tensor(b[3]), atol=1e-5, rtol=0)


# ---- the decode graphs -------------------------------------------------------------------------------
def graph_engines(path: Path, dtype: str, monkeypatch: pytest.MonkeyPatch) -> tuple[LLM, LLM, Probe, list[int]]:
    make_hf_checkpoint("qwen2", path, initializer_range=0.2, max_position_embeddings=512)
    kw = {"device": "cuda", "dtype": dtype, "kv_cache_bytes": 64 << 20, "max_num_seqs": 16, "max_model_len": 256}
    sync, fast = (LLM(path, async_scheduling=a, **kw) for a in (False, True))
    assert fast._overlap is not None and sync._overlap is None and fast.worker.runner.graphs is not None
    probe = Probe(fast, monkeypatch)
    replays: list[int] = []
    for graphs in (fast.worker.runner.greedy_graphs, fast.worker.runner.sampling_graphs):
        replay = graphs.replay
        graphs.replay = lambda *a, _r=replay: (replays.append(a[0]), _r(*a))[1]  # type: ignore[method-assign]
    return sync, fast, probe, replays


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_path_async_equals_sync_bit_for_bit(tmp_path: Path, dtype: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows that all end together: both modes run the same batches through the same graphs, so the
    tokens fetched on the device and the pinned read-back must give identical bits."""
    sync, fast, probe, replays = graph_engines(tmp_path, dtype, monkeypatch)
    prompts = random_prompts([3, 17, 9, 30, 5, 12, 21, 8], 300, seed=4)
    for params in (SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
                   SamplingParams(temperature=1.0, top_p=0.95, seed=7, max_tokens=30, n=2, ignore_eos=True,
                                  logprobs=2)):
        want, got = sync.generate(prompts, params), fast.generate(prompts, params)
        assert completions(got) == completions(want)
    assert replays and probe.resolved > 0


@pytest.mark.cuda
def test_graph_path_async_with_stops_equals_sync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Stops mid-batch: async rows of finished sequences are wasted and the batch shrinks a step
    later, so the graphs replay at other sizes: tokens and finish reasons equal, logprobs up to the
    GEMMs' batch-size-dependent rounding (fp32)."""
    sync, fast, probe, replays = graph_engines(tmp_path, "float32", monkeypatch)
    prompts = random_prompts([3, 17, 9, 30, 5, 12, 21, 8], 300, seed=4)
    greedy = [SamplingParams(temperature=0.0, max_tokens=m, stop_token_ids=STOPS[i % 3::3])
              for i, m in enumerate((40, 12, 25, 33, 7, 50, 18, 29))]
    seeded = [SamplingParams(temperature=1.0, top_p=0.95, seed=i, max_tokens=30, n=2, stop_token_ids=STOPS)
              for i in range(8)]
    for params in (greedy, seeded):
        want, got = completions(sync.generate(prompts, params)), completions(fast.generate(prompts, params))
        for a, b in zip(got, want):
            assert (a[:3], a[5:8]) == (b[:3], b[5:8])
            torch.testing.assert_close(torch.tensor(a[3]), torch.tensor(b[3]), atol=1e-4, rtol=0)
    assert replays and probe.resolved > 0 and probe.wasted > 0
