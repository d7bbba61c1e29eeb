"""Weight updates over gloo on the CPU: a sender holding HF-named weights syncs into a receiver Worker.

After a sync the receiver's parameters must equal what the loader makes of the same weights; bad
manifests are refused before a byte changes; a flipped byte fails the audit naming tensor and rank;
In-process tests run the sender on a thread (it never touches torch.distributed's global state); the
dead-sender and TP=2 tests, with real processes, are in tests/test_weight_update_processes.py.
"""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from checksum import ChecksumMismatch
from inference.core import InvalidRequestError, SamplingParams, StateError
from inference.engine.llm import LLM
from inference.transfer.groups import TransferError
from tests.helpers_fault import flipped_on_arrival
from tests.helpers_weight_update import Q1, RANK, Link, held, loader_digests, make_worker, perturbed, tiny_model_dirs


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return tiny_model_dirs(tmp_path_factory.mktemp("wu"))


def test_sync_makes_the_target_what_the_loader_makes_and_leaves_the_draft(dirs: dict[str, Path],
                                                                         tmp_path: Path) -> None:
    worker = make_worker(dirs)
    draft_before = held(worker, "draft")
    link = Link(worker)
    for version, seed in ((1, 10), (2, 11)):  # the second sync reuses the group and the buffers
        state = perturbed(dirs["target"], seed)
        result = link.sync(state, version, held_manifest=version == 2)
        assert result.report.ok and result.version == version and result.rank == RANK
        assert held(worker) == loader_digests(dirs["target"], state, tmp_path / f"ref{version}")
        assert [r.name for r in result.received.records] == sorted(state)
        if version == 1:
            assert result.held is None  # nobody asked for the second pass over every byte
        else:
            assert {f"{RANK}:{r.name}": r.digest for r in result.held.records} == held(worker)
    assert worker.weights.versions == {"target": 2, "draft": 0}
    assert worker.weights.is_servable("target") and worker.weights.is_servable("draft")
    assert held(worker, "draft") == draft_before


def test_draft_only_update_leaves_the_target_untouched(dirs: dict[str, Path], tmp_path: Path) -> None:
    worker = make_worker(dirs)
    target_before = held(worker)
    assert worker.weights.has_draft
    state = perturbed(dirs["draft"], 20)
    Link(worker).sync(state, 7, which="draft")
    assert held(worker, "draft") == loader_digests(dirs["draft"], state, tmp_path / "ref")
    assert held(worker) == target_before
    assert worker.weights.versions == {"target": 0, "draft": 7}


def test_draft_update_without_a_draft_model_is_refused(dirs: dict[str, Path]) -> None:
    worker = make_worker(dirs, draft=False)
    link = Link(worker)
    assert not worker.weights.has_draft
    with pytest.raises(InvalidRequestError, match=f"rank {RANK}: no draft model"):
        worker.weights.start("draft", 1, link.sender.manifest(perturbed(dirs["draft"], 1), 1))


def _unknown(m: list[dict]) -> str:
    m.append({"name": "model.layers.0.mlp.extra.weight", "dtype": "float32", "shape": [4]})
    return m[-1]["name"]


def _shape(m: list[dict]) -> str:
    t = next(t for t in m if t["name"] == Q1)
    t["shape"] = [t["shape"][0] + 1, t["shape"][1]]
    return Q1


def _dtype(m: list[dict]) -> str:
    m[3]["dtype"] = "bfloat16"
    return m[3]["name"]


def _missing(m: list[dict]) -> str:
    return m.pop(5)["name"]


def _duplicate(m: list[dict]) -> str:
    m.append(dict(m[2]))
    return m[2]["name"]


@pytest.mark.parametrize("corrupt", [_unknown, _shape, _dtype, _missing, _duplicate])
def test_bad_manifest_is_refused_before_anything_changes(dirs: dict[str, Path], corrupt: Any) -> None:
    worker = make_worker(dirs)
    link = Link(worker)
    before = held(worker)
    state = perturbed(dirs["target"], 30)
    tensors = link.sender.manifest(state, 1)["tensors"]
    name = corrupt(tensors)
    with pytest.raises(InvalidRequestError) as err:
        worker.weights.start("target", 1, {"version": 1, "tensors": tensors})
    assert err.value.field == name and f"rank {RANK}" in str(err.value)
    assert held(worker) == before
    assert worker.weights.is_servable("target") and not worker.weights.torn["target"]
    assert link.sync(state, 1).report.ok  # no session was left open; the group still works


def test_cast_only_when_allowed(dirs: dict[str, Path], tmp_path: Path) -> None:
    worker = make_worker(dirs)
    link = Link(worker)
    state = perturbed(dirs["target"], 40, torch.float16)
    with pytest.raises(InvalidRequestError, match="allow_cast"):
        worker.weights.start("target", 1, link.sender.manifest(state, 1))
    result = link.sync(state, 1, allow_cast=True)
    assert result.report.ok and {r.dtype for r in result.received.records} == {"float16"}
    assert held(worker) == loader_digests(dirs["target"], state, tmp_path / "ref")


def test_tied_lm_head_is_accepted_skipped_and_must_equal_the_embedding(dirs: dict[str, Path]) -> None:
    worker = make_worker(dirs)
    link = Link(worker)
    state = perturbed(dirs["target"], 50)
    embed = state["model.embed_tokens.weight"]
    assert link.sync({**state, "lm_head.weight": embed.clone()}, 1).report.ok
    liar = {**state, "lm_head.weight": embed + 1.0}
    with pytest.raises(ChecksumMismatch, match=f"'lm_head.weight' on rank {RANK}"):
        link.sync(liar, 2)
    params = dict(worker.models["target"].named_parameters())
    assert torch.equal(params["model.embed_tokens.weight"], embed), "lm_head overwrote the embedding"
    assert worker.weights.torn["target"] and worker.weights.versions["target"] == 1


@pytest.mark.parametrize("name", [Q1, "model.embed_tokens.weight"])  # fused; split over buckets
def test_flipped_byte_fails_the_audit_naming_tensor_and_rank(dirs: dict[str, Path], name: str) -> None:
    worker = make_worker(dirs)
    link = Link(worker)
    with flipped_on_arrival(name), pytest.raises(ChecksumMismatch) as err:
        link.sync(perturbed(dirs["target"], 60), 1)
    first = err.value.report.first_tensor
    assert (first.kind, first.tensor, first.rank) == ("digest", name, RANK)
    assert name in str(err.value) and RANK in str(err.value)
    weights = worker.weights
    assert weights.torn["target"] and not weights.is_servable("target") and weights.versions["target"] == 0
    assert link.sync(perturbed(dirs["target"], 61), 2).report.ok
    assert worker.weights.is_servable("target") and worker.weights.versions["target"] == 2


def test_audit_fails_on_a_tensor_the_sender_did_not_vouch_for(dirs: dict[str, Path]) -> None:
    worker = make_worker(dirs)
    link = Link(worker)
    state = perturbed(dirs["target"], 65)
    worker.weights.start("target", 1, link.sender.manifest(state, 1))
    digests = [r for r in link.transfer(state) if r.name != Q1]
    with pytest.raises(ChecksumMismatch) as err:
        worker.weights.finish(digests)
    first = err.value.report.first_tensor
    assert (first.kind, first.tensor, first.rank) == ("extra", Q1, RANK)
    assert worker.weights.torn["target"] and worker.weights.versions["target"] == 0


def test_a_repeated_manifest_is_parsed_and_routed_once_until_it_or_the_model_changes(
        dirs: dict[str, Path], tmp_path: Path) -> None:
    worker = make_worker(dirs, draft=False)
    link = Link(worker)
    for version in (1, 2):
        assert link.sync(perturbed(dirs["target"], 80 + version), version).report.ok
    assert (worker.weights.manifests.parses, worker.weights.manifests.hits, worker.weights.routings_built) == (1, 1, 1)

    qkv = worker.models["target"].model.layers[0].self_attn.qkv_proj
    qkv.weight.data = qkv.weight.data.clone()  # new storage: the cached regions point at the old one
    state = perturbed(dirs["target"], 83)
    assert link.sync(state, 3).report.ok and worker.weights.routings_built == 2
    assert held(worker) == loader_digests(dirs["target"], state, tmp_path / "ref3")
    qkv.bias = torch.nn.Parameter(qkv.bias.detach().clone(), requires_grad=False)  # a new Parameter, same module
    qkv.bias.weight_loader = qkv.weight.weight_loader
    state = perturbed(dirs["target"], 84)
    assert link.sync(state, 4).report.ok and worker.weights.routings_built == 3
    assert held(worker) == loader_digests(dirs["target"], state, tmp_path / "ref4")
    assert worker.weights.manifests.parses == 1

    bad = link.sender.manifest(state, 5)
    bad["tensors"][0]["shape"] = [1, 2]  # a changed manifest is parsed and validated afresh
    with pytest.raises(InvalidRequestError, match="shape"):
        worker.weights.start("target", 5, bad)
    with pytest.raises(InvalidRequestError, match="shape"):  # and refused again, never served from a cache
        worker.weights.start("target", 5, bad)
    assert worker.weights.manifests.parses == 2 and worker.weights.routings_built == 3
    assert link.sync(state, 5).report.ok and worker.weights.manifests.parses == 2


def test_session_state_rules(dirs: dict[str, Path]) -> None:
    worker = make_worker(dirs)
    state = perturbed(dirs["target"], 70)
    with pytest.raises(StateError, match="init_weight_transfer_engine"):
        worker.weights.start("target", 1, [])
    link = Link(worker)
    manifest = link.sender.manifest(state, 1)
    with pytest.raises(StateError, match="without a matching start"):
        worker.weights.update()
    with pytest.raises(StateError, match="without a matching start"):
        worker.weights.finish([])
    worker.weights.start("target", 1, manifest)
    with pytest.raises(StateError, match="is open"):
        worker.weights.start("draft", 1, manifest)
    with pytest.raises(StateError, match="session is open"):
        worker.weights.reset()
    assert not worker.weights.is_servable("target") and worker.weights.is_servable("draft")
    digests = link.transfer(state)  # the first session is intact and completes
    with pytest.raises(StateError, match="twice"):
        worker.weights.update()
    assert worker.weights.torn["target"], "a session that failed after writing leaves the model torn"
    with pytest.raises(StateError, match="without a matching start"):
        worker.weights.finish(digests)
    worker.weights.start("target", 2, link.sender.manifest(state, 2))
    with pytest.raises(StateError, match="before update_weights"):
        worker.weights.finish(digests)
    assert link.sync(state, 3).report.ok and worker.weights.is_servable("target")


def test_disagreeing_ends_stop_before_writing_and_the_group_survives(dirs: dict[str, Path]) -> None:
    worker = make_worker(dirs)
    link = Link(worker)
    state = perturbed(dirs["target"], 80)
    before = held(worker)
    worker.weights.start("target", 5, link.sender.manifest(state, 5))
    link.sender.manifest(state, 6)  # the trainer moved on to another version
    with pytest.raises(TransferError, match="plan"):
        link.transfer(state)
    link.sender.manifest(state, 6)
    worker.weights.start("target", 6, link.sender.manifest(state, 6))
    with pytest.raises((TransferError, InvalidRequestError)):  # send() got other tensors than announced
        link.transfer({n: t.double() for n, t in state.items()})
    assert held(worker) == before and not worker.weights.torn["target"]
    assert link.sync(state, 6).report.ok


def test_new_init_replaces_the_old_group_and_abandons_its_session(dirs: dict[str, Path]) -> None:
    worker = make_worker(dirs)
    old = Link(worker, timeout_s=3.0)
    state = perturbed(dirs["target"], 85)
    assert old.sync(state, 1).report.ok
    worker.weights.start("target", 2, old.sender.manifest(state, 2))
    new = Link(worker)  # e.g. the trainer restarted: its old group must not linger
    assert worker.weights.is_servable("target"), "no byte moved in the abandoned session: not torn"
    with pytest.raises(TransferError):
        old.sender.send(state)  # nobody listens on the old group any more
    assert new.sync(state, 2).report.ok and worker.weights.versions["target"] == 2
    info = new.sender.init_info()
    with ThreadPoolExecutor(1) as pool:  # the same sender re-inits the same worker: a fresh session
        connecting = pool.submit(new.sender.connect)
        worker.weights.init_transfer(info)
        connecting.result(timeout=30)
    assert new.sync(state, 3).report.ok


@pytest.mark.slow
def test_update_needs_awake_weights_and_refills_a_level_2_sleep(dirs: dict[str, Path], tmp_path: Path) -> None:
    worker = make_worker(dirs, draft=False)  # with a draft, both models would need a sync
    link = Link(worker)
    state = perturbed(dirs["target"], 87)
    manifest = link.sender.manifest(state, 1)
    for level in (1, 2):
        worker.sleep(level)
        with pytest.raises(StateError, match="asleep"):
            worker.weights.start("target", 1, manifest)
        worker.wake_up()
    assert not worker.is_ready(), "level 2 dropped the weights: nothing to serve until a sync"
    assert link.sync(state, 1).report.ok
    assert worker.is_ready() and worker.weights.is_servable("target")
    assert held(worker) == loader_digests(dirs["target"], state, tmp_path / "ref")


def test_reset_weights_then_sync(dirs: dict[str, Path]) -> None:
    worker = make_worker(dirs)
    link = Link(worker)
    worker.weights.reset("target")
    assert not worker.weights.is_servable("target") and not worker.weights.loaded["target"]
    assert all(p.count_nonzero() == 0 for p in worker.models["target"].parameters())
    link.sync(perturbed(dirs["target"], 90), 1)
    assert worker.weights.is_servable("target") and worker.weights.loaded["target"]


def test_an_in_process_llm_refuses_an_older_version_naming_model_and_versions(dirs: dict[str, Path]) -> None:
    """Versions only grow in the engine itself (the WeightUpdater), not only behind the sidecar: an
    in-process LLM at version 3 refuses 3 and 2, naming the model and both versions, and changes nothing."""
    llm = LLM(str(dirs["target"]), device="cpu", dtype="float32", kv_cache_bytes=1 << 20)
    link = Link(llm.worker)
    state = perturbed(dirs["target"], 30)
    assert link.sync(state, 3).report.ok and llm.weight_version == 3
    for stale in (3, 2):
        with pytest.raises(InvalidRequestError) as e:
            llm.start_weight_update(stale, link.sender.manifest(state, stale))
        assert e.value.field == "version"
        assert f"{stale} is not newer than the live target version 3" in e.value.message, e.value.message
    for bad in (-1, 2**63, True, "4"):
        with pytest.raises(InvalidRequestError, match="must be an integer"):
            llm.start_weight_update(bad, link.sender.manifest(state, 4))  # type: ignore[arg-type]
    assert llm.weight_version == 3 and not llm.worker.weights.state("target")["session_open"]
    assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0))[0].weight_version == 3


@pytest.mark.slow
def test_sender_imports_no_engine_module() -> None:
    code = ("import sys, inference.transfer.sender\n"
            "bad = [m for m in sys.modules if m.split('.')[:2] in (['inference', 'models'], ['inference', 'llm'],"
            " ['inference', 'worker'], ['inference', 'loader'], ['inference', 'naming'], ['inference', 'runner'])]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parent.parent)
