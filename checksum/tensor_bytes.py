"""The bytes a digest covers: a tensor's contiguous row-major bytes, and a zero-copy host view."""

from __future__ import annotations

import ctypes

import torch


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a 1-D uint8 tensor on its device, in contiguous row-major order.

    A contiguous tensor is viewed, never copied; a non-contiguous one is copied once (on the current
    stream). Conjugate and negative bits are materialized so the bytes are the values a user sees.
    """
    t = tensor.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t.contiguous().reshape(-1).view(torch.uint8)


def host_view(flat: torch.Tensor) -> memoryview:
    """A zero-copy buffer over a CPU uint8 tensor; the caller keeps `flat` alive while it is used.

    Built with ctypes rather than `.numpy()`: numpy marks the storage as not resizable, and the CPU
    memory arenas release memory by resizing their storage to zero on sleep.
    """
    assert flat.device.type == "cpu" and flat.dtype == torch.uint8 and flat.dim() == 1
    assert flat.is_contiguous()
    n = flat.numel()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * n).from_address(flat.data_ptr())).cast("B")
