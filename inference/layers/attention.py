"""Paged attention: the backend interface, a plain-torch reference backend, and the layer that
holds one layer's KV cache views.

Cache layout (per layer): k_cache, v_cache [num_blocks, block_size, num_kv_heads_local, head_dim].
Token slot s lives at block s // block_size, offset s % block_size. A backend first writes the new
tokens' k/v at meta.slot_mapping, then lets each sequence's queries attend over its first
context_lens[i] cached tokens; query j of sequence i sits at position context_lens[i] -
query_lens[i] + j (causal). See inference/batch.py for AttentionMetadata.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from inference.batch import AttentionMetadata
from inference.core import InvalidRequestError, StateError
from inference.layers.rotary import Rope


class AttentionBackend(Protocol):
    """name, and takes_rope: True where forward accepts `rope` and rotates q/k itself (in a kernel where it
    can); a backend without it (the reference, backends written before the argument) gets them rotated
    by the Attention layer."""

    name: str

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                sliding_window: int | None, rope: Rope | None = None) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] (Hq % Hkv == 0) -> [T, Hq, D] in q's dtype.

        rope (takes_rope backends only): q and k are not rotated yet; the backend applies rope.apply_qk
        first, or rotates them inside its kernels with the same math (compiled, a product may round
        differently)."""
        ...


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write each token's k/v at its slot (in place; the caches are views bound by the runner).

    A negative slot (a padded row of a CUDA-graph batch) is skipped; the filter syncs with the host,
    which the reference backend may do."""
    num_blocks, block_size, heads, dim = k_cache.shape
    keep = slot_mapping >= 0
    slots, k, v = slot_mapping[keep], k[keep], v[keep]
    k_cache.view(num_blocks * block_size, heads, dim).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(num_blocks * block_size, heads, dim).index_copy_(0, slots, v.to(v_cache.dtype))


class ReferenceAttention:
    """Readable and slow: one gather + dense masked attention per sequence, all math in fp32.

    Works on CPU and GPU; reads the host copies of query/context lengths, so it is not meant for
    CUDA graphs. Serves as the oracle the fast backends are tested against.
    """

    name = "reference"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                sliding_window: int | None) -> torch.Tensor:
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        start = 0
        for i, (q_len, ctx_len) in enumerate(zip(meta.query_lens, meta.context_lens_host)):
            assert 0 < q_len <= ctx_len, (i, q_len, ctx_len)
            keys, values = _gather_context(k_cache, v_cache, meta.block_tables[i], ctx_len)
            out[start:start + q_len] = _dense_attention(
                q[start:start + q_len], keys, values, scale, sliding_window).to(q.dtype)
            start += q_len
        assert start == q.shape[0], (start, q.shape)
        return out


def _gather_context(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    ctx_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ctx_len cached k/v of one sequence, in order: [ctx_len, Hkv, D] each."""
    num_blocks, block_size, heads, dim = k_cache.shape
    n_blocks = -(-ctx_len // block_size)
    blocks = block_table[:n_blocks].long()
    offsets = torch.arange(block_size, device=blocks.device)
    slots = (blocks[:, None] * block_size + offsets).reshape(-1)[:ctx_len]
    flat_k = k_cache.view(num_blocks * block_size, heads, dim)
    flat_v = v_cache.view(num_blocks * block_size, heads, dim)
    return flat_k[slots], flat_v[slots]


def _dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     sliding_window: int | None) -> torch.Tensor:
    """q [Tq, Hq, D] are the LAST Tq of the Tk positions of k/v [Tk, Hkv, D]; returns fp32 [Tq, Hq, D]."""
    tq, hq, _ = q.shape
    tk, hkv, _ = k.shape
    assert hq % hkv == 0, (hq, hkv)
    group = hq // hkv
    # GQA: query head h reads kv head h // group (HF's repeat_kv order).
    k32 = k.float().repeat_interleave(group, dim=1)
    v32 = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k32) * scale
    q_pos = torch.arange(tk - tq, tk, device=q.device)[:, None]
    k_pos = torch.arange(tk, device=q.device)[None, :]
    allowed = k_pos <= q_pos
    if sliding_window is not None:
        # HF semantics: a query sees itself and the sliding_window - 1 keys before it.
        allowed &= k_pos > q_pos - sliding_window
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v32)


def _triton_backend() -> AttentionBackend:
    """Imported on first use, so that importing this module never needs triton."""
    if importlib.util.find_spec("triton") is None:
        raise InvalidRequestError("attention_backend", "the 'triton' backend needs the triton package")
    from inference.layers.triton_attention import TritonAttention

    return TritonAttention()


_BACKENDS: dict[str, Callable[[], AttentionBackend]] = {"reference": ReferenceAttention,
                                                        "triton": _triton_backend}


def get_attention_backend(name: str) -> AttentionBackend:
    if name not in _BACKENDS:
        raise InvalidRequestError(
            "attention_backend", f"unknown attention backend {name!r}; known: {sorted(_BACKENDS)}")
    return _BACKENDS[name]()


class Attention(nn.Module):
    """One layer's attention over the paged KV cache; holds no parameters.

    k_cache / v_cache are plain attributes (not buffers): the runner owns that memory and binds
    views of it with bind_kv_cache; they never appear in state_dict() or named_buffers().
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.backend = backend
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def bind_kv_cache(self, k_cache: torch.Tensor | None, v_cache: torch.Tensor | None) -> None:
        if k_cache is not None:
            assert v_cache is not None and k_cache.shape == v_cache.shape, "k and v caches differ"
            assert k_cache.shape[2:] == (self.num_kv_heads, self.head_dim), tuple(k_cache.shape)
        self.k_cache, self.v_cache = k_cache, v_cache

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata, rope: Rope | None = None) -> torch.Tensor:
        """rope: q and k are unrotated; a backend that takes rope rotates them (in its kernel where it can),
        for any other this layer rotates them first."""
        if self.k_cache is None or self.v_cache is None:
            raise StateError("no KV cache is bound: call model.bind_kv_cache(...) before forward")
        assert self.k_cache.shape[1] == meta.block_size, (self.k_cache.shape, meta.block_size)
        args = (q, k, v, self.k_cache, self.v_cache, meta, self.scale, self.sliding_window)
        if rope is None:
            return self.backend.forward(*args)
        if not getattr(self.backend, "takes_rope", False):
            q, k = rope.apply_qk(q, k)
            return self.backend.forward(q, k, *args[2:])
        return self.backend.forward(*args, rope)
