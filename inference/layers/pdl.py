"""Programmatic dependent launch (PDL, sm_90+) for the decode path's Triton kernels.

With PDL a kernel may be scheduled while the kernel before it on the stream is still finishing, so
its launch latency hides behind that kernel's tail; inside a CUDA graph the dependency is kept as a
programmatic edge. A kernel launched this way must call `wait()` before it reads anything an earlier
kernel wrote and before it writes anything (an earlier kernel may still read that memory); reading
memory no kernel of the step writes (weights) may come first. `launch_dependents()` lets the next
kernel be scheduled early. Both are no-ops when the kernel was launched without PDL.

On by default (SIDECAR_PDL=0 turns it off, read at each launch, so set it before graphs are captured):
with the GEMV loading its first weight tile before `wait`, it shortens the batch-1 decode step
(docs/dev/benchmark-log.md), and results are the same bits either way (tests/test_pdl_cuda.py).
Kernels take a `PDL: tl.constexpr` argument and their launches pass `**launch_kwargs(tensor)`.
"""

from __future__ import annotations

import functools

import torch

from inference import envs

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # an old Triton without GDC, or none at all: PDL stays off
    triton = None


def use_pdl(x: torch.Tensor) -> bool:
    """Whether kernels on x's device launch with PDL (Hopper or newer, CUDA tensors only)."""
    return triton is not None and x.is_cuda and _hopper_or_newer(x.device.index) and envs.PDL.get()


@functools.lru_cache(maxsize=16)
def _hopper_or_newer(index: int | None) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def launch_kwargs(x: torch.Tensor) -> dict:
    """Extra launch arguments: the PDL constexpr and Triton's launch_pdl flag."""
    on = use_pdl(x)
    return {"PDL": on, "launch_pdl": True} if on else {"PDL": False}


if triton is not None:

    @triton.jit
    def wait(PDL: tl.constexpr):
        """Block until the previous kernel's writes are visible (PDL launches only)."""
        if PDL:
            gdc_wait()

    @triton.jit
    def launch_dependents(PDL: tl.constexpr):
        """Let the next kernel on the stream be scheduled now (PDL launches only)."""
        if PDL:
            gdc_launch_dependents()
