"""The "triton" attention backend: flash-attention style kernels over the paged KV cache.

Same contract as ReferenceAttention (inference/layers/attention.py). Imports triton: attention.py
registers it lazily. The kernels are in triton_attention_kernels.py; this module plans their launches.
Prefill stores k/v, then attends; a decode layer is one launch that stores the new k/v itself, may
rotate q and k (given unrotated with their Rope), and splits long contexts over KV splits that the last
split to finish merges. A split takes at least `decode_split_tiles` KV tiles, so a context within one
split runs in a single pass; the choice is made per sequence on the device.

Invariants:
- Decode reads only device tensors and static shapes (T, heads, block_tables.shape[1]), so it can be
  captured in a CUDA graph, and its split count depends only on those shapes.
- The merge counters are one int32 buffer per backend and device, zero between launches (the merging
  split resets its counter); decode launches sharing a backend run on one stream at a time.
- A decode launch holds at most max_rows rows of one sequence (SpecDecoder refuses a larger k).
- A row whose context is empty (a padded row: context_lens 0) gets an all-zero output and reads nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton

from inference import envs
from inference.batch import AttentionMetadata
from inference.core import StateError
from inference.layers.kernel_device import num_sms
from inference.layers.merge_counters import MergeCounters
from inference.layers.pdl import launch_kwargs
from inference.layers.rotary import Rope
from inference.layers.triton_attention_kernels import LOG2E, _paged_attention_kernel, _store_kv_kernel

SEGMENT_TILES = 8  # the batch-invariant mode's key segment, in KV tiles (TritonAttentionTiles.segment_tiles)


@dataclass(frozen=True)
class TritonAttentionTiles:
    """Kernel tiling. Powers of two; prefill_block_m >= 16 and block_n >= 16 (tl.dot's minimum).

    num_splits None picks the decode split count from static shapes (see decode_num_splits)."""

    prefill_block_m: int = 64  # rows (tokens x group heads) of one prefill tile
    prefill_block_n: int = 64
    # fp32 runs exact (ieee) FMA dots, not tensor cores; big fp32 tiles spill registers on sm_90.
    fp32_prefill_block_m: int = 16
    fp32_prefill_block_n: int = 32
    decode_block_n: int = 64
    # A decode split takes at least this many KV tiles: contexts up to decode_split_tiles * decode_block_n
    # keys run in one pass; longer ones split as the static split count allows.
    decode_split_tiles: int = 2
    # The most rows of one sequence a decode launch may hold (spec-decode verify: num_speculative_tokens
    # + 1); 1 compiles the owner check out (triton_attention_kernels.py).
    decode_max_rows: int = 16
    num_warps: int = 4
    num_stages: int = 2
    max_splits: int = 32
    num_splits: int | None = None
    # decode_num_splits aims at this many (sequence, kv head, split) programs per SM
    decode_programs_per_sm: int = 2
    # ... and this many in a launch holding several rows of one sequence (spec-decode verify: few rows
    # with long contexts, whose k + 1 rows read the same keys, so more splits cost little traffic). 4:
    # 40 rows x 2048 keys (8 sequences' verify) took 84 -> 74 us a layer with 4 splits instead of 2 on the
    # H200, the verify rows of 8 / 16 sequences 109 -> 91 / 209 -> 166 us on the H100 (7B heads;
    # docs/dev/benchmark-log.md).
    verify_programs_per_sm: int = 4
    # Decode launches of at least long_decode_min_seqs sequences, one row each (no draft: a draft's verify
    # rows and plain decode must sum their keys in the same tiles), take keys in tiles of
    # long_decode_block_n: the rollout's 129-512-row steps ran 12% faster with them on the H100.
    long_decode_block_n: int = 128
    long_decode_min_seqs: int = 32
    # Launch without FP contraction (Triton's enable_fp_fusion=False): every product and sum rounds as
    # written, so an in-kernel rotation rounds as rotary_qk does (which launches so) instead of one bf16
    # step apart in a few elements. The batch-invariant mode's tiles set it.
    exact_rounding: bool = False
    # Fixed key segments (the batch-invariant mode; 0: off): a query's keys are cut every segment_tiles KV
    # tiles from key 0, each segment summed by its own online softmax and the segments folded in order
    # (attention_splits._fold). A decode split is one segment, so decode regains split-KV parallelism over
    # long contexts while prefill, which folds the same segments in one program, gives the same bits.
    # Not under a sliding window (its first key moves with the query): one split there.
    segment_tiles: int = 0

    def batch_invariant(self) -> TritonAttentionTiles:
        """The tiles of the batch-invariant mode (docs/invariance.md): a query sums its keys in the same
        tiles, in the same order, with the same dot shapes, in prefill, decode at any batch size and
        spec-decode verify. One KV split (the split count follows the batch, and a split-KV merge sums
        otherwise than one pass); one key tile size everywhere; prefill tiles of 16 rows, which is what
        a decode tile holds (its group padded to 16), so both dots run on [max(16, group), head_dim]
        operands; decode rotates q and the new key in the kernel with every launch's FP contraction off
        (exact_rounding), so the rotation rounds as rotary_qk's in prefill and the k cache holds the same
        bits for a token decoded as for one prefilled. Splits: the fixed key segments of segment_tiles
        (8 tiles: 512 keys at the default 64), never a split count that follows the batch."""
        n = self.decode_block_n
        return replace(self, prefill_block_m=16, fp32_prefill_block_m=16, prefill_block_n=n, fp32_prefill_block_n=n,
                       num_splits=None, exact_rounding=True, long_decode_block_n=n,
                       segment_tiles=self.segment_tiles or SEGMENT_TILES)

    def for_decode(self, num_seqs: int) -> TritonAttentionTiles:
        """The tiles a decode launch of num_seqs sequences uses (a static shape: graph-safe)."""
        if num_seqs >= self.long_decode_min_seqs and self.decode_max_rows == 1:
            return replace(self, decode_block_n=self.long_decode_block_n)
        return self

    def __post_init__(self) -> None:
        blocks = (self.prefill_block_m, self.prefill_block_n, self.fp32_prefill_block_m,
                  self.fp32_prefill_block_n, self.decode_block_n, self.long_decode_block_n)
        assert all(b >= 16 and b & (b - 1) == 0 for b in blocks), blocks
        assert self.num_splits is None or (self.num_splits >= 1 and self.num_splits & (self.num_splits - 1) == 0)
        assert self.decode_split_tiles >= 1, self.decode_split_tiles
        assert self.decode_programs_per_sm >= 1 and self.verify_programs_per_sm >= 1, self
        assert self.decode_max_rows >= 1, self.decode_max_rows
        assert self.segment_tiles >= 0, self.segment_tiles


@dataclass(frozen=True)
class LaunchPlan:
    """Grid axis 0 and tile shape of one attention launch (axis 1: kv heads, axis 2: splits)."""

    grid0: int  # decode: sequences; prefill: T // block_q + sequences (spare tiles exit at once)
    group_pad: int  # query heads of one kv head, padded to a power of two
    block_q: int  # query tokens per tile; a tile has block_q * group_pad rows
    block_n: int  # keys per KV tile
    splits: int  # KV splits per (sequence, kv head); > 1 only in decode
    block_b: int  # power of two >= number of sequences (prefill's on-device tile -> sequence search)
    split_tiles: int = 1  # decode: the fewest KV tiles a split takes
    num_warps: int = 4


def _pow2_at_least(n: int, floor: int = 1) -> int:
    return max(floor, triton.next_power_of_2(n))


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_blocks: int, block_size: int,
                      tiles: TritonAttentionTiles, num_sms: int) -> int:
    """Splits of the KV range per (sequence, kv head) in decode, a power of two.

    Aims at tiles.decode_programs_per_sm programs per SM, never more splits than KV tiles a full block
    table holds.
    Depends only on static shapes, so a captured CUDA graph keeps it; at run time each split takes
    max(cdiv(tiles of the actual context, splits), tiles.decode_split_tiles) tiles, so short contexts
    leave the later splits idle, and a context within one split runs in a single pass.
    """
    if tiles.num_splits is not None:
        return tiles.num_splits
    max_tiles = triton.cdiv(max_blocks * block_size, tiles.decode_block_n)
    if tiles.segment_tiles:  # one split per key segment a full block table can hold
        return triton.next_power_of_2(triton.cdiv(max_tiles, tiles.segment_tiles))
    want = triton.cdiv(tiles.decode_programs_per_sm * num_sms, max(1, num_seqs * num_kv_heads))
    cap = min(tiles.max_splits, max_tiles, want)
    return 1 << (max(1, cap).bit_length() - 1)  # the largest power of two <= cap


def store_kv_triton(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """Write token t's k/v [T, Hkv, D] at slot_mapping[t]; tokens with a negative slot are skipped."""
    num_tokens, heads, dim = k.shape
    assert k_cache.shape[2:] == (heads, dim) and v.shape == k.shape, (k.shape, v.shape, k_cache.shape)
    assert k.stride(-1) == v.stride(-1) == k_cache.stride(-1) == 1 and k_cache.stride() == v_cache.stride()
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_HEADS=heads, HEADS_PAD=_pow2_at_least(heads), HEAD_DIM=dim, HEAD_DIM_PAD=_pow2_at_least(dim),
        PAGE=k_cache.shape[1], **launch_kwargs(k))


class TritonAttention:
    """The fast backend: forward(q, k, v, k_cache, v_cache, meta, scale, sliding_window) -> [T, Hq, D].

    Padded rows (slot -1, context_lens 0) are not written to the cache and come out as zeros.
    Needs CUDA tensors, or CPU tensors under TRITON_INTERPRET=1 (the tests' interpreter mode).
    """

    name = "triton"
    takes_rope = True

    def __init__(self, tiles: TritonAttentionTiles | None = None) -> None:
        self.tiles = tiles or TritonAttentionTiles()
        # Per device, the split-KV merge counters (one per sequence and kv head), reused by every decode launch.
        self.merge_counters = MergeCounters(floor=256).get

    def for_decode_rows(self, rows: int) -> TritonAttention:
        """A backend for a model whose decode launches hold at most `rows` rows of one sequence (1: no
        speculative decoding), so the multi-row owner check compiles out of every decode launch at 1.
        SpecDecoder refuses a k whose verify rows exceed it."""
        return TritonAttention(replace(self.tiles, decode_max_rows=max(1, rows)))

    def batch_invariant(self) -> TritonAttention:
        """This backend in the batch-invariant mode (TritonAttentionTiles.batch_invariant)."""
        return TritonAttention(self.tiles.batch_invariant())

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                sliding_window: int | None, rope: Rope | None = None) -> torch.Tensor:
        interpreted = not q.is_cuda  # CPU tensors run only in Triton's interpreter
        if interpreted and not envs.TRITON_INTERPRET.get():
            raise StateError("the triton attention backend needs CUDA tensors (or TRITON_INTERPRET=1)")
        assert q.dtype == k_cache.dtype == v_cache.dtype, (q.dtype, k_cache.dtype, v_cache.dtype)
        assert q.shape[2] == k_cache.shape[3] and q.shape[1] % k_cache.shape[2] == 0, (q.shape, k_cache.shape)
        if rope is not None and not (meta.is_decode and self.fuses_rope(q, k, rope)):
            q, k = rope.apply_qk(q, k)
            rope = None
        if not meta.is_decode:  # decode stores the new k/v inside the attention launch
            store_kv_triton(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if q.shape[0] == 0:
            return out
        self._launch(q, k, v, k_cache, v_cache, out, meta, scale, sliding_window, rope, interpreted)
        return out

    def fuses_rope(self, q: torch.Tensor, k: torch.Tensor, rope: Rope) -> bool:
        """Whether a decode launch rotates q/k itself: the fused rotary path, a power-of-two
        head dim and one dtype for q and k (rotary_qk's own conditions) and the table rotary_qk reads."""
        dim = q.shape[2]
        return (rope.fused and dim & (dim - 1) == 0 and k.dtype == q.dtype
                and rope.cache.dtype == torch.float32 and rope.cache.is_contiguous() and rope.cache.shape[1] == dim
                and rope.positions.shape == (q.shape[0],) and rope.positions.device == q.device)

    def max_rows(self, num_tokens: int, meta: AttentionMetadata) -> int:
        """The most rows of one sequence a decode launch holds (static: graph-safe)."""
        return min(num_tokens, meta.rows_per_seq or self.tiles.decode_max_rows, self.tiles.decode_max_rows)

    def plan(self, q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata) -> LaunchPlan:
        """The launch shape; in decode it depends only on static shapes (CUDA-graph safe)."""
        num_tokens, num_heads, _ = q.shape
        num_kv_heads, page = k_cache.shape[2], k_cache.shape[1]
        group = num_heads // num_kv_heads
        num_seqs = meta.cu_query_lens.shape[0] - 1
        tiles = self.tiles
        if meta.is_decode:
            assert num_seqs == num_tokens, (num_seqs, num_tokens)
            sms = num_sms(q.device)
            tiles = tiles.for_decode(num_seqs)
            if self.max_rows(num_tokens, meta) > 1:
                tiles = replace(tiles, decode_programs_per_sm=tiles.verify_programs_per_sm)
            splits = decode_num_splits(num_seqs, num_kv_heads, meta.block_tables.shape[1], page, tiles, sms)
            # A decode tile is one token: its group's heads are padded to 16 rows for tl.dot.
            return LaunchPlan(num_seqs, _pow2_at_least(group, 16), 1, tiles.decode_block_n, splits, 1,
                              tiles.segment_tiles or tiles.decode_split_tiles, tiles.num_warps)
        fp32 = q.dtype == torch.float32
        block_m = tiles.fp32_prefill_block_m if fp32 else tiles.prefill_block_m
        block_n = tiles.fp32_prefill_block_n if fp32 else tiles.prefill_block_n
        group_pad = _pow2_at_least(group)
        block_q = max(1, block_m // group_pad)
        return LaunchPlan(num_tokens // block_q + num_seqs, group_pad, block_q, block_n, 1,
                          _pow2_at_least(num_seqs), num_warps=tiles.num_warps)

    def _launch(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, out: torch.Tensor, meta: AttentionMetadata, scale: float,
                sliding_window: int | None, rope: Rope | None, interpreted: bool) -> None:
        """k, v [T, Hkv, D]: the step's new keys and values, which a decode launch stores itself (prefill
        stored them before); rope: q and k come unrotated and the kernel rotates them (decode only)."""
        assert rope is None or meta.is_decode
        num_tokens, num_heads, dim = q.shape
        assert k.stride(-1) == v.stride(-1) == 1, (k.stride(), v.stride())
        assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and k_cache.stride() == v_cache.stride()
        assert meta.block_tables.shape[0] == meta.cu_query_lens.shape[0] - 1 and meta.block_tables.stride(1) == 1
        plan = self.plan(q, k_cache, meta)
        segment = self.tiles.segment_tiles if sliding_window is None else 0
        if self.tiles.segment_tiles and not segment:  # a window's keys start with the query: one pass
            plan = replace(plan, splits=1)
        dim_pad = _pow2_at_least(dim, 16)
        if plan.splits > 1:
            part_m = torch.empty((num_tokens, num_heads, plan.splits), dtype=torch.float32, device=q.device)
            part_l = torch.empty_like(part_m)
            part_acc = torch.empty((*part_m.shape, dim_pad), dtype=torch.float32, device=q.device)
        else:
            part_m = part_l = part_acc = out  # unused by the kernel when NUM_SPLITS == 1
        counters = self.merge_counters(q.device, plan.grid0 * k_cache.shape[2]) if plan.splits > 1 else out
        # Static (T and the tiles), so a captured graph keeps it; 1: no row can own another's keys.
        max_rows = self.max_rows(num_tokens, meta) if meta.is_decode else 1
        strides = (q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
                   k_cache.stride(2), meta.block_tables.stride(0), k.stride(0), k.stride(1), v.stride(0), v.stride(1))
        window = sliding_window if sliding_window is not None else 0
        _paged_attention_kernel[(plan.grid0, k_cache.shape[2], plan.splits)](
            q, k_cache, v_cache, out, part_m, part_l, part_acc, counters, k, v, meta.slot_mapping,
            meta.cu_query_lens, meta.context_lens, meta.block_tables,
            rope.cache if rope is not None else out, rope.positions if rope is not None else out,
            meta.cu_query_lens.shape[0] - 1, scale * LOG2E, window, max_rows, *strides,
            GROUP=num_heads // k_cache.shape[2], GROUP_PAD=plan.group_pad, HEAD_DIM=dim, HEAD_DIM_PAD=dim_pad,
            PAGE=k_cache.shape[1], BLOCK_Q=plan.block_q, BLOCK_N=plan.block_n, BLOCK_B=plan.block_b,
            NUM_SPLITS=plan.splits, SPLIT_TILES=plan.split_tiles, IS_DECODE=meta.is_decode,
            HAS_WINDOW=sliding_window is not None,
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            DOT_UPCAST=interpreted and q.dtype == torch.bfloat16, MULTI_ROW=max_rows > 1, ROPE=rope is not None,
            SEGMENT=segment,
            num_warps=plan.num_warps, num_stages=self.tiles.num_stages, enable_fp_fusion=not self.tiles.exact_rounding,
            **launch_kwargs(q))
