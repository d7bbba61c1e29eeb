"""Delta syncs of full weights, in one process (a Worker and a WeightSender over gloo): the encodings
round-trip bit for bit; after a full sync only what changed moves and the audit of the full tensors
passes; a flipped byte of a delta fails the audit naming the tensor, and the next sync is full; a rank
that slept at level 2 or holds another version gets a full sync. Real processes: test_delta_processes.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from checksum import ChecksumMismatch
from inference.transfer import delta_codec as delta_module
from inference.transfer.delta_codec import DENSE, INDEX, RUNS, UNCHANGED, DeltaLayout, apply_delta, bits, encode
from inference.transfer.plan import TensorSpec
from tests.helpers_fault import flip_delta_values
from tests.helpers_weight_update import Link, make_worker, perturbed, sparse_step, tiny_model_dirs

FLIPPED = "model.layers.1.mlp.down_proj.weight"


@pytest.mark.parametrize("pattern, expected", [("none", UNCHANGED), ("scattered", INDEX), ("blocks", RUNS),
                                               ("all", DENSE)])
def test_each_encoding_round_trips_bit_for_bit(pattern: str, expected: int) -> None:
    gen = torch.Generator().manual_seed(0)
    old = torch.randn(4096, generator=gen).to(torch.bfloat16)
    new = old.clone()
    if pattern == "scattered":
        new[torch.randperm(4096, generator=gen)[:40]] += 1.0
    elif pattern == "blocks":
        new[100:600] += 1.0
        new[1000:1003] += 1.0
    elif pattern == "all":
        new += 1.0
    spec = TensorSpec("w", "bfloat16", (4096,))
    enc = encode(spec, bits(new), bits(old))
    assert enc.enc == expected, enc.sizes
    layout = DeltaLayout.from_codes([spec], [enc.enc, enc.a, enc.b])
    payload = torch.zeros(layout.total, dtype=torch.uint8)
    if enc.enc != UNCHANGED:
        delta_module.write_payload(spec, enc, bits(new), payload[:layout.entries[0].nbytes])
    held = old.clone()
    apply_delta([held], [spec], layout, payload)
    assert torch.equal(bits(held), bits(new))


def test_a_delta_index_out_of_bounds_names_the_tensor() -> None:
    spec = TensorSpec("model.norm.weight", "bfloat16", (8,))
    layout = DeltaLayout.from_codes([spec], [INDEX, 1, 0])
    payload = torch.zeros(layout.total, dtype=torch.uint8)
    payload[:4].view(torch.int32)[0] = 8
    with pytest.raises(delta_module.DeltaError, match=r"model\.norm\.weight"):
        apply_delta([torch.zeros(8, dtype=torch.bfloat16)], [spec], layout, payload)


def test_delta_after_a_full_sync_audits_the_full_tensors_and_falls_back_when_a_rank_lost_its_base(
        tmp_path: Path) -> None:
    dirs = tiny_model_dirs(tmp_path)
    worker = make_worker(dirs, draft=False)
    link = Link(worker, delta=True)
    try:
        state = perturbed(dirs["target"], 1)
        assert link.sync(state, 1).report.ok
        assert link.sender.last_sync["mode"] == "full"
        for version in (2, 3):
            state = sparse_step(state, version)
            assert link.sync(state, version).report.ok  # the audit digests the FULL held tensors
            assert link.sender.last_sync["mode"] == "delta"
            assert link.sender.last_sync["wire_bytes"] < link.sender.last_sync["full_bytes"] / 5
            assert worker.weights.receiver.last_delta is not None
        params = dict(worker.models["target"].named_parameters())
        assert torch.equal(params["model.norm.weight"].detach(), state["model.norm.weight"])

        worker.sleep(2)  # the weights are dropped: the next sync must be full
        worker.wake_up()
        state = sparse_step(state, 4)
        assert link.sync(state, 4).report.ok
        assert link.sender.last_sync["mode"] == "full"

        state = sparse_step(state, 5)
        # the sender's base is not what the rank holds (the rank missed a version, or the trainer did)
        link.sender.kept.set_version(link.sender._last_specs, 3)
        assert link.sync(state, 5).report.ok
        assert link.sender.last_sync["mode"] == "full"
        state = sparse_step(state, 6)
        assert link.sync(state, 6).report.ok
        assert link.sender.last_sync["mode"] == "delta"
    finally:
        link.sender.close()
        worker.shutdown()


def test_a_flipped_value_of_a_delta_fails_the_audit_naming_the_tensor_and_the_next_sync_is_full(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dirs = tiny_model_dirs(tmp_path)
    worker = make_worker(dirs, draft=False)
    link = Link(worker, delta=True)
    try:
        state = perturbed(dirs["target"], 1)
        assert link.sync(state, 1).report.ok
        flip_delta_values(monkeypatch, FLIPPED)
        state = sparse_step(state, 2)
        with pytest.raises(ChecksumMismatch, match=re.escape(FLIPPED)):
            link.sync(state, 2)
        assert link.sender.last_sync.get("mode") != "full" and worker.weights.torn["target"]
        monkeypatch.undo()
        state = sparse_step(state, 3)
        assert link.sync(state, 3).report.ok
        assert link.sender.last_sync["mode"] == "full" and not worker.weights.torn["target"]
    finally:
        link.sender.close()
        worker.shutdown()
