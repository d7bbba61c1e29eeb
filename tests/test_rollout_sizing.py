"""Batches as large as the KV cache allows: max_num_seqs "auto" is chosen from the KV blocks at sizing,
an explicit value wins, the scheduler runs the resolved value, the graph ladder reaches it; and the
engine's optional per-step records count what each step computed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from inference.core import InvalidRequestError, SamplingParams
from inference.engine.llm import LLM
from inference.engine.step_stats import StepLog, count_batch
from inference.engine.worker import (
    AUTO_MAX_NUM_SEQS,
    AUTO_MIN_NUM_SEQS,
    MAX_GRAPH_BATCH,
    auto_max_num_seqs,
    resolve_max_num_seqs,
)
from inference.runner.cuda_graphs import batch_ladder, extended_ladder
from inference.sched.scheduler import ScheduledBatch
from inference.sched.sequence import Sequence
from inference.speculative.decoder import SpecDecoder

TINY_KV_BYTES_PER_TOKEN = 2 * 3 * 4 * 16 * 4  # K and V x 3 layers x 4 kv heads x 16 dims x float32


def test_auto_rule_on_h200_sized_caches() -> None:
    # bench_rollout's max_model_len (512 + 2048): every sequence should hold 2048 tokens
    assert auto_max_num_seqs(10_000_000, 2560) == 1024  # Qwen2-0.5B: ~10M KV tokens on an H200
    assert auto_max_num_seqs(1_900_000, 2560) == 512  # Qwen2.5-7B: ~1.9M
    assert auto_max_num_seqs(512 * 2048, 2560) == 512
    assert auto_max_num_seqs(512 * 2048 - 1, 2560) == 256
    # a 32k context asks 8192 tokens a sequence: the 7B cache no longer feeds 512
    assert auto_max_num_seqs(1_900_000, 32768) == 256
    assert auto_max_num_seqs(10_000_000, 32768) == 1024
    # a short max_model_len needs no more than max_model_len a sequence
    assert auto_max_num_seqs(64 * 1024, 64) == 1024


def test_auto_rule_stays_at_the_old_default_on_a_small_cache() -> None:
    cpu_tokens = (128 << 20) // TINY_KV_BYTES_PER_TOKEN  # the CPU default budget for the tiny model
    assert auto_max_num_seqs(cpu_tokens, 2048) == 256
    assert auto_max_num_seqs(16, 2048) == AUTO_MIN_NUM_SEQS


@pytest.mark.parametrize("max_model_len", [2, 64, 2048, 2560, 8192, 32768, 131072])
def test_auto_rule_is_the_largest_power_of_two_that_holds_a_long_sequence_each(max_model_len: int) -> None:
    per_seq = min(max_model_len, max(2048, max_model_len // 4))
    previous = 0
    for kv_tokens in [1, 1000, 10**5, 5 * 10**5, 10**6, 2 * 10**6, 4 * 10**6, 10**7, 10**9]:
        n = auto_max_num_seqs(kv_tokens, max_model_len)
        assert n & (n - 1) == 0 and AUTO_MIN_NUM_SEQS <= n <= AUTO_MAX_NUM_SEQS
        assert n == AUTO_MIN_NUM_SEQS or n * per_seq <= kv_tokens  # each could hold per_seq tokens
        assert n == AUTO_MAX_NUM_SEQS or 2 * n * per_seq > kv_tokens  # the largest such
        assert n >= previous  # more cache never lowers the cap
        previous = n


def test_explicit_max_num_seqs_wins_and_bad_values_name_the_field() -> None:
    assert resolve_max_num_seqs(3, 10**9, 2048) == 3
    assert resolve_max_num_seqs(4096, 10, 2048) == 4096
    assert resolve_max_num_seqs(None, 10**9, 2048) == resolve_max_num_seqs(0, 10**9, 2048) == 1024
    for bad in (-1, True, 2.5):
        with pytest.raises(InvalidRequestError) as e:
            resolve_max_num_seqs(bad, 10**9, 2048)  # type: ignore[arg-type]
        assert e.value.field == "scheduler.max_num_seqs"


@pytest.mark.slow
def test_the_scheduler_runs_the_resolved_auto_value() -> None:
    # 40,000 KV tokens and max_model_len 64: 512 sequences of 64 tokens fit, 1024 do not
    llm = LLM(None, device="cpu", max_model_len=64, kv_cache_bytes=40_000 * TINY_KV_BYTES_PER_TOKEN)
    kv_tokens = llm.worker.num_blocks * llm.config.cache.block_size
    assert llm.worker.max_num_seqs == auto_max_num_seqs(kv_tokens, 64) == 512
    assert llm.scheduler.config.max_num_seqs == 512
    assert llm.config.scheduler.max_num_seqs is None  # run-time state, not written into the config
    llm.step_log = StepLog()
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    outs = llm.generate([[5 + i % 50, 7] for i in range(600)], params)
    assert all(len(o.outputs[0].token_ids) == 2 for o in outs)
    assert max(r.num_seqs for r in llm.step_log.records) == 512  # neither the old 256 nor the 600 waiting


@pytest.mark.slow
def test_an_explicit_max_num_seqs_caps_the_running_batch() -> None:
    llm = LLM(None, device="cpu", max_model_len=64, max_num_seqs=3, kv_cache_bytes=40_000 * TINY_KV_BYTES_PER_TOKEN)
    assert llm.worker.max_num_seqs == llm.scheduler.config.max_num_seqs == 3
    llm.step_log = StepLog()
    llm.generate([[5 + i, 7] for i in range(7)], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert max(r.num_seqs for r in llm.step_log.records) == 3


@pytest.mark.parametrize("max_batch", [1, 3, 8, 17, 100, 256, 257, 300, 512, 777, 1024])
def test_ladder_covers_the_maximum_with_bounded_padding(max_batch: int) -> None:
    sizes = batch_ladder(max_batch)
    assert sizes == sorted(set(sizes)) and sizes[-1] == max_batch
    for n in range(1, max_batch + 1):
        size = next(b for b in sizes if b >= n)
        if n > 256:
            assert size - n < size / 8, (n, size)  # above 256 the ladder is coarser, padding stays small
    # the sizes below the maximum do not depend on it (extended_ladder keeps a plain decode's graph)
    assert sizes[:-1] == [b for b in batch_ladder(2048) if b < max_batch]


def test_ladder_to_1024_is_as_short_as_the_old_one_to_512() -> None:
    sizes = batch_ladder(1024)
    assert len(sizes) == 36
    assert [b for b in sizes if b > 256] == [*range(288, 513, 32), *range(576, 1025, 64)]


@pytest.mark.parametrize("max_batch", [256, 512, 1024])
def test_speculation_graph_rows_still_reach_the_batch(max_batch: int) -> None:
    spec = SimpleNamespace(k=4)
    rows = SpecDecoder.graph_rows(spec, max_batch)  # type: ignore[arg-type]
    assert rows >= max_batch
    sizes = extended_ladder(max_batch, rows)
    assert max(sizes) == rows and set(batch_ladder(max_batch)) <= set(sizes)


def _seq(prompt_len: int, computed: int, generated: int = 0) -> Sequence:
    seq = Sequence("r", 0, list(range(1, prompt_len + 1)), SamplingParams())
    seq.token_ids += [9] * generated
    seq.num_computed_tokens = computed
    return seq


def test_count_batch_splits_decode_and_prefill_rows() -> None:
    decode_a, decode_b = _seq(10, 10, 1), _seq(4, 6, 3)  # one token to compute each, both sample
    chunk = _seq(20, 8)  # a prefill chunk of 5 tokens, not at the end: no sample
    last = _seq(12, 8)  # the prompt's last 4 tokens: samples, but it is a prefill row
    batch = ScheduledBatch([decode_a, decode_b, chunk, last], [1, 1, 5, 4])
    rows, n_decode, dec_tok, pre_tok, context, pairs, sampled = count_batch(batch)
    assert (rows, n_decode, dec_tok, pre_tok, sampled) == (4, 2, 2, 9, 3)
    assert context == 11 + 7 + 13 + 12
    assert pairs == 11 + 7 + (5 * 8 + 15) + (4 * 8 + 10)
    # the decode-only fast path agrees with the row-by-row count
    only = ScheduledBatch([decode_a, decode_b], [1, 1])
    assert count_batch(only) == (2, 2, 2, 0, 18, 18, 2)
    spec = ScheduledBatch([decode_a], [1], [3])  # a speculative row: 1 + 3 verified tokens
    assert count_batch(spec) == (1, 1, 4, 0, 14, 4 * 10 + 10, 1)


@pytest.mark.slow
def test_step_log_records_every_step_of_a_generation() -> None:
    llm = LLM(None, device="cpu", max_model_len=128)
    prompts = [[3, 4, 5], [6, 7, 8, 9, 10], [11, 12]]
    assert llm.step_log is None
    llm.step_log = StepLog()
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    records = llm.step_log.records
    assert sum(r.prefill_tokens for r in records) == sum(map(len, prompts))  # distinct prompts: no hits
    assert sum(r.decode_tokens for r in records) == 3 * (6 - 1)  # the prefill samples each first token
    assert sum(r.num_finished for r in records) == 3 and sum(r.num_sampled for r in records) == 3 * 6
    assert all(r.start_s <= r.end_s for r in records)
    assert records[-1].context_tokens == len(prompts[0]) + 6 - 1 + len(prompts[1]) + 6 - 1 + len(prompts[2]) + 5


@pytest.mark.cuda
def test_graphs_are_captured_up_to_the_resolved_batch() -> None:
    llm = LLM(None, device="cuda", dtype="float32", max_model_len=64,
              kv_cache_bytes=40_000 * TINY_KV_BYTES_PER_TOKEN)
    graphs = llm.worker.runner.graphs
    assert llm.worker.max_num_seqs == 512 and graphs is not None
    assert graphs.sizes == batch_ladder(min(512, MAX_GRAPH_BATCH))
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    out = llm.generate([[5 + i % 50, 7] for i in range(512)], params)
    assert all(len(o.outputs[0].token_ids) == 3 for o in out)
    torch.cuda.synchronize()
