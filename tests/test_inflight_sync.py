"""Requests in flight at a weight sync (in-process LLM on the CPU, syncs over gloo from a sender on this
process): every token's recorded versions (target and draft) are the weights that produced it, checked
by replaying its prefix, greedy, on a fresh engine loaded with that version's checkpoint; on_sync
"keep", "recompute" and "abort" do what they promise; max_staleness restarts what became too stale; no
step runs while a sync writes; every request is returned exactly once in every mode."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from checksum import ChecksumMismatch
from inference.core import InvalidRequestError, RequestOutput, SamplingParams
from inference.engine.llm import LLM
from inference.models.loader import iter_hf_tensors
from inference.models.tiny import make_tiny_model
from tests.helpers_weight_update import DIMS, Q1, Link

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
PROMPTS = [[3, 17, 42, 7], [5, 9, 11, 13, 2, 8], [60, 61]]
SYNC_AFTER = 5  # tokens each request has when the sync lands (at least)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """v0: the served checkpoint; v1: another checkpoint of the same shapes (a different seed), so the two
    versions continue a prefix differently; draft (llama) and draft1 (the draft, perturbed)."""
    root = tmp_path_factory.mktemp("inflight")
    return {"v0": make_tiny_model(root / "v0", "qwen2", **DIMS),
            "v1": make_tiny_model(root / "v1", "qwen2", seed=1, **DIMS),
            "draft": make_tiny_model(root / "draft", "llama", seed=2, **DIMS),
            "draft1": make_tiny_model(root / "draft1", "llama", seed=3, **DIMS)}


def state(model_dir: Path) -> dict[str, torch.Tensor]:
    return dict(iter_hf_tensors(model_dir))


def engine(model_dir: Path, **options: object) -> LLM:
    return LLM(str(model_dir), device="cpu", dtype="float32", kv_cache_bytes=2_000_000, **options)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def refs(dirs: dict[str, Path]) -> Iterator[dict[int, LLM]]:
    """Fresh engines holding each version, by the version number the tests sync it as."""
    v0, v1 = engine(dirs["v0"]), engine(dirs["v1"])
    yield {0: v0, 1: v1, 2: v0}  # version 2 syncs v0's weights back


class Run:
    """An engine, its sender, every output collected (in step() and take_finished()) and the target
    version live when each came back."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.link = Link(llm.worker)
        self.outputs: list[RequestOutput] = []
        self.returned_at: dict[str, int] = {}

    def collect(self, outs: list[RequestOutput]) -> None:
        self.outputs += outs
        self.returned_at.update((o.request_id, self.llm.weight_version) for o in outs)

    def add(self, **policy: object) -> list[str]:
        return [self.llm.add_request(p, GREEDY, **policy) for p in PROMPTS]  # type: ignore[arg-type]

    def step_until(self, tokens: int) -> None:
        """Step until every running request has `tokens` committed tokens."""
        sched = self.llm.scheduler
        while any(s.num_generated - s.num_pending < tokens for s in sched.running + list(sched.waiting)):
            self.collect(self.llm.step())

    def sync(self, model_dir: Path, version: int, which: str = "target") -> None:
        self.link.sync(state(model_dir), version, which)
        self.collect(self.llm.take_finished())

    def finish(self, ids: list[str]) -> dict[str, RequestOutput]:
        while self.llm.has_unfinished():
            self.collect(self.llm.step())
        self.collect(self.llm.take_finished())
        got = [o.request_id for o in self.outputs]
        assert sorted(got) == sorted(ids), f"lost or returned twice: {got} for {ids}"
        return {o.request_id: o for o in self.outputs}


def version_at(spans: list[tuple[int, int]], i: int) -> int:
    return [v for start, v in spans if start <= i][-1]


def check_replay(outs: dict[str, RequestOutput], refs: dict[int, LLM]) -> None:
    """Each token equals what a fresh engine holding its recorded version produces for its prefix."""
    by_version: dict[int, list[tuple[list[int], int]]] = {}
    for o in outs.values():
        c = o.outputs[0]
        assert c.weight_version_spans[0][0] == 0 and len(c.token_ids) == GREEDY.max_tokens
        for i, token in enumerate(c.token_ids):
            by_version.setdefault(version_at(c.weight_version_spans, i), []).append(
                (o.prompt_token_ids + c.token_ids[:i], token))
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for version, cases in by_version.items():
        replayed = refs[version].generate([p for p, _ in cases], one)
        assert [r.outputs[0].token_ids[0] for r in replayed] == [t for _, t in cases], f"version {version}"


def greedy(ref: LLM, prompt: list[int], max_tokens: int) -> list[int]:
    return ref.generate(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))[0] \
        .outputs[0].token_ids


@pytest.mark.parametrize("overlap", [False, True], ids=["sync-steps", "async-steps"])
@pytest.mark.slow
def test_recompute_continues_as_a_fresh_request_under_the_new_weights(dirs: dict[str, Path],
                                                                      refs: dict[int, LLM], overlap: bool) -> None:
    run = Run(engine(dirs["v0"], async_scheduling=overlap))
    assert refs[0].generate(PROMPTS[0], GREEDY)[0].outputs[0].token_ids != \
        refs[1].generate(PROMPTS[0], GREEDY)[0].outputs[0].token_ids, "the two versions must differ"
    ids = run.add(on_sync="recompute")
    run.step_until(SYNC_AFTER)
    before = {s.request_id: s.num_generated for s in run.llm.scheduler.running}
    run.sync(dirs["v1"], 1)
    sched = run.llm.scheduler
    assert not sched.running and all(s.num_computed_tokens == 0 for s in sched.waiting)  # KV to recompute
    outs = run.finish(ids)
    for rid, o in outs.items():
        c = o.outputs[0]
        k = before[rid]
        assert c.weight_version_spans == [(0, 0), (k, 1)] and o.weight_version == 0 and c.restarts == 0
        assert c.token_ids[:k] == greedy(refs[0], o.prompt_token_ids, k)
        assert c.token_ids[k:] == greedy(refs[1], o.prompt_token_ids + c.token_ids[:k], GREEDY.max_tokens - k)
        assert c.token_versions() == [0] * k + [1] * (GREEDY.max_tokens - k)
    check_replay(outs, refs)


@pytest.mark.slow
def test_abort_restarts_from_the_prompt_under_the_new_weights_once(dirs: dict[str, Path],
                                                                   refs: dict[int, LLM]) -> None:
    run = Run(engine(dirs["v0"]))
    ids = run.add(on_sync="abort")
    run.step_until(SYNC_AFTER)
    run.sync(dirs["v1"], 1)
    assert all(s.num_generated == 0 and not s.block_table for s in run.llm.scheduler.waiting)
    outs = run.finish(ids)
    for o in outs.values():
        c = o.outputs[0]
        assert c.weight_version_spans == [(0, 1)] and o.weight_version == 1 and c.restarts == 1
        assert c.token_ids == greedy(refs[1], o.prompt_token_ids, GREEDY.max_tokens)
    check_replay(outs, refs)


def test_keep_continues_on_its_kv_with_the_new_weights(dirs: dict[str, Path], refs: dict[int, LLM]) -> None:
    run = Run(engine(dirs["v0"]))
    ids = run.add(on_sync="keep")
    run.step_until(SYNC_AFTER)
    held = {s.request_id: (s.num_generated, s.num_computed_tokens, list(s.block_table))
            for s in run.llm.scheduler.running}
    run.sync(dirs["v1"], 1)
    after = {s.request_id: (s.num_generated, s.num_computed_tokens, list(s.block_table))
             for s in run.llm.scheduler.running}
    assert after == held and len(held) == len(ids)  # still running on the KV it had: nothing recomputed
    outs = run.finish(ids)
    for rid, o in outs.items():
        c = o.outputs[0]
        k = held[rid][0]
        assert c.weight_version_spans == [(0, 0), (k, 1)] and c.restarts == 0
        assert c.token_ids[:k] == greedy(refs[0], o.prompt_token_ids, k)  # the old weights' tokens


def test_keep_with_a_change_the_kv_does_not_depend_on_matches_the_new_version(dirs: dict[str, Path]) -> None:
    """A sync that changes only the (untied) LM head leaves every KV entry what the new version computes,
    so a kept request's tokens after the sync are exactly the new version's: keep used the new weights."""
    base = state(dirs["draft"])
    head = dict(base, **{"lm_head.weight": state(dirs["draft1"])["lm_head.weight"]})
    run, ref_new, ref_old = Run(engine(dirs["draft"])), engine(dirs["draft"]), engine(dirs["draft"])
    Link(ref_new.worker).sync(head, 1)
    ids = run.add(on_sync="keep")
    run.step_until(SYNC_AFTER)
    run.link.sync(head, 1)
    outs = run.finish(ids)
    changed = False
    for o in outs.values():
        c = o.outputs[0]
        k = c.weight_version_spans[1][0]
        assert c.token_ids[:k] == greedy(ref_old, o.prompt_token_ids, k)
        assert c.token_ids[k:] == greedy(ref_new, o.prompt_token_ids + c.token_ids[:k], GREEDY.max_tokens - k)
        changed |= c.token_ids[k:] != greedy(ref_old, o.prompt_token_ids + c.token_ids[:k], GREEDY.max_tokens - k)
    assert changed, "the new head changed no continuation: the test shows nothing"


@pytest.mark.slow
def test_max_staleness_restarts_what_the_sync_made_too_stale(dirs: dict[str, Path], refs: dict[int, LLM]) -> None:
    """max_staleness=1: the first sync (one version behind) keeps the request, the second (two behind
    its oldest token) restarts it from the prompt; an unbounded request beside it keeps every token."""
    run = Run(engine(dirs["v0"]))
    bounded = run.llm.add_request(PROMPTS[0], GREEDY, on_sync="keep", max_staleness=1)
    free = run.llm.add_request(PROMPTS[1], GREEDY, on_sync="recompute")
    run.step_until(3)
    run.sync(dirs["v1"], 1)
    seqs = {s.request_id: s for s in run.llm.scheduler.running + list(run.llm.scheduler.waiting)}
    assert seqs[bounded].restarts == 0 and seqs[bounded].num_generated >= 3
    run.step_until(6)
    run.sync(dirs["v0"], 2)
    assert seqs[bounded].restarts == 1 and seqs[bounded].num_generated == 0
    outs = run.finish([bounded, free])
    assert outs[bounded].outputs[0].weight_version_spans == [(0, 2)]
    assert outs[bounded].outputs[0].token_ids == greedy(refs[2], PROMPTS[0], GREEDY.max_tokens)
    spans = outs[free].outputs[0].weight_version_spans
    assert [v for _, v in spans] == [0, 1, 2] and outs[free].outputs[0].restarts == 0
    check_replay({free: outs[free]}, refs)


def test_no_step_runs_while_a_sync_writes_and_the_audit_comes_first(dirs: dict[str, Path]) -> None:
    """Between the start of a sync and its passed audit no step runs (no token from a mix of old and new
    bytes); the first token after it is tagged with the new version."""
    run = Run(engine(dirs["v0"], async_scheduling=True))
    ids = run.add(on_sync="keep")
    run.step_until(2)
    weights = run.llm.worker.weights
    new = state(dirs["v1"])
    weights.start("target", 1, run.link.sender.manifest(new, 1))
    assert run.llm.scheduler.in_flight == 0  # the start settled the step in flight
    tokens = {s.seq_id: s.num_tokens for s in run.llm.scheduler.running}
    assert run.llm.step() == [] and {s.seq_id: s.num_tokens for s in run.llm.scheduler.running} == tokens
    digests = run.link.transfer(new)
    assert run.llm.step() == [] and {s.seq_id: s.num_tokens for s in run.llm.scheduler.running} == tokens
    weights.finish(digests)
    outs = run.finish(ids)
    assert all(o.outputs[0].weight_version_spans[-1][1] == 1 for o in outs.values())


@pytest.mark.slow
def test_draft_versions_are_recorded_beside_the_targets(dirs: dict[str, Path]) -> None:
    run = Run(engine(dirs["v0"], draft_model=str(dirs["draft"]), num_speculative_tokens=2))
    ids = run.add(on_sync="keep")
    run.step_until(4)
    k = {s.request_id: s.num_generated for s in run.llm.scheduler.running}
    run.sync(dirs["draft1"], 7, which="draft")
    outs = run.finish(ids)
    for rid, o in outs.items():
        c = o.outputs[0]
        assert c.weight_version_spans == [(0, 0)] and c.draft_version_spans == [(0, 0), (k[rid], 7)]
        assert c.token_versions(draft=True) == [0] * k[rid] + [7] * (GREEDY.max_tokens - k[rid])
    plain = engine(dirs["v0"]).generate(PROMPTS, GREEDY)
    assert all(o.outputs[0].draft_version_spans == [] for o in plain)  # no draft: no draft spans


def test_a_bad_policy_is_refused_naming_its_field(dirs: dict[str, Path], refs: dict[int, LLM]) -> None:
    with pytest.raises(InvalidRequestError) as e:
        refs[0].add_request([1, 2], GREEDY, on_sync="later")  # type: ignore[arg-type]
    assert e.value.field == "on_sync"
    with pytest.raises(InvalidRequestError) as e:
        refs[0].generate([1, 2], GREEDY, max_staleness=-1)
    assert e.value.field == "max_staleness"
    with pytest.raises(InvalidRequestError) as e:
        engine(dirs["v0"], on_sync="sometimes")
    assert e.value.field == "on_sync"
    assert not refs[0].has_unfinished()


@pytest.mark.slow
def test_colocated_a_sync_while_requests_are_held_through_a_sleep(dirs: dict[str, Path],
                                                                   refs: dict[int, LLM]) -> None:
    """Colocated: sleep(in_flight="hold") drops every KV, so after the wake and the sync "keep" has no KV
    to keep and continues as "recompute" does (a fresh request's continuation under the new weights);
    "abort" restarts from its prompt. Each request comes back once."""
    run = Run(engine(dirs["v0"]))
    modes = {run.llm.add_request(p, GREEDY, on_sync=m): m for p, m in zip(PROMPTS, ["keep", "recompute", "abort"])}
    run.step_until(SYNC_AFTER)
    k = {s.request_id: s.num_generated for s in run.llm.scheduler.running}
    run.llm.sleep(1, in_flight="hold")
    run.llm.wake_up()
    run.sync(dirs["v1"], 1)
    outs = run.finish(list(modes))
    for rid, mode in modes.items():
        o, c = outs[rid], outs[rid].outputs[0]
        if mode == "abort":
            assert c.weight_version_spans == [(0, 1)] and c.restarts == 1
            assert c.token_ids == greedy(refs[1], o.prompt_token_ids, GREEDY.max_tokens)
        else:
            assert c.weight_version_spans == [(0, 0), (k[rid], 1)] and c.restarts == 0
            assert c.token_ids[k[rid]:] == greedy(refs[1], o.prompt_token_ids + c.token_ids[:k[rid]],
                                                  GREEDY.max_tokens - k[rid])
    check_replay(outs, refs)


@pytest.mark.parametrize("draft", [False, True], ids=["plain", "draft"])
@pytest.mark.slow
def test_repeated_syncs_over_a_sampled_batch_lose_nothing_and_bound_staleness(dirs: dict[str, Path],
                                                                              draft: bool) -> None:
    """Three syncs land while 9 sampled requests (n=2, each mode, some with max_staleness) run with async
    steps: every request comes back once with all its tokens; spans start at 0 and grow in both index
    and version; a bounded request's oldest version is within its bound of the version live when it
    came back."""
    options: dict[str, object] = {"async_scheduling": True, "max_num_seqs": 32}
    if draft:
        options.update(draft_model=str(dirs["draft"]), num_speculative_tokens=2)
    run = Run(engine(dirs["v0"], **options))
    params = SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=24, ignore_eos=True)
    policies = [{"on_sync": m, "max_staleness": b} for m in ("keep", "recompute", "abort") for b in (None, 0, 1)]
    ids = {run.llm.add_request([7 + i, 3, 9, i], params, **p): p for i, p in enumerate(policies)}  # type: ignore[arg-type]
    for version, (tokens, model) in enumerate([(3, "v1"), (7, "v0"), (12, "v1")], start=1):
        run.step_until(tokens)
        run.sync(dirs[model], version)
    outs = run.finish(list(ids))
    for rid, o in outs.items():
        returned_at = run.returned_at[rid]
        for c in o.outputs:
            spans = c.weight_version_spans
            assert len(c.token_ids) == params.max_tokens and spans[0][0] == 0, (rid, c)
            assert all(a[0] < b[0] and a[1] < b[1] for a, b in itertools.pairwise(spans)), spans
            bound = ids[rid]["max_staleness"]
            if bound is not None:
                assert spans[0][1] >= returned_at - bound, (rid, spans, returned_at)
            if ids[rid]["on_sync"] == "abort":
                assert len(spans) == 1, spans
            assert (c.draft_version_spans != []) == draft
    strict = [c for rid, o in outs.items() if ids[rid] == {"on_sync": "keep", "max_staleness": 0} for c in o.outputs]
    assert strict and all(c.restarts >= 1 for c in strict)  # each sync found them mid-generation


@pytest.mark.slow
def test_a_failed_audit_mid_generation_changes_no_request_until_a_good_sync(dirs: dict[str, Path],
                                                                            refs: dict[int, LLM]) -> None:
    """All or nothing: a sync whose audit fails leaves the model torn and every request as it was (no
    token from the torn bytes, nothing recomputed, restarted or lost); the next good sync applies the
    modes, and the recompute request then continues as a fresh request under that version."""
    run = Run(engine(dirs["v0"]))
    ids = run.add(on_sync="recompute")
    run.step_until(SYNC_AFTER)
    seqs = list(run.llm.scheduler.running)
    before = [(s.status, list(s.token_ids), list(s.block_table), s.num_computed_tokens) for s in seqs]
    new = state(dirs["v1"])
    weights = run.llm.worker.weights
    weights.start("target", 1, run.link.sender.manifest(new, 1))
    digests = [r for r in run.link.transfer(new) if r.name != Q1]
    with pytest.raises(ChecksumMismatch):
        weights.finish(digests)
    assert weights.torn["target"] and run.llm.weight_version == 0
    assert run.llm.step() == [] and run.llm.take_finished() == []
    assert [(s.status, list(s.token_ids), list(s.block_table), s.num_computed_tokens) for s in seqs] == before
    k = {s.request_id: s.num_generated for s in seqs}
    run.sync(dirs["v1"], 2)
    outs = run.finish(ids)
    for rid, o in outs.items():
        c = o.outputs[0]
        assert c.weight_version_spans == [(0, 0), (k[rid], 2)] and c.restarts == 0
        assert c.token_ids[k[rid]:] == greedy(refs[1], o.prompt_token_ids + c.token_ids[:k[rid]],
                                              GREEDY.max_tokens - k[rid])
