"""Shared pytest wiring: the `cuda` mark skips itself where no GPU is present."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels then run in Triton's interpreter on CPU tensors, where tests ask for it. It must be
    # set before Triton is imported anywhere.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """torch on one thread for a module: on this 2-core box two threads contend many times slower, and
    the batch-invariance facts are stated for one thread (inference/layers/invariant.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
