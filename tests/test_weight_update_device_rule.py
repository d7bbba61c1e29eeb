"""Syncs audited by the device rule ("xxh3_64_seg64k"), on the CPU: the sender names the rule in its start
manifest, both ends digest under it (the kernel in Triton's interpreter where forced, python-xxhash on the
host otherwise), and a flipped byte on either side fails the audit naming tensor and rank. The CPU/gloo
default keeps the host rule. The kernel launches are counted, so a test cannot pass on the host path alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from checksum import (
    ALGORITHM,
    DEVICE_ALGORITHM,
    ChecksumMismatch,
    device_digest,
    device_kernels,
    digest_bytes,
    flat_bytes,
)
from inference.core import InvalidRequestError
from inference.models.tiny import make_tiny_model
from inference.transfer.groups import TransferError
from inference.transfer.sender import WeightSender
from tests.helpers_fault import flip_held_after_landing, flipped_on_arrival
from tests.helpers_weight_update import DIMS, Q1, RANK, Link, make_worker, perturbed

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {"target": make_tiny_model(tmp_path_factory.mktemp("wud") / "target", "qwen2", **DIMS)}


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The kernel runs on CPU tensors (Triton's interpreter); each launch appends its segment count."""
    counts: list[int] = []
    real = device_kernels.launch

    def counted(*args: Any, **kwargs: Any) -> None:
        counts.append(args[4].numel())  # `out`: one int64 per segment
        real(*args, **kwargs)

    monkeypatch.setattr(device_kernels, "launch", counted)
    with device_digest.kernel_on_cpu():
        yield counts


def device_link(dirs: dict[str, Path]) -> Link:
    """A CPU worker and a gloo sender that fixes the device rule (CPU tensors would pick the host rule)."""
    return Link(make_worker(dirs, draft=False), digest_algorithm=DEVICE_ALGORITHM)


def python_xxhash(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """The device rule written out by python-xxhash over each tensor's bytes (docs/checksums.md)."""
    return {n: digest_bytes(flat_bytes(t).numpy().tobytes(), DEVICE_ALGORITHM) for n, t in state.items()}


@pytest.mark.slow
def test_a_device_rule_sync_is_audited_by_the_kernel_on_both_ends(dirs: dict[str, Path],
                                                                 launches: list[int]) -> None:
    link = device_link(dirs)
    state = perturbed(dirs["target"], 1)
    assert link.sender.manifest(state, 1)["algorithm"] == DEVICE_ALGORITHM
    result = link.sync(state, 1)
    assert result.report.ok and result.received.algorithm == DEVICE_ALGORITHM
    assert {r.name: r.digest for r in result.received.records} == python_xxhash(state)
    assert len(launches) == 2, "one launch for the sender's tensors, one for the receiver's held regions"
    assert launches[0] == launches[1] == sum(-(-t.numel() * 4 // (64 << 10)) for t in state.values())
    assert link.worker.weights.versions["target"] == 1 and link.worker.weights.is_servable("target")
    # held digests (GET /checksums' rank side) default to the host rule on a CPU rank; asked, they follow
    held = link.worker.weights.held_manifest("target", DEVICE_ALGORITHM)
    assert held.algorithm == DEVICE_ALGORITHM and len(launches) == 3
    assert link.worker.weights.held_manifest("target").algorithm == ALGORITHM and len(launches) == 3


@pytest.mark.slow
def test_a_cpu_receiver_computes_the_device_rule_on_the_host(dirs: dict[str, Path],
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             launches: list[int]) -> None:
    """The sender hashes with the kernel, the receiver (no kernel for it) with python-xxhash: same digests."""
    link = device_link(dirs)
    real = link.sender._digests.launch

    def sender_only(*args: Any, **kwargs: Any) -> Any:
        with device_digest.kernel_on_cpu():
            return real(*args, **kwargs)

    monkeypatch.setattr(link.sender._digests, "launch", sender_only)
    with device_digest.kernel_on_cpu(False):
        result = link.sync(perturbed(dirs["target"], 2), 1)
    assert result.report.ok and result.received.algorithm == DEVICE_ALGORITHM
    assert len(launches) == 1, "only the sender's digests ran on the kernel"


@pytest.mark.slow
def test_a_byte_flipped_on_the_senders_side_fails_naming_tensor_and_rank(dirs: dict[str, Path],
                                                                        monkeypatch: pytest.MonkeyPatch,
                                                                        launches: list[int]) -> None:
    """The trainer writes a tensor after the sender hashed it: the wire carries other bytes."""
    link = device_link(dirs)
    state = perturbed(dirs["target"], 3)
    real = link.sender._digests.launch

    def then_flip(items: Any, *args: Any, **kwargs: Any) -> Any:
        pending = real(items, *args, **kwargs)
        flat_bytes(state[Q1])[:1].bitwise_xor_(1)  # contiguous: a view of the sent tensor
        return pending

    monkeypatch.setattr(link.sender._digests, "launch", then_flip)
    with pytest.raises(ChecksumMismatch) as err:
        link.sync(state, 1)
    first = err.value.report.first_tensor
    assert (first.kind, first.tensor, first.rank) == ("digest", Q1, RANK) and Q1 in str(err.value)
    assert link.worker.weights.torn["target"] and link.worker.weights.versions["target"] == 0


@pytest.mark.slow
def test_a_byte_flipped_in_the_held_weights_fails_naming_tensor_and_rank(dirs: dict[str, Path],
                                                                        launches: list[int],
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    link = device_link(dirs)
    worker = link.worker
    qkv = dict(worker.models["target"].named_parameters())["model.layers.1.self_attn.qkv_proj.weight"]
    flip_held_after_landing(monkeypatch, worker.weights, qkv)  # the first byte of the q rows: Q1
    state = perturbed(dirs["target"], 4)
    worker.weights.start("target", 1, link.sender.manifest(state, 1))
    digests = link.transfer(state)
    with pytest.raises(ChecksumMismatch) as err:
        worker.weights.finish(digests)
    first = err.value.report.first_tensor
    assert (first.kind, first.tensor, first.rank) == ("digest", Q1, RANK)
    assert len(launches) == 2 and worker.weights.torn["target"]


@pytest.mark.slow
def test_a_byte_flipped_on_arrival_fails_under_the_device_rule(dirs: dict[str, Path], launches: list[int]) -> None:
    link = device_link(dirs)
    with flipped_on_arrival(Q1), pytest.raises(ChecksumMismatch, match=f"'{Q1}' on rank {RANK}"):
        link.sync(perturbed(dirs["target"], 5), 1)
    assert link.sync(perturbed(dirs["target"], 6), 2).report.ok  # the next sync repairs it


def test_the_cpu_gloo_path_keeps_the_host_rule(dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    def no_kernel(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("CPU tensors of a default sender never reach the kernel")

    monkeypatch.setattr(device_kernels, "launch", no_kernel)
    link = Link(make_worker(dirs, draft=False))
    state = perturbed(dirs["target"], 7)
    with device_digest.kernel_on_cpu():  # even where the kernel could run on the CPU
        assert link.sender.manifest(state, 1)["algorithm"] == ALGORITHM
        result = link.sync(state, 1)
    assert result.report.ok and result.received.algorithm == ALGORITHM
    assert {r.name: r.digest for r in result.received.records} == {
        n: digest_bytes(flat_bytes(t).numpy().tobytes()) for n, t in state.items()}


def test_finish_digests_of_another_rule_fail_naming_both(dirs: dict[str, Path]) -> None:
    link = Link(make_worker(dirs, draft=False))  # host rule, no kernel needed
    state = perturbed(dirs["target"], 8)
    worker = link.worker
    worker.weights.start("target", 1, {**link.sender.manifest(state, 1), "algorithm": DEVICE_ALGORITHM})
    records = link.transfer(state)  # the sender's own manifest() said ALGORITHM: its records are of it
    with pytest.raises(ChecksumMismatch, match=f"expected {ALGORITHM}, got {DEVICE_ALGORITHM}") as err:
        worker.weights.finish({"algorithm": ALGORITHM, "tensors": [r.__dict__ for r in records]})
    assert err.value.report.first.kind == "algorithm" and worker.weights.torn["target"]
    # Digests that name no rule are the session's; the compact form lists them in manifest order.
    worker.weights.start("target", 2, {**link.sender.manifest(state, 2), "algorithm": DEVICE_ALGORITHM})
    link.transfer(state)
    compact = [python_xxhash(state)[name] for name in state]
    assert worker.weights.finish({"digests": compact}).report.ok


def test_bad_rules_and_digest_lists_name_their_field(dirs: dict[str, Path]) -> None:
    link = Link(make_worker(dirs, draft=False))
    state = perturbed(dirs["target"], 9)
    with pytest.raises(InvalidRequestError) as bad:
        link.worker.weights.start("target", 1, {**link.sender.manifest(state, 1), "algorithm": "xxh3_64k"})
    assert bad.value.field == "manifest.algorithm" and "xxh3_64_seg64k" in str(bad.value)
    with pytest.raises(InvalidRequestError) as unknown:
        WeightSender("gloo", digest_algorithm="md5")
    assert unknown.value.field == "digest_algorithm"
    link.worker.weights.start("target", 1, link.sender.manifest(state, 1))
    link.transfer(state)
    with pytest.raises(InvalidRequestError) as short:
        link.worker.weights.finish({"digests": ["0" * 32]})
    assert short.value.field == "sender_digests.digests"


def test_a_layout_key_stands_for_the_tensors_once_parsed(dirs: dict[str, Path]) -> None:
    link = Link(make_worker(dirs, draft=False))
    state = perturbed(dirs["target"], 10)
    full = link.sender.manifest(state, 1)
    short = {k: v for k, v in full.items() if k != "tensors"}
    with pytest.raises(InvalidRequestError) as unknown:
        link.worker.weights.start("target", 1, short)  # never parsed here: the caller must send the tensors
    assert unknown.value.field == "manifest.layout"
    link.worker.weights.start("target", 1, full)
    link.worker.weights.finish(link.transfer(state))
    parses = link.worker.weights.manifests.parses
    again = link.sender.manifest(state, 2)
    assert again["layout"] == full["layout"]
    link.worker.weights.start("target", 2, {k: v for k, v in again.items() if k != "tensors"})
    assert link.worker.weights.finish(link.transfer(state)).report.ok
    assert link.worker.weights.manifests.parses == parses


@pytest.mark.slow
def test_update_collects_the_held_digest_so_finish_only_compares(dirs: dict[str, Path], launches: list[int]) -> None:
    """The overlapped device digest is collected when update ends (while the sender's digests travel):
    finish launches nothing more, and its received manifest is the one collected."""
    link = device_link(dirs)
    worker = link.worker
    state = perturbed(dirs["target"], 11)
    worker.weights.start("target", 1, link.sender.manifest(state, 1))
    digests = link.transfer(state)
    collected = worker.weights._session.held_received
    assert collected is not None and len(launches) == 2
    result = worker.weights.finish(digests)
    assert result.report.ok and result.received is collected[1] and len(launches) == 2
    assert {r.name: r.digest for r in result.received.records} == python_xxhash(state)


@pytest.mark.slow
def test_a_settled_digest_drops_what_update_collected(dirs: dict[str, Path], launches: list[int]) -> None:
    """settle_digest (what sleep calls) drops the collected records too: finish digests the bytes held
    after it, so a byte changed meanwhile fails the audit naming tensor and rank."""
    link = device_link(dirs)
    worker = link.worker
    state = perturbed(dirs["target"], 12)
    worker.weights.start("target", 1, link.sender.manifest(state, 1))
    digests = link.transfer(state)
    worker.weights.settle_digest()
    assert worker.weights._session.held_received is None
    qkv = dict(worker.models["target"].named_parameters())["model.layers.1.self_attn.qkv_proj.weight"]
    qkv.detach().view(-1)[:1].view(torch.uint8)[:1].bitwise_xor_(1)  # the first byte of the q rows: Q1
    with pytest.raises(ChecksumMismatch) as err:
        worker.weights.finish(digests)
    first = err.value.report.first_tensor
    assert (first.kind, first.tensor, first.rank) == ("digest", Q1, RANK) and len(launches) == 3


@pytest.mark.slow
def test_the_sender_launches_its_digest_before_the_agreement(dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
                                                             launches: list[int]) -> None:
    """The receivers are still on their way to the agreement when send() starts: the sender's launch runs
    then, not after it. A refused agreement waits for that digest before send() raises."""
    link = device_link(dirs)
    group = link.sender._group
    real = group.agree_many
    at_agreement: list[int] = []

    def agree_many(*args: Any, **kwargs: Any) -> Any:
        at_agreement.append(len(launches))
        return real(*args, **kwargs)

    monkeypatch.setattr(group, "agree_many", agree_many)
    assert link.sync(perturbed(dirs["target"], 13), 1).report.ok
    assert at_agreement == [1], "the sender's launch came before its agreement"
    settled: list[bool] = []
    real_launch = link.sender._digests.launch

    def watched(*args: Any, **kwargs: Any) -> Any:
        pending = real_launch(*args, **kwargs)
        real_settle = pending.settle
        pending.settle = lambda: (settled.append(True), real_settle())[1]
        return pending

    monkeypatch.setattr(link.sender._digests, "launch", watched)
    state = perturbed(dirs["target"], 14)
    link.sender.manifest(state, 2)
    with ThreadPoolExecutor(1) as pool:
        sending = pool.submit(link.sender.send, state)
        link.worker.weights.receiver.refuse()  # the agreement every end fails cleanly
        with pytest.raises(TransferError, match="plan differs"):
            sending.result(timeout=60)
    assert settled == [True]
