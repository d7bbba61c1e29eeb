"""A sync whose sender delivers its digests over the group (inference/transfer/delivery.py), on the CPU
over gloo: update returns exactly the sender's digests, finish with them passes, a flipped byte still
fails naming tensor and rank; two ends that disagree on the step stop before a byte moves and the group
stays usable; a sender whose digest failed makes every rank fail its audit instead of waiting."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from checksum import ChecksumMismatch
from inference.core import InvalidRequestError, StateError
from inference.engine.worker import Worker
from inference.transfer.delivery import DIGEST_BYTES, _payload, delivery_size
from inference.transfer.groups import TransferError
from tests.helpers_fault import flipped_on_arrival
from tests.helpers_weight_update import Q1, RANK, Link, held, loader_digests, make_worker, perturbed, tiny_model_dirs


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return tiny_model_dirs(tmp_path_factory.mktemp("delivery"))


def _sync(link: Link, state: dict[str, torch.Tensor], version: int, *, deliver: bool = True,
          follow: bool = True) -> tuple[Any, Any]:
    """start -> send(deliver_digests=deliver) beside update(digests_follow=follow): (what update returned,
    the sender's records); the receiver's error wins, then the sender's."""
    worker = link.worker
    worker.weights.start("target", version, link.sender.manifest(state, version))
    with ThreadPoolExecutor(1) as pool:
        sending = pool.submit(link.sender.send, state, deliver_digests=deliver)
        try:
            delivered = worker.weights.update(digests_follow=follow)
        finally:
            sender_error = sending.exception(timeout=60)
    if sender_error is not None:
        raise sender_error
    return delivered, sending.result()


def test_update_returns_the_senders_digests_and_finish_takes_them(dirs: dict[str, Path], tmp_path: Path) -> None:
    worker = make_worker(dirs)
    link = Link(worker)
    for version, seed in ((1, 70), (2, 71)):  # the second reuses the group: step 4 left it in step
        state = perturbed(dirs["target"], seed)
        delivered, records = _sync(link, state, version)
        assert delivered == {"algorithm": link.sender.algorithm, "digests": [r.digest for r in records]}
        assert worker.weights.state("target")["session_open"]  # committing is finish's, with these digests
        result = worker.weights.finish(delivered)
        assert result.report.ok and result.report.tensors_checked == len(state) and result.version == version
        assert held(worker) == loader_digests(dirs["target"], state, tmp_path / f"ref{version}")
    assert worker.weights.versions["target"] == 2 and worker.weights.is_servable("target")
    assert link.sync(perturbed(dirs["target"], 72), 3).report.ok  # the two-call way still works on the group


def test_a_flipped_byte_fails_the_delivered_audit_naming_tensor_and_rank(dirs: dict[str, Path]) -> None:
    worker = make_worker(dirs)
    link = Link(worker)
    with flipped_on_arrival(Q1):
        delivered, _ = _sync(link, perturbed(dirs["target"], 73), 1)
    with pytest.raises(ChecksumMismatch) as err:
        worker.weights.finish(delivered)
    first = err.value.report.first_tensor
    assert (first.kind, first.tensor, first.rank) == ("digest", Q1, RANK)
    assert worker.weights.torn["target"] and worker.weights.versions["target"] == 0
    delivered, _ = _sync(link, perturbed(dirs["target"], 74), 2)
    assert worker.weights.finish(delivered).report.ok and worker.weights.is_servable("target")


@pytest.mark.parametrize("deliver, follow", [(True, False), (False, True)])
def test_ends_that_disagree_on_delivery_stop_before_a_byte_moves(dirs: dict[str, Path], deliver: bool,
                                                                 follow: bool) -> None:
    worker = make_worker(dirs)
    link = Link(worker)
    before = held(worker)
    with pytest.raises(TransferError, match="delivers its digests") as err:
        _sync(link, perturbed(dirs["target"], 75), 1, deliver=deliver, follow=follow)
    assert "nothing was written" in str(err.value)
    assert held(worker) == before and not worker.weights.torn["target"]  # no byte moved
    assert link.sender.connected
    delivered, _ = _sync(link, perturbed(dirs["target"], 76), 1)  # the group is still usable
    assert worker.weights.finish(delivered).report.ok


def test_a_sender_without_digests_fails_every_ranks_audit_at_once(dirs: dict[str, Path],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    worker = make_worker(dirs)
    link = Link(worker, timeout_s=60.0)

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("digest kernel failed")

    monkeypatch.setattr(link.sender, "_start_digests", broken)
    with ThreadPoolExecutor(1) as pool:  # the sender raises its own error; the rank learns it had none
        worker.weights.start("target", 1, link.sender.manifest(perturbed(dirs["target"], 77), 1))
        sending = pool.submit(link.sender.send, perturbed(dirs["target"], 77), deliver_digests=True)
        with pytest.raises(StateError, match=f"rank {RANK}: the sender could not digest"):
            worker.weights.update(digests_follow=True)
        with pytest.raises(RuntimeError, match="digest kernel failed"):
            sending.result(timeout=30)
    weights = worker.weights
    assert weights.torn["target"] and not weights.state("target")["session_open"] and weights.versions["target"] == 0
    monkeypatch.undo()
    delivered, _ = _sync(link, perturbed(dirs["target"], 78), 1)  # the group is still usable
    assert worker.weights.finish(delivered).report.ok and weights.is_servable("target")


def test_delivery_needs_digests_and_its_message_has_a_fixed_length(dirs: dict[str, Path]) -> None:
    worker: Worker = make_worker(dirs)
    link = Link(worker)
    state = perturbed(dirs["target"], 79)
    link.sender.manifest(state, 1)
    with pytest.raises(InvalidRequestError, match="deliver_digests"):
        link.sender.send(state, digest=False, deliver_digests=True)
    assert delivery_size(3) == 1 + 3 * DIGEST_BYTES
    assert _payload(None, 3)[0] == 1 and len(_payload(None, 3)) == delivery_size(3)
