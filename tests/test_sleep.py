"""Sleep and wake through the engine on CPU: nothing lost at level 1, weights invalid at level 2,
buffers intact, every wrong transition a clear error, in-flight requests finished or held."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from inference.core import InvalidRequestError, SamplingParams, StateError
from inference.engine.llm import LLM
from inference.models.tiny import make_tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=5)
PROMPTS = [[5, 6, 7, 8, 9], [100, 200, 300, 7, 8, 9, 10, 11, 12]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("sleep") / "m", family="qwen2", seed=1)


@pytest.fixture
def llm(model_dir: Path) -> LLM:
    return LLM(model_dir, device="cpu", dtype="float32", kv_cache_bytes=2 << 20, block_size=4)


def run(llm: LLM) -> list[tuple[list[int], list[float], list]]:
    return [(c.token_ids, c.logprobs, c.top_logprobs) for o in llm.generate(PROMPTS, GREEDY) for c in o.outputs]


def buffers(llm: LLM) -> dict[str, torch.Tensor]:
    return {n: b.clone() for n, b in llm.worker.models["target"].named_buffers()}


def test_level1_cycle_keeps_outputs_bit_identical(llm: LLM) -> None:
    before, bufs = run(llm), buffers(llm)
    stats = llm.sleep(1)
    assert llm.is_sleeping and stats.bytes_by_tag["weights"] > 0 and stats.bytes_by_tag["kv_cache"] > 0
    llm.wake_up()
    assert not llm.is_sleeping
    assert run(llm) == before  # tokens, logprobs and top logprobs, exactly
    for name, b in buffers(llm).items():
        assert torch.equal(b, bufs[name]), name


def test_level2_leaves_weights_unloaded_until_a_sync(llm: LLM) -> None:
    bufs = buffers(llm)
    llm.sleep(2)
    llm.wake_up()
    with pytest.raises(StateError, match="sync the weights"):
        llm.generate(PROMPTS, GREEDY)
    with pytest.raises(StateError, match="sync the weights"):
        llm.add_request(PROMPTS[0], GREEDY, wait=False)
    for name, b in buffers(llm).items():  # rotary tables and other buffers survive level 2
        assert torch.equal(b, bufs[name]), name


def test_weights_wake_alone_while_kv_stays_released(llm: LLM) -> None:
    llm.sleep(1)
    llm.wake_up(["weights"])
    assert llm.worker.memory.state("kv_cache").value.startswith("asleep")
    with pytest.raises(StateError, match="kv_cache"):
        llm.generate(PROMPTS, GREEDY)
    llm.wake_up(["kv_cache"])
    assert len(run(llm)) == 2


def test_wrong_transitions_error_clearly(llm: LLM) -> None:
    with pytest.raises(StateError, match="nothing is asleep"):
        llm.wake_up()
    with pytest.raises(InvalidRequestError, match="level"):
        llm.sleep(3)
    with pytest.raises(InvalidRequestError, match="in_flight"):
        llm.sleep(1, in_flight="drop")
    llm.sleep(1)
    with pytest.raises(StateError, match="already asleep"):
        llm.sleep(1)
    with pytest.raises(InvalidRequestError, match="tags"):
        llm.wake_up(["weight"])
    with pytest.raises(StateError, match="wake_up"):
        llm.generate(PROMPTS, GREEDY)
    llm.wake_up()


def test_hold_keeps_requests_in_flight_and_finishes_them_after_wake(llm: LLM) -> None:
    expected = run(llm)
    ids = [llm.add_request(p, GREEDY) for p in PROMPTS]
    for _ in range(4):
        llm.step()  # the requests are now mid-generation
    llm.sleep(1, in_flight="hold")
    assert llm.step() == []  # asleep: nothing runs, nothing is dropped
    assert llm.has_unfinished()
    llm.wake_up()
    done = {}
    while llm.has_unfinished():
        done.update({o.request_id: o for o in llm.step()})
    got = [(c.token_ids, c.logprobs) for i in ids for c in done[i].outputs]
    # held sequences recompute their KV by prefill: same tokens, logprobs equal up to summation order
    assert [g[0] for g in got] == [e[0] for e in expected]
    for g, e in zip(got, expected):
        torch.testing.assert_close(torch.tensor(g[1]), torch.tensor(e[1]), atol=1e-5, rtol=0)


def test_finish_drains_in_flight_requests_before_sleeping(llm: LLM) -> None:
    ids = [llm.add_request(p, GREEDY) for p in PROMPTS]
    llm.step()
    llm.sleep(1, in_flight="finish")
    assert not llm.has_unfinished()
    assert sorted(o.request_id for o in llm.take_finished()) == sorted(ids)
    llm.wake_up()
