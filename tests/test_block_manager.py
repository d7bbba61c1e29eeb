"""BlockManager on CPU: ref counts, prefix caching (registered only once computed), LRU eviction,
collision safety and reset."""

from __future__ import annotations

import pytest

from inference.core import SamplingParams
from inference.sched import block_manager as bm_module
from inference.sched.block_manager import BlockManager
from inference.sched.sequence import Sequence

BS = 4


def make_seq(tokens: list[int], request_id: str = "r") -> Sequence:
    return Sequence(request_id, 0, tokens, SamplingParams(max_tokens=4))


def admit_and_compute(bm: BlockManager, seq: Sequence) -> int:
    """Admit seq, compute its whole prompt in one step and commit; return the hit tokens."""
    hit = bm.allocate_prefix(seq)
    bm.append(seq, seq.num_tokens - seq.num_computed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.commit(seq)
    return hit


def test_allocate_append_free_keeps_ref_counts_and_free_count() -> None:
    bm = BlockManager(8, BS)
    seq = make_seq(list(range(10)))
    assert bm.allocate_prefix(seq) == 0
    assert bm.can_append(seq, 10)
    bm.append(seq, 10)
    assert len(seq.block_table) == 3 and len(set(seq.block_table)) == 3
    assert bm.num_free_blocks == 5
    assert bm.usage == pytest.approx(3 / 8)
    assert all(bm.ref_count(b) == 1 for b in seq.block_table)
    seq.num_computed_tokens = 10
    bm.append(seq, 2)  # tokens 10, 11 fit the third block
    assert len(seq.block_table) == 3
    bm.append(seq, 3)  # token 12 opens a fourth
    assert len(seq.block_table) == 4
    assert not bm.can_append(seq, 4 + 5 * BS)
    bm.free(seq)
    assert seq.block_table == [] and seq.num_computed_tokens == 0
    assert bm.num_free_blocks == 8 and bm.usage == 0.0


def test_blocks_are_registered_only_after_their_kv_is_computed() -> None:
    bm = BlockManager(16, BS)
    prompt = list(range(100, 113))  # 3 full blocks + 1 token
    a = make_seq(prompt)
    bm.allocate_prefix(a)
    bm.append(a, a.num_tokens)
    # Allocated but not computed: nothing may hit it.
    assert bm.match_prefix(make_seq(prompt)) == []
    a.num_computed_tokens = 6  # one full block computed (a chunked prefill)
    bm.commit(a)
    assert bm.match_prefix(make_seq(prompt)) == a.block_table[:1]
    a.num_computed_tokens = 13
    bm.commit(a)
    b = make_seq(prompt)
    assert bm.allocate_prefix(b) == 3 * BS
    assert b.block_table == a.block_table[:3] and b.num_computed_tokens == 12
    assert all(bm.ref_count(blk) == 2 for blk in b.block_table)
    assert b.num_cached_tokens == 12
    assert (bm.stats.queried_blocks, bm.stats.hit_blocks, bm.stats.hit_tokens) == (3 + 3, 3, 12)


def test_a_hit_never_covers_every_token() -> None:
    bm = BlockManager(16, BS)
    prompt = list(range(8))  # exactly two full blocks
    admit_and_compute(bm, make_seq(prompt))
    b = make_seq(prompt)
    # The last token must be computed to produce logits: only the first block may hit.
    assert bm.allocate_prefix(b) == BS
    assert b.num_computed_tokens == BS < b.num_tokens


def test_freed_cached_blocks_hit_until_evicted_lru() -> None:
    bm = BlockManager(6, BS)
    a, b = make_seq([1] * 9, "a"), make_seq([2] * 9, "b")  # 2 full blocks + 1 token each
    admit_and_compute(bm, a)
    admit_and_compute(bm, b)
    bm.free(a)
    bm.free(b)  # b freed after a: a's entries are older
    assert bm.num_free_blocks == 6 and bm.num_cached_blocks == 4
    # A fresh sequence of 3 blocks takes the 2 uncached blocks first, then evicts a's tail block.
    c = make_seq([3] * 12, "c")
    bm.allocate_prefix(c)
    bm.append(c, 12)
    assert bm.stats.evicted_blocks == 1
    assert len(bm.match_prefix(make_seq([1] * 9))) == 1  # a's prefix outlived its tail
    assert len(bm.match_prefix(make_seq([2] * 9))) == 2
    bm.free(c)
    d = make_seq([4] * 21, "d")  # needs every block: evicts all cached entries
    bm.allocate_prefix(d)
    bm.append(d, 21)
    assert bm.num_cached_blocks == 0 and bm.num_free_blocks == 0
    assert bm.match_prefix(make_seq([2] * 9)) == []


def test_reused_block_serves_its_new_content_not_the_old() -> None:
    bm = BlockManager(2, BS)
    admit_and_compute(bm, a := make_seq([1] * 5))
    bm.free(a)
    admit_and_compute(bm, b := make_seq([2] * 8))  # reuses both blocks
    bm.free(b)
    assert bm.match_prefix(make_seq([1] * 5)) == []
    assert len(bm.match_prefix(make_seq([2] * 8 + [0]))) == 2


def test_hash_collision_is_a_miss_not_wrong_kv(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bm_module, "block_hash", lambda parent, tokens: 7)  # everything collides
    bm = BlockManager(16, BS)
    admit_and_compute(bm, make_seq([1, 2, 3, 4, 5]))
    assert bm.match_prefix(make_seq([9, 9, 9, 9, 5])) == []
    assert len(bm.match_prefix(make_seq([1, 2, 3, 4, 5]))) == 1


def test_collision_that_ignores_the_prefix_cannot_chain_onto_another_prefix(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bm_module, "block_hash", lambda parent, tokens: hash(tuple(tokens)))
    bm = BlockManager(16, BS)
    a_blk, b_blk, c_blk, d_blk = [1] * BS, [2] * BS, [3] * BS, [4] * BS
    admit_and_compute(bm, make_seq(a_blk + d_blk + [0]))  # registers a, then d after a
    admit_and_compute(bm, make_seq(c_blk + b_blk + [0]))  # registers c, then b after c
    # Block b's entry matches by hash and tokens, but its KV was computed after c, not after a.
    assert len(bm.match_prefix(make_seq(a_blk + b_blk + [0]))) == 1
    assert len(bm.match_prefix(make_seq(c_blk + b_blk + [0]))) == 2


def test_duplicate_content_computed_concurrently_still_chains() -> None:
    bm = BlockManager(16, BS)
    shared, x, y = [5] * BS, [6] * BS, [7] * BS
    a, b = make_seq(shared + x + [0], "a"), make_seq(shared + y + [0], "b")
    for s in (a, b):  # both admitted before either computed: no hit, two copies of `shared`
        assert bm.allocate_prefix(s) == 0
        bm.append(s, s.num_tokens)
    for s in (a, b):
        s.num_computed_tokens = s.num_tokens
        bm.commit(s)
    # b's copy of `shared` stays unregistered, yet b's next block chains onto a's entry.
    assert bm.num_cached_blocks == 3
    c = make_seq(shared + y + [1])
    assert bm.allocate_prefix(c) == 2 * BS
    assert c.block_table == [a.block_table[0], b.block_table[1]]
    for s in (a, b, c):
        bm.free(s)
    assert bm.num_free_blocks == 16
    assert all(bm.ref_count(i) == 0 for i in range(16))


def test_reset_prefix_cache_drops_every_entry() -> None:
    bm = BlockManager(8, BS)
    prompt = list(range(9))
    admit_and_compute(bm, a := make_seq(prompt))
    bm.free(a)
    assert bm.num_cached_blocks == 2
    bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 0 and bm.num_free_blocks == 8
    assert bm.allocate_prefix(make_seq(prompt)) == 0


def test_prefix_caching_disabled_never_hits() -> None:
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    prompt = list(range(9))
    admit_and_compute(bm, make_seq(prompt))
    assert bm.num_cached_blocks == 0
    assert bm.allocate_prefix(make_seq(prompt)) == 0
    assert bm.stats.queried_blocks == 0


def test_can_allocate_counts_cached_hit_blocks_taken_from_the_free_pool() -> None:
    bm = BlockManager(3, BS)
    prompt = [1] * 9
    admit_and_compute(bm, a := make_seq(prompt))
    bm.free(a)  # all 3 blocks free, 2 of them cached
    b = make_seq(prompt)
    hit = bm.match_prefix(b)
    assert len(hit) == 2
    assert bm.can_allocate(hit, 12)  # 2 hit blocks + 1 fresh block = the whole cache
    assert not bm.can_allocate(hit, 13)
    assert bm.can_ever_fit(12) and not bm.can_ever_fit(13)
