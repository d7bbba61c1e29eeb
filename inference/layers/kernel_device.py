"""Which tensors the Triton kernels of inference/layers take, and the SM count their launches are sized by.

A kernel takes CUDA tensors whenever Triton is installed. CPU tensors take the torch twins, except inside
`interpreted_on_cpu()` under Triton's interpreter (TRITON_INTERPRET=1 before Triton is imported): that is
how tests run the kernels without a GPU. The choice is scoped to the calling context (a ContextVar that
only the context manager sets), so no module flag is flipped and nothing leaks past the `with` block.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

from inference import envs

try:
    import triton
except ImportError:  # the engine runs without Triton, on the torch twins
    triton = None

# What launch shapes assume in the interpreter: small, so tiny test shapes still take split-K / split-KV.
INTERPRETER_SMS = 8
_ON_CPU: ContextVar[bool] = ContextVar("kernels_on_cpu", default=False)


@contextmanager
def interpreted_on_cpu() -> Iterator[None]:
    """Inside: CPU tensors go to the Triton kernels (in Triton's interpreter) wherever CUDA tensors would."""
    token = _ON_CPU.set(True)
    try:
        yield
    finally:
        _ON_CPU.reset(token)


def use_triton(x: torch.Tensor) -> bool:
    """Whether a kernel takes x: Triton is installed and x is a CUDA tensor, or a CPU tensor inside
    interpreted_on_cpu() with Triton's interpreter on."""
    if triton is None:
        return False
    return x.is_cuda or (_ON_CPU.get() and x.device.type == "cpu" and envs.TRITON_INTERPRET.get())


@functools.lru_cache(maxsize=16)
def num_sms(device: torch.device) -> int:
    """The device's streaming multiprocessors (INTERPRETER_SMS off CUDA)."""
    if device.type != "cuda":
        return INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count
