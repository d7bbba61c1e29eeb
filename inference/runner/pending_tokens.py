"""Input ids that the previous step sampled on the device and the host has not read (async scheduling).

With async scheduling the engine launches step i+1 before it reads step i's tokens. A decode row whose
input is such a token carries a placeholder id, -1 - r (inference/sched/sequence.py), where r is the row of
that token in step i's sampled pairs [m, 2] float64 (token id, logprob). `resolve_pending` replaces
every negative id of an int64 id vector on the device with the token of its row, in stream order
after step i's sampling and before step i+1's forward, so no host sync sits between the two steps.
Non-negative ids are left alone. The Triton kernel does it in one launch; `resolve_pending_torch` is
its eager twin (CPU, and the reference the tests compare the kernel with in Triton's interpreter).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch twin serves where Triton is missing
    triton = None

_BLOCK = 1024


def resolve_pending(ids: torch.Tensor, pairs: torch.Tensor, use_triton: bool | None = None) -> torch.Tensor:
    """Write pairs[-1 - ids[j], 0] into ids[j] wherever ids[j] < 0, in place; returns ids.

    ids: [n] int64, contiguous; pairs: [m, 2] float64 (a token id is exact in float64), every
    placeholder's row < m. use_triton None: the kernel on CUDA, the twin elsewhere."""
    assert ids.dtype == torch.int64 and ids.dim() == 1 and ids.is_contiguous(), (ids.dtype, ids.shape)
    assert pairs.dtype == torch.float64 and pairs.dim() == 2 and pairs.shape[1] == 2, (pairs.dtype, pairs.shape)
    assert ids.device == pairs.device, (ids.device, pairs.device)
    if use_triton is None:
        use_triton = triton is not None and ids.is_cuda
    if not use_triton:
        return resolve_pending_torch(ids, pairs)
    n = ids.shape[0]
    if n:
        _resolve_kernel[(triton.cdiv(n, _BLOCK),)](ids, pairs, pairs.stride(0), n, BLOCK=_BLOCK, num_warps=4)
    return ids


def resolve_pending_torch(ids: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """The eager twin of the kernel: the definition of `resolve_pending`."""
    rows = torch.bitwise_not(ids).clamp_(min=0)  # ~id = -1 - id; 0 on the rows that keep their id (a valid row)
    tokens = pairs.select(1, 0).index_select(0, rows).to(torch.int64)
    return ids.copy_(torch.where(ids < 0, tokens, ids))


if triton is not None:

    @triton.jit
    def _resolve_kernel(ids_ptr, pairs_ptr, pairs_row_stride, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < n
        ids = tl.load(ids_ptr + offs, mask=inside, other=0)
        pending = inside & (ids < 0)
        token = tl.load(pairs_ptr + (-1 - ids) * pairs_row_stride, mask=pending, other=0.0)
        tl.store(ids_ptr + offs, token.to(tl.int64), mask=pending)
