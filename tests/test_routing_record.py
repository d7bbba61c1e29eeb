"""The host side of routing records (pure Python, fast): a sequence keeps its rows by position (a recompute
overwrites, a restart forgets); the prefix cache keeps a block's rows from the computation that wrote its
KV, hands them to a sequence that returns routing at admission, never lets one hit a block without them,
and drops them with the entry; the JSON form round-trips and names what is malformed."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from inference.core import InvalidRequestError, SamplingParams, decode_routing, encode_routing, routing_dtype
from inference.sched.block_manager import BlockManager
from inference.sched.routing_rows import RoutingRows
from inference.sched.sequence import Sequence, SequenceStatus

BS = 4
ROW = 3  # bytes per token: 3 MoE layers x 1 expert


def rows_of(tokens: range, salt: int = 0) -> bytes:
    return bytes((t * ROW + j + salt) % 256 for t in tokens for j in range(ROW))


def test_rows_are_kept_by_position_and_a_recompute_overwrites() -> None:
    r = RoutingRows(ROW)
    r.write(0, rows_of(range(0, 5)))
    r.write(5, rows_of(range(5, 6)))
    assert (r.length, r.fresh) == (6, 6) and r.read(0, 6) == rows_of(range(6))
    r.released()  # preempted: its blocks are gone, its rows stay (they are still the tokens' routing)
    assert (r.length, r.fresh) == (6, 0)
    r.write(4, rows_of(range(4, 5), salt=1))  # a position written past the frontier: kept, not fresh
    assert r.fresh == 0 and r.read(4, 5) == rows_of(range(4, 5), salt=1)
    r.admitted(0, 0)
    r.write(0, rows_of(range(0, 6), salt=2))  # the recompute overwrites every row
    assert (r.length, r.fresh) == (6, 6) and r.read(0, 6) == rows_of(range(6), salt=2)
    r.write(8, rows_of(range(8, 9)))  # a rejected speculative position, say: not contiguous, not counted
    assert r.length == 6
    r.clear()
    assert (r.length, r.fresh, len(r.data)) == (0, 0, 0)


def routing_seq(tokens: list[int]) -> Sequence:
    seq = Sequence("r", 0, tokens, SamplingParams(return_routing=True))
    seq.routing = RoutingRows(ROW)
    return seq


def compute(bm: BlockManager, seq: Sequence, routing: bool = True, salt: int = 0) -> int:
    """Admit seq and compute its whole prompt in one step, its routing rows arriving before the commit
    (as a synchronous step brings them); return the hit tokens."""
    hit = bm.allocate_prefix(seq)
    seq.status = SequenceStatus.RUNNING
    bm.append(seq, seq.num_tokens - seq.num_computed_tokens)
    if routing and seq.routing is not None:
        seq.routing.write(hit, rows_of(range(hit, seq.num_tokens), salt))
    seq.num_computed_tokens = seq.num_tokens
    bm.commit(seq)
    return hit


def test_a_routing_sequence_hits_only_blocks_that_kept_their_rows_and_gets_them() -> None:
    bm = BlockManager(16, BS)
    prompt = list(range(100, 111))  # 2 full blocks + 3 tokens
    first = routing_seq(prompt)
    assert compute(bm, first) == 0
    bm.free(first)
    second = routing_seq([*prompt, 7])
    assert compute(bm, second, salt=9) == 2 * BS
    # the hit rows are the first sequence's, those of the KV it attends to; the rest its own
    assert second.routing is not None and second.routing.read(0, 8) == rows_of(range(8))
    assert second.routing.read(8, 12) == rows_of(range(8, 12), salt=9)


def test_a_prefix_cached_without_routing_is_not_hit_by_a_routing_sequence() -> None:
    bm = BlockManager(16, BS)
    prompt = list(range(100, 111))
    plain = Sequence("p", 0, prompt, SamplingParams())
    compute(bm, plain)  # a request without routing: its blocks keep no rows
    assert len(bm.match_prefix(Sequence("q", 0, prompt, SamplingParams()))) == 2
    first = routing_seq(prompt)
    assert compute(bm, first) == 0  # recomputed: the cached blocks have no routing
    bm.free(first)
    # its own blocks stayed unregistered (the entries were there first): routing requests recompute that
    # prefix until its entries go (the docs' limit), requests without routing still hit it
    assert bm.match_prefix(routing_seq(prompt)) == []
    assert len(bm.match_prefix(Sequence("q", 0, prompt, SamplingParams()))) == 2


def test_rows_that_arrive_after_the_blocks_registered_are_kept_then() -> None:
    """Async scheduling registers a step's blocks at launch and reads its rows back a step later."""
    bm = BlockManager(16, BS)
    prompt = list(range(200, 209))
    seq = routing_seq(prompt)
    compute(bm, seq, routing=False)
    assert bm.match_prefix(routing_seq(prompt)) == []
    assert seq.routing is not None
    seq.routing.write(0, rows_of(range(9)))
    bm.keep_routing(seq)
    assert bm.match_prefix(routing_seq(prompt)) == seq.block_table[:2]


def test_rows_written_before_a_preemption_are_not_kept_for_the_recomputed_blocks() -> None:
    bm = BlockManager(16, BS)
    prompt = list(range(300, 309))
    seq = routing_seq(prompt)
    assert seq.routing is not None
    seq.routing.write(0, rows_of(range(9)))  # an earlier computation, its blocks since freed
    bm.allocate_prefix(seq)
    bm.append(seq, 9)
    seq.num_computed_tokens = 9
    bm.commit(seq)  # registered by the recompute, whose rows have not arrived
    assert bm.match_prefix(routing_seq(prompt)) == []


def test_eviction_and_a_cache_reset_drop_the_rows() -> None:
    bm = BlockManager(3, BS)
    prompt = list(range(400, 409))
    seq = routing_seq(prompt)
    compute(bm, seq)
    bm.free(seq)
    assert len(bm.match_prefix(routing_seq(prompt))) == 2
    bm.reset_prefix_cache()
    assert bm.match_prefix(routing_seq(prompt)) == []
    again = routing_seq(prompt)
    compute(bm, again)
    bm.free(again)
    other = Sequence("o", 0, list(range(500, 512)), SamplingParams())
    compute(bm, other)  # takes every block: the cached ones are evicted, their rows with them
    bm.free(other)
    assert bm.match_prefix(routing_seq(prompt)) == []


@pytest.mark.parametrize("num_experts", [8, 300])
def test_the_json_form_round_trips(num_experts: int) -> None:
    dtype = routing_dtype(num_experts)
    arr = np.random.default_rng(0).integers(0, num_experts, (5, 3, 2)).astype(dtype)
    wire = encode_routing(arr)
    assert wire["shape"] == [5, 3, 2] and wire["dtype"] == dtype
    assert len(base64.b64decode(wire["data"])) == arr.nbytes
    back = decode_routing(wire)
    assert back.dtype == arr.dtype and np.array_equal(back, arr) and back.flags.writeable


@pytest.mark.parametrize(("change", "field"), [
    ({"dtype": "int64"}, "routing.dtype"),
    ({"shape": [5, 3]}, "routing.shape"),
    ({"shape": [5, 3, 3]}, "routing.data"),
    ({"data": "not base64!"}, "routing.data"),
])
def test_a_malformed_json_form_is_refused_naming_the_field(change: dict, field: str) -> None:
    wire = {**encode_routing(np.zeros((5, 3, 2), dtype=np.uint8)), **change}
    with pytest.raises(InvalidRequestError) as e:
        decode_routing(wire)
    assert e.value.field == field
    with pytest.raises(InvalidRequestError) as e:
        decode_routing({"data": ""})
    assert e.value.field == "routing"


def test_return_routing_must_be_a_bool() -> None:
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(return_routing=1)  # type: ignore[arg-type]
    assert e.value.field == "sampling_params.return_routing"
