"""The transfer-backend registry (inference/transfer/backends/): every backend name is declared once,
and a backend is one file plus its registration. A backend defined here and registered in the test is
selected by name through the launch config, the sender, InitInfo and a rank's receiver, and carries a
real sync (over its own agreement keys) into a Worker on the CPU."""

from __future__ import annotations

import argparse
import ast
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from inference.core import InvalidRequestError
from inference.transfer.backends import (
    BACKEND_NAMES,
    BackendSpec,
    backend_names,
    check_backend,
    default_backend,
    gpu_sharing_backends,
    register,
    unregister,
)
from inference.transfer.backends.base import Agreement, Sink
from inference.transfer.backends.gloo import GlooBackend
from inference.transfer.groups import InitInfo, TransferGroup
from inference.transfer.plan import Bucket, TensorSpec
from inference.transfer.sender import WeightSender
from tests.helpers_weight_update import held, loader_digests, make_worker, perturbed, tiny_model_dirs
from tests.test_import_layers import module_files

REGISTRY = "inference.transfer.backends"
# Where a backend's name may appear as a string outside the registry, and why: the torch.distributed
# backend of the TP group (another fact, not the weight wire's), and WeightSender's default argument.
ALLOWED = {
    ("inference.engine.worker", "nccl"): "the TP group's torch.distributed backend",
    ("sidecar.ranks.pool", "nccl"): "the TP group's torch.distributed backend",
    ("sidecar.ranks.pool", "gloo"): "the TP group's torch.distributed backend",
    ("sidecar.ranks.server", "nccl"): "the TP group's torch.distributed backend",
    ("inference.transfer.sender", "gloo"): "WeightSender(backend='gloo') is its public signature",
}


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def _name_literals(names: Sequence[str]) -> Iterator[tuple[str, str, int]]:
    """(module, name, line) of every string constant (docstrings aside) equal to a backend name."""
    for module, path in module_files().items():
        tree = ast.parse(path.read_text(), str(path))
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in names and id(node) not in docs:
                yield module, node.value, node.lineno


def test_each_backend_name_is_declared_once_in_the_registry() -> None:
    names = backend_names()
    assert set(names) == {"gloo", "nccl", "ipc"}
    found = list(_name_literals(names))
    in_registry = sorted(name for module, name, _ in found if module == REGISTRY)
    assert in_registry == sorted(names), "each name is registered exactly once"
    elsewhere = sorted(f"{m}:{line} {name!r}" for m, name, line in found
                       if m != REGISTRY and (m, name) not in ALLOWED)
    assert elsewhere == [], "a backend name outside the registry is a second declaration or a string switch"
    with pytest.raises(ValueError, match="already registered"):
        register(check_backend("gloo"))


def test_the_registry_answers_what_the_callers_ask() -> None:
    assert default_backend("cpu", shared_gpu=False) == "gloo"
    assert default_backend("cuda", shared_gpu=False) == "nccl"
    assert default_backend("cuda", shared_gpu=True) == "ipc"  # the demo: trainer and sidecar on one GPU
    assert gpu_sharing_backends() == ("ipc", "gloo")
    assert check_backend("ipc").cuda and not check_backend("gloo").cuda
    with pytest.raises(InvalidRequestError, match="must be one of") as err:
        check_backend("mpi", "init_info.backend")
    assert err.value.field == "init_info.backend"


class CountingBackend(GlooBackend):
    """A backend as another engineer would add one: gloo's bytes, plus one agreement key of its own
    and a value the sender announces (as ipc does with its layout)."""

    agreement_size = (1, 1)
    ends: ClassVar[list[CountingBackend]] = []  # every end built, in order: the sender first

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.sent = self.received = 0
        self.seen: tuple[list[bool], list[int]] | None = None
        CountingBackend.ends.append(self)

    def prepare_send(self, specs: Sequence[TensorSpec], tensors: list[torch.Tensor]) -> Agreement:
        return [4242], [len(tensors)]

    def send(self, group: TransferGroup, plan: Sequence[Bucket], tensors: list[torch.Tensor],
             agreed: Sequence[bool]) -> None:
        self.sent += 1
        super().send(group, plan, tensors, agreed)

    def receiver_agreement(self) -> Agreement:
        return [4242], [0]

    def receive(self, group: TransferGroup, plan: Sequence[Bucket], specs: Sequence[TensorSpec], sink: Sink,
                agreed: Sequence[bool], values: Sequence[int]) -> None:
        self.received += 1
        self.seen = (list(agreed), list(values))
        super().receive(group, plan, specs, sink, agreed, values)


@pytest.fixture
def fake() -> Iterator[BackendSpec]:
    spec = register(BackendSpec("counting", __name__, "CountingBackend", cuda=False, shares_gpu=True,
                                doc="gloo with a counter (tests)"))
    CountingBackend.ends = []
    yield spec
    unregister("counting")


def test_a_registered_backend_is_a_choice_of_the_launch_config(fake: BackendSpec) -> None:
    from sidecar.cli.launch import add_arguments
    from sidecar.config import LaunchConfig, build_config

    assert build_config({"transfer": "counting"}, env={}).transfer == "counting"
    field = LaunchConfig.__dataclass_fields__["transfer"]
    assert field.metadata["choices"] is BACKEND_NAMES and "counting" in BACKEND_NAMES
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--transfer", "counting"]).transfer == "counting"
    unregister("counting")
    with pytest.raises(InvalidRequestError, match="must be one of") as err:
        build_config({"transfer": "counting"}, env={})
    assert err.value.field == "transfer"


def test_a_registered_backend_carries_a_sync_end_to_end(fake: BackendSpec, tmp_path: Path) -> None:
    dirs = tiny_model_dirs(tmp_path / "models")
    worker = make_worker(dirs, draft=False)
    sender = WeightSender("counting", bucket_bytes=16 << 10, timeout_s=20.0)
    info = sender.init_info()
    assert InitInfo.from_dict(info).backend == "counting"
    with ThreadPoolExecutor(1) as pool:
        connecting = pool.submit(sender.connect)
        worker.weights.init_transfer(info)
        connecting.result(timeout=30)
    try:
        state = perturbed(dirs["target"], 5)
        worker.weights.start("target", 1, sender.manifest(state, 1))
        with ThreadPoolExecutor(1) as pool:
            sending = pool.submit(sender.send, state)
            worker.weights.update()
            digests = sending.result(timeout=60)
        assert worker.weights.finish(digests).report.ok and worker.weights.version() == 1
        assert held(worker) == loader_digests(dirs["target"], state, tmp_path / "ref")
        sent, received = CountingBackend.ends
        assert (sent.sent, received.received, received.last_mode) == (1, 1, "chain")
        assert received.seen == ([True], [len(state)]), "its agreement key and value rode the one all-reduce"
        assert worker.weights.receiver is not None and worker.weights.receiver.backend is received
    finally:
        sender.close()
        worker.weights.close_transfer()
    unregister("counting")
    with pytest.raises(InvalidRequestError, match="must be one of"):
        InitInfo.from_dict(info)
