"""Paged KV blocks with ref counts and a prefix cache. Pure Python.

Block ids 0..num_blocks-1 index the runner's KV tensor. A block holds the KV of block_size
consecutive tokens of one or more sequences (shared prefixes: ref_count > 1). Prefix cache:
- A FULL block whose KV is COMPUTED is registered under a content hash chained over its tokens and
  its prefix (block_hash(parent_hash, tokens)). Registration happens in commit(), after the step that
  wrote the KV finished, never at allocation: a sequence can never hit KV that is still being written.
- A hit is verified: the stored tokens must equal the block's tokens and the stored parent entry must
  be the entry hit just before (every registration gets a never-reused key). So a hash collision, even
  one that ignores the prefix, can only cost a miss, never serve wrong KV.
- Freed registered blocks stay hittable. The free pool holds unregistered blocks at the front (next to
  reuse) and registered ones behind them in the order they were freed, so an allocation evicts the
  least recently freed; a block reused for other content loses its entry. A sequence's blocks are
  freed tail first, so its prefix outlives its tail.
- A registered block may keep its tokens' MoE routing from the computation that wrote its KV
  (`keep_routing`; dropped with the entry); a sequence returning routing hits only such blocks.
"""

from __future__ import annotations

import itertools
import struct
from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import xxhash

from inference.sched.sequence import Sequence


def block_hash(parent: int | None, token_ids: Seq[int]) -> int:
    """Chained content hash of one full block: xxh3_64 over little-endian int64s.

    The root block hashes its tokens only; a child prepends its parent's hash. The byte lengths differ
    (block_size vs block_size + 1 words), so a root can never alias a child. A token packs as a signed
    word: the bytes of its value modulo 2**64 as an unsigned one, without a Python-level mask per token.
    """
    if parent is None:
        return xxhash.xxh3_64_intdigest(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return xxhash.xxh3_64_intdigest(struct.pack(f"<Q{len(token_ids)}q", parent, *token_ids))


@dataclass
class PrefixCacheStats:
    """Counters since construction. A query is one full prompt block looked up at admission."""

    queried_blocks: int = 0
    hit_blocks: int = 0
    hit_tokens: int = 0
    evicted_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_blocks / self.queried_blocks if self.queried_blocks else 0.0


@dataclass
class _Block:
    block_id: int
    ref_count: int = 0
    # Set together iff the block is registered in the hash table (its KV is computed and full).
    hash: int | None = None
    key: int | None = None  # unique id of this registration
    parent_key: int | None = None  # key of the entry before it (None for a root block)
    token_ids: tuple[int, ...] = ()
    # the routing rows of its tokens (registered blocks only), from the computation that wrote its KV
    routing: bytes | None = None


class BlockManager:
    """Owns every KV block. Sequences hold blocks through seq.block_table only."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        assert num_blocks > 0 and block_size > 0, (num_blocks, block_size)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks = [_Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._table: dict[int, int] = {}  # hash -> block id of the registered block
        self._keys = itertools.count()
        self.stats = PrefixCacheStats()

    # ---- sizes ----------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds, registered (cached) ones included: they are reclaimable."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._table)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences, in [0, 1]."""
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether one sequence of num_tokens computed tokens fits the whole cache alone."""
        return self.blocks_needed(num_tokens) <= self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._blocks[block_id].ref_count

    # ---- admission ------------------------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest verified cached prefix of seq.token_ids. No side effects.

        Never covers every token: the last token must be computed to produce the next token's logits.
        A sequence that returns routing stops at the first block that kept none.
        """
        if not self.enable_prefix_caching:
            return []
        routing = seq.routing is not None
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hashes = self._hashes(seq, max_blocks)
        hit: list[int] = []
        parent_key: int | None = None
        for i in range(max_blocks):
            block_id = self._table.get(hashes[i])
            if block_id is None:
                break
            block = self._blocks[block_id]
            if block.parent_key != parent_key or block.token_ids != self._block_tokens(seq, i):
                break  # a hash collision: a miss, never wrong KV
            if routing and block.routing is None:
                break
            hit.append(block_id)
            parent_key = block.key
        return hit

    def can_allocate(self, hit: list[int], num_tokens: int) -> bool:
        """Whether a waiting sequence can claim `hit` and hold blocks for its first num_tokens tokens."""
        claimed_from_pool = sum(1 for b in hit if self._blocks[b].ref_count == 0)
        return self.blocks_needed(num_tokens) - len(hit) + claimed_from_pool <= len(self._free)

    def allocate_prefix(self, seq: Sequence, hit: list[int] | None = None) -> int:
        """Claim the cached prefix of a waiting sequence; return the number of hit tokens.

        `hit` is match_prefix(seq), passed when the caller already computed it. Sets block_table and
        num_computed_tokens to the hit and adds the hit to seq.num_cached_tokens and the stats; a sequence
        that returns routing gets the hit blocks' rows.
        """
        assert not seq.block_table and seq.num_computed_tokens == 0, f"{seq} already holds blocks"
        if hit is None:
            hit = self.match_prefix(seq)
        seq.block_table = list(hit)
        seq.cache_keys = [self._claim(block_id) for block_id in hit]
        hit_tokens = len(hit) * self.block_size
        seq.num_computed_tokens = hit_tokens
        seq.num_draft_computed = hit_tokens  # registered blocks hold valid draft KV too (see commit)
        seq.num_cached_tokens += hit_tokens
        if seq.routing is not None:
            for i, block_id in enumerate(hit):
                rows = self._blocks[block_id].routing
                assert rows is not None, f"block {block_id} hit without routing"
                seq.routing.write(i * self.block_size, rows)
            seq.routing.admitted(hit_tokens, len(hit))
        if self.enable_prefix_caching:
            self.stats.queried_blocks += (seq.num_tokens - 1) // self.block_size
            self.stats.hit_blocks += len(hit)
            self.stats.hit_tokens += hit_tokens
        return hit_tokens

    # ---- growth ---------------------------------------------------------------------------------
    def num_appendable_tokens(self, seq: Sequence) -> int:
        """How many new tokens seq could compute next with the blocks it holds plus every free one."""
        return (len(seq.block_table) + len(self._free)) * self.block_size - seq.num_computed_tokens

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return needed <= len(self._free)

    def append(self, seq: Sequence, num_new_tokens: int) -> None:
        """Ensure blocks exist for tokens [0, num_computed_tokens + num_new_tokens)."""
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        assert needed <= len(self._free), f"{seq} needs {needed} blocks, {len(self._free)} free"
        for _ in range(needed):
            seq.block_table.append(self._take_fresh())

    def append_free_block(self, seq: Sequence) -> bool:
        """One more block for seq if one is free (a decode row whose blocks are full: `append`'s
        result for its one new token); False, and nothing changes, if none is."""
        if not self._free:
            return False
        seq.block_table.append(self._take_fresh())
        return True

    def commit(self, seq: Sequence, num_tokens: int | None = None) -> None:
        """Register the blocks that became full and computed since the last commit.

        Only blocks within the first `num_tokens` tokens (default: num_computed_tokens) count; with
        speculative decoding the caller passes the prefix whose target AND draft KV are both final,
        so a prefix hit never serves a block with a hole in the draft's cache.

        If an identical entry (same tokens, same parent entry) is already registered in another
        block, this block stays unregistered and the sequence's chain continues from that entry.
        """
        if not self.enable_prefix_caching:
            return
        limit = seq.num_computed_tokens if num_tokens is None else num_tokens
        assert limit <= seq.num_computed_tokens, f"{seq}: cannot register beyond computed tokens"
        num_full = limit // self.block_size
        assert num_full <= len(seq.block_table), f"{seq}: computed tokens beyond its blocks"
        hashes = self._hashes(seq, num_full)
        for i in range(len(seq.cache_keys), num_full):
            parent_key = seq.cache_keys[i - 1] if i else None
            tokens = self._block_tokens(seq, i)
            existing = self._table.get(hashes[i])
            if existing is not None:
                other = self._blocks[existing]
                if other.parent_key == parent_key and other.token_ids == tokens:
                    assert other.key is not None
                    seq.cache_keys.append(other.key)
                    continue
                self._unregister(other)  # a collision or a stale chain: the newer content wins
            block = self._blocks[seq.block_table[i]]
            assert block.hash is None, f"block {block.block_id} is registered twice"
            key = next(self._keys)
            block.hash, block.key, block.parent_key, block.token_ids = hashes[i], key, parent_key, tokens
            self._table[hashes[i]] = block.block_id
            seq.cache_keys.append(key)
        if seq.routing is not None:
            self.keep_routing(seq)

    def keep_routing(self, seq: Sequence) -> None:
        """Hand the registered blocks of seq the routing rows it wrote for them since admission (those
        of the computation that wrote their KV). A block whose entry is another block's (the same
        content registered first) is skipped. Called when blocks register and when rows arrive."""
        rows = seq.routing
        if rows is None or not self.enable_prefix_caching:
            return
        bs = self.block_size
        full = min(len(seq.cache_keys), rows.fresh // bs)
        for i in range(rows.published, full):
            block = self._blocks[seq.block_table[i]]
            if block.key == seq.cache_keys[i] and block.routing is None:
                block.routing = rows.read(i * bs, (i + 1) * bs)
        rows.published = max(rows.published, full)

    def free(self, seq: Sequence) -> None:
        """Release seq's blocks (tail first), clear its table and reset num_computed_tokens to 0."""
        for block_id in reversed(seq.block_table):
            block = self._blocks[block_id]
            assert block.ref_count > 0, f"block {block_id} freed more often than claimed"
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.hash is None:
                    self._free.move_to_end(block_id, last=False)  # nothing cached: reuse it first
        seq.block_table = []
        seq.cache_keys = []
        seq.num_computed_tokens = 0
        seq.num_draft_computed = 0
        if seq.routing is not None:
            seq.routing.released()

    def reset_prefix_cache(self) -> None:
        """Forget every cached entry (call when the weights change: the cached KV is stale).

        Sequences holding blocks keep their KV; their future blocks chain from forgotten entries and
        are therefore never hit. The engine should recompute running sequences after a weight change.
        """
        for block_id in list(self._table.values()):
            self._unregister(self._blocks[block_id])
        assert not self._table

    # ---- internals ------------------------------------------------------------------------------
    def _hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """seq.block_hashes extended to at least num_blocks entries (memo: token_ids only grows)."""
        hashes = seq.block_hashes
        while len(hashes) < num_blocks:
            i = len(hashes)
            hashes.append(block_hash(hashes[i - 1] if i else None, self._block_tokens(seq, i)))
        return hashes

    def _block_tokens(self, seq: Sequence, i: int) -> tuple[int, ...]:
        tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
        assert len(tokens) == self.block_size, f"block {i} of {seq} is not full"
        return tokens

    def _claim(self, block_id: int) -> int:
        """Take one more reference on a registered block; return its entry's key."""
        block = self._blocks[block_id]
        assert block.key is not None, f"block {block_id} is not registered"
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1
        return block.key

    def _take_fresh(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self._blocks[block_id]
        assert block.ref_count == 0
        if block.hash is not None:
            self._unregister(block)
            self.stats.evicted_blocks += 1
        block.ref_count = 1
        return block_id

    def _unregister(self, block: _Block) -> None:
        assert block.hash is not None and self._table.get(block.hash) == block.block_id
        del self._table[block.hash]
        block.hash = block.key = block.parent_key = None
        block.token_ids = ()
        block.routing = None
        if block.block_id in self._free:
            self._free.move_to_end(block.block_id, last=False)  # nothing cached any more: reuse first
