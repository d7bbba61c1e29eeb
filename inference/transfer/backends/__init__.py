"""The registry of weight-transfer backends: every backend name is declared here, once.

A backend is one way to move a sync's bytes between the trainer (the sender, group rank 0) and the
ranks: a `TransferBackend` subclass (inference/transfer/backends/base.py) in a file of its own, and
one `BackendSpec` below that names it and states the facts the rest of the code picks a backend by.
Everything else reads this registry: InitInfo's validation, WeightSender and WeightReceiver (which
build the backend's class from it), `sidecar launch --transfer` (sidecar/config.py), the hook's
default and `sidecar demo --backend`. No other module lists backend names or compares against one
(tests/test_transfer_backends.py holds that).

Torch-free on purpose: `--help` and the launch config read the names without importing torch, so a
spec names its class by module and attribute, imported on first use (base.py `backend_class`).
Registration order is the order of preference of `default_backend`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import overload

from inference.core import InvalidRequestError


@dataclass(frozen=True)
class BackendSpec:
    """One registered backend. `cuda`: its bytes travel through GPU memory, so every end needs a CUDA
    device (the sender's default device is then the current GPU). `shares_gpu`: the sender and a
    receiver may use the same GPU (NCCL refuses two ranks on one GPU)."""

    name: str
    module: str  # where its TransferBackend subclass lives, imported on first use
    cls: str
    cuda: bool
    shares_gpu: bool
    doc: str


_REGISTRY: dict[str, BackendSpec] = {}


def register(spec: BackendSpec) -> BackendSpec:
    """Add a backend (a name may be registered once)."""
    if spec.name in _REGISTRY:
        raise ValueError(f"transfer backend {spec.name!r} is already registered")
    _REGISTRY[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    """Remove a backend (tests register fakes and remove them again)."""
    _REGISTRY.pop(name, None)


def backend_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


class _Names(Sequence[str]):
    """The registered names as a live sequence, for declarations made once at import (a field's
    `choices`, argparse's): a backend registered later is a valid choice too."""

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[str]: ...

    def __getitem__(self, index: int | slice) -> str | Sequence[str]:
        return backend_names()[index]

    def __len__(self) -> int:
        return len(_REGISTRY)

    def __contains__(self, name: object) -> bool:
        return name in _REGISTRY

    def __iter__(self) -> Iterator[str]:
        return iter(backend_names())

    def __repr__(self) -> str:
        return repr(list(_REGISTRY))


BACKEND_NAMES: Sequence[str] = _Names()


def check_backend(name: object, field: str = "backend") -> BackendSpec:
    """The spec of `name`; InvalidRequestError naming `field` and the registered names otherwise."""
    spec = _REGISTRY.get(name) if isinstance(name, str) else None
    if spec is None:
        raise InvalidRequestError(field, f"must be one of {list(_REGISTRY)}, got {name!r}")
    return spec


def default_backend(device_type: str, *, shared_gpu: bool) -> str:
    """The first registered backend that runs on `device_type` ("cpu" or "cuda") and, with
    `shared_gpu` (trainer and sidecar on one GPU, as in `sidecar demo`), may share it."""
    for spec in _REGISTRY.values():
        if (device_type == "cuda" or not spec.cuda) and (spec.shares_gpu or not shared_gpu):
            return spec.name
    raise InvalidRequestError("backend", f"no registered transfer backend runs on {device_type}")


def gpu_sharing_backends() -> tuple[str, ...]:
    """The backends that let the trainer and the sidecar use one GPU (`sidecar demo --backend`)."""
    return tuple(s.name for s in _REGISTRY.values() if s.shares_gpu)


register(BackendSpec("nccl", "inference.transfer.backends.nccl", "NcclBackend", cuda=True, shares_gpu=False,
                     doc="NCCL broadcasts between GPUs, one GPU per end; bucket buffers on the GPU"))
register(BackendSpec("ipc", "inference.transfer.backends.ipc", "IpcBackend", cuda=True, shares_gpu=True,
                     doc="CUDA IPC on one host: ranks copy straight from the trainer's GPU memory"))
register(BackendSpec("gloo", "inference.transfer.backends.gloo", "GlooBackend", cuda=False, shares_gpu=True,
                     doc="gloo broadcasts through host memory; any device at either end"))
