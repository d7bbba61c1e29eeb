"""The decode step's host path: graph input staging sends what the step needs (block-table rows only
when they changed), greedy_rows is sample's greedy answer, and the runner reuses a SamplingBatch only
while it cannot change."""

from __future__ import annotations

import pytest
import torch

from inference.batch import AttentionMetadata
from inference.core import SamplingParams
from inference.engine.llm import LLM
from inference.runner.cuda_graphs import DecodeInputs
from inference.sample.sampler import SamplingBatch, greedy_rows, sample
from inference.sched.sequence import Sequence


def staged(inputs: DecodeInputs, bs: int) -> tuple[list, list, list, list, list]:
    ids, pos, slots, ctx, tables = inputs.views(bs)
    return ids.tolist(), pos.tolist(), slots.tolist(), ctx.tolist(), tables.tolist()


def test_stage_writes_rows_and_padding() -> None:
    inputs = DecodeInputs(8, 4, "cpu")
    inputs.stage(4, [11, 12, 13], [5, 9, 0], [21, 22, 23], [6, 10, 1], [[1], [2, 3], [4]])
    ids, pos, slots, ctx, tables = staged(inputs, 4)
    assert (ids, pos, slots, ctx) == ([11, 12, 13, 0], [5, 9, 0, 0], [21, 22, 23, -1], [6, 10, 1, 0])
    assert [t[:2] for t in tables[:3]] == [[1, 0], [2, 3], [4, 0]]
    assert inputs.views(4)[3].dtype == torch.int32 and inputs.views(4)[0].dtype == torch.int64
    for bs in range(1, 9):  # every part starts 16-byte aligned, inside the buffer
        views = inputs.views(bs)
        assert all(v.data_ptr() % 16 == 0 and v.shape[0] == bs for v in views)
        assert views[3].data_ptr() + 4 * bs <= inputs.rows.data_ptr() + 8 * DecodeInputs.num_words(bs)
    # another size lays its rows out at other offsets: a full batch of 8 has no padding row
    inputs.stage(8, list(range(8)), list(range(8)), list(range(8)), list(range(1, 9)), [[7]] * 8)
    ids, pos, slots, ctx, tables = staged(inputs, 8)
    assert ids == pos == slots == list(range(8)) and ctx == list(range(1, 9))
    assert [t[0] for t in tables] == [7] * 8


def test_write_pads_with_token_zero_whatever_another_size_left() -> None:
    """Spec decode's verify and draft rows come as tensors (write). The rows of one graph size overlap
    another size's slots and positions, so a padding row must not inherit those as token ids: a slot
    number fed to the embedding is out of the vocabulary (a device-side assert on the GPU)."""
    inputs = DecodeInputs(8, 4, "cpu")
    big = [10_000 + i for i in range(8)]
    inputs.stage(8, big, big, big, list(range(1, 9)), [[7]] * 8)
    t = torch.tensor
    inputs.write(6, t([1, 2, 3]), t([4, 5, 6]), t([7, 8, 9]), t([5, 6, 7], dtype=torch.int32),
                 t([[1], [2], [3]], dtype=torch.int32))
    ids, pos, slots, ctx, tables = staged(inputs, 6)
    assert ids == [1, 2, 3, 0, 0, 0] and pos == [4, 5, 6, 0, 0, 0]
    assert slots == [7, 8, 9, -1, -1, -1] and ctx == [5, 6, 7, 0, 0, 0]
    assert [r[0] for r in tables[:3]] == [1, 2, 3]


def test_stage_resends_exactly_the_changed_table_rows() -> None:
    inputs = DecodeInputs(4, 6, "cpu")
    a, b, c = [1, 2], [3], [4, 5]
    rows = ([0, 0, 0], [0, 0, 0], [0, 0, 0], [1, 1, 1])
    inputs.stage(4, *rows, [a, b, c])
    assert [t[:2] for t in staged(inputs, 4)[4][:3]] == [[1, 2], [3, 0], [4, 5]]
    inputs.tables[0, 0] = 99  # a marker: rows that are not re-sent keep it
    b.append(8)  # a sequence grew by a block
    inputs.stage(4, *rows, [a, b, c])
    tables = staged(inputs, 4)[4]
    assert tables[0][0] == 99 and tables[1][:2] == [3, 8]
    c2 = [6, 7]  # same length, new list: the block manager reallocated this sequence
    inputs.stage(4, *rows, [a, b, c2])
    assert staged(inputs, 4)[4][2][:2] == [6, 7]
    inputs.stage(2, [0, 0], [0, 0], [0, 0], [1, 1], [c2, a])  # rows reordered
    assert [t[:2] for t in staged(inputs, 2)[4]] == [[6, 7], [1, 2]]
    inputs.write(2, torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64),
                 torch.zeros(2, dtype=torch.int64), torch.ones(2, dtype=torch.int32),
                 torch.full((2, 1), 5, dtype=torch.int32))
    inputs.stage(2, [0, 0], [0, 0], [0, 0], [1, 1], [c2, a])  # after a tensor write every row is re-sent
    assert [t[:2] for t in staged(inputs, 2)[4]] == [[6, 7], [1, 2]]


def test_build_packs_metadata_like_the_lists() -> None:
    meta = AttentionMetadata.build([3, 1], [3, 9], torch.arange(4), [[5], [1, 2, 3]], 4, "cpu")
    assert meta.cu_query_lens.tolist() == [0, 3, 4] and meta.context_lens.tolist() == [3, 9]
    assert meta.block_tables.tolist() == [[5, 0, 0], [1, 2, 3]] and meta.block_tables.dtype == torch.int32
    assert meta.slot_mapping.tolist() == [0, 1, 2, 3] and not meta.is_decode


def test_greedy_rows_equals_sample() -> None:
    logits = 3 * torch.randn(5, 700, generator=torch.Generator().manual_seed(0))
    logits[2, 10] = logits[2, 600] = logits[2].max() + 1  # a tie: the first index, as argmax
    sb = SamplingBatch.build([SamplingParams(temperature=0.0)] * 5, [None] * 5, [0] * 5, 700, torch.device("cpu"))
    want = sample(logits, sb)
    got = greedy_rows(logits, torch.empty(5, 2, dtype=torch.float64))
    assert got[:, 0].tolist() == want.token_ids.tolist() and int(got[2, 0]) == 10
    # the same math; a last-bit difference seen under a loaded CPU is not a different result
    torch.testing.assert_close(got[:, 1], want.logprobs.double(), rtol=0, atol=1e-6)


def test_sampling_batch_reused_only_while_it_cannot_change() -> None:
    llm = LLM(None, device="cpu", max_num_seqs=4)
    runner = llm.worker.runner
    greedy = [Sequence("a", 0, [5, 6], SamplingParams(temperature=0.0)),
              Sequence("b", 0, [7], SamplingParams(temperature=0.8, top_k=5))]
    first = runner._sampling_batch(greedy)
    assert runner._sampling_batch(greedy) is first
    assert runner._sampling_batch(greedy[::-1]) is not first  # other rows, other order
    seeded = [Sequence("c", 0, [5], SamplingParams(temperature=1.0, seed=3))]
    one = runner._sampling_batch(seeded)
    seeded[0].append(9, -1.0)
    two = runner._sampling_batch(seeded)
    assert two is not one and two.row_seeds != one.row_seeds  # the seed follows the output position


@pytest.mark.slow
def test_engine_outputs_with_stop_strings_and_plain_requests_mixed() -> None:
    """Requests finish in any step order; those with stop strings are still cut at the stop."""
    llm = LLM(None, device="cpu", max_num_seqs=4)
    plain = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    ref = llm.generate(["the cat sat"], plain)[0].outputs[0]
    assert ref.text
    stop = ref.text[2:4]
    outs = llm.generate(["the cat sat", "a b c d"], [SamplingParams(temperature=0.0, max_tokens=6,
                                                                    ignore_eos=True, stop=[stop]), plain])
    assert stop not in outs[0].outputs[0].text and outs[0].outputs[0].finish_reason.value == "stop"
    assert len(outs[1].outputs[0].token_ids) == 6
    assert llm._num_with_stops == 0 and not llm.has_unfinished()
