"""Host time of one decode step, by stage, against the model forward measured in the same run.

One JSON line per batch size: the median microseconds per decode step (greedy, ignore_eos) spent on
the host in each stage, exclusive of nested stages: schedule, prepare (eager inputs, or the graph's
input staging), forward (the eager model; the graph replay's launch on CUDA), sampling_batch, sample
(launches), to_host (the step's one sync: on CUDA it also waits for the device; with async scheduling
it reads the step before, so it waits only for what of that step outlasts this step's host work),
commit (with async scheduling also `advance`, the placeholders of the step launched), and llm
(LLM.step's own bookkeeping: versions, stop strings, finished requests), execute_rest (the worker and
runner glue around them). host_us sums every stage
but forward and to_host; step_minus_forward_us is the median of (step wall - forward host time).
forward_us is the model's time per step: the wall time of the eager forward on CPU, the GPU time of
one graph replay on CUDA. step_us is the wall time of LLM.step; the ratio
host_share = 1 - forward_us / step_us is the part of a step the model does not account for.
Every case runs with async scheduling off and on ("async" in the JSON; --async-scheduling picks one).

    python3 scripts/bench/host_step.py                 # CPU: the tiny model; CUDA: Qwen2-0.5B's shape
    python3 scripts/bench/host_step.py --model tiny --batch 1 64 --async-scheduling on
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a file from a checkout too

from inference.core import SamplingParams
from inference.engine.llm import LLM


class StageClock:
    """Exclusive wall time per stage within one step: a stage's time excludes the stages it calls."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self._current: dict[str, float] = {}
        self._stack: list[float] = []  # time spent in children of each open stage

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._stack.append(0.0)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                total = time.perf_counter() - start
                children = self._stack.pop()
                self._current[name] = self._current.get(name, 0.0) + total - children
                if self._stack:
                    self._stack[-1] += total
                if name == "step":
                    self._current["step_wall"] = total
                    self.steps.append(self._current)
                    self._current = {}
        return timed

    def mark(self, name: str, value: float) -> None:
        self._current[name] = value

    def decode_steps(self) -> list[dict[str, float]]:
        return [s for s in self.steps if s.pop("decode", 0.0)]

    def medians_us(self) -> dict[str, float]:
        names = sorted({k for s in self.steps for k in s})
        return {k: round(statistics.median(s.get(k, 0.0) for s in self.steps) * 1e6, 1) for k in names}


class TimedGraph:
    """A CUDA graph whose replay (the launch only: it is asynchronous) is timed as a stage."""

    def __init__(self, graph: Any, replay: Callable[[], None]) -> None:
        self.graph = graph
        self.replay = replay


def instrument(llm: LLM, clock: StageClock) -> None:
    runner, scheduler = llm.worker.runner, llm.scheduler
    assert runner is not None
    schedule = scheduler.schedule

    def marked_schedule() -> Any:
        batch = schedule()
        clock.mark("decode", float(bool(batch.seqs) and all(batch.sample) and batch.num_tokens == batch.num_seqs))
        return batch

    scheduler.schedule = clock.wrap("schedule", marked_schedule)
    scheduler.commit = clock.wrap("commit", scheduler.commit)
    scheduler.commit_pending = clock.wrap("commit", scheduler.commit_pending)
    scheduler.advance = clock.wrap("commit", scheduler.advance)
    runner.collect = clock.wrap("to_host", runner.collect)
    runner.prepare = clock.wrap("prepare", runner.prepare)
    runner._forward = clock.wrap("forward", runner._forward)
    runner._sampling_batch = clock.wrap("sampling_batch", runner._sampling_batch)
    runner._sample = clock.wrap("sample", runner._sample)
    runner._to_host = clock.wrap("to_host", runner._to_host)
    if runner.graphs is not None:
        runner._graph_decode = clock.wrap("prepare", runner._graph_decode)
        for bs, graph in list(runner.graphs.graphs.items()):
            runner.graphs.graphs[bs] = TimedGraph(graph, clock.wrap("forward", graph.replay))
    llm.worker.execute_model = clock.wrap("execute_rest", llm.worker.execute_model)
    llm.step = clock.wrap("llm", llm.step)
    llm.step = clock.wrap("step", llm.step)


def graph_forward_us(llm: LLM, batch: int) -> float:
    """GPU time of one replay of the decode graph that serves `batch` rows."""
    graphs = llm.worker.runner.graphs
    graph = graphs.graphs[graphs.size_for(batch)]
    graph = getattr(graph, "graph", graph)
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(50):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 50 * 1e3


def build_llm(model: str, device: str, max_batch: int, max_len: int, overlap: bool) -> LLM:
    if model == "tiny":
        return LLM(None, device=device, max_num_seqs=max_batch, max_model_len=max_len, async_scheduling=overlap)
    from inference.models.tiny import hf_config
    from sidecar.demo.task import QWEN2_05B

    d = Path(tempfile.mkdtemp(prefix="bench-host-"))
    (d / "config.json").write_text(json.dumps(hf_config(QWEN2_05B)))
    return LLM(d, device=device, dtype="bfloat16", load_format="dummy", max_num_seqs=max_batch,
               max_model_len=max_len, gpu_memory_utilization=0.5, async_scheduling=overlap)


def run_case(model: str, device: str, batch: int, prompt_len: int, new_tokens: int,
             overlap: bool) -> dict[str, Any]:
    llm = build_llm(model, device, batch, prompt_len + new_tokens + 16, overlap)
    try:
        return _measure(llm, model, device, batch, prompt_len, new_tokens, overlap)
    finally:  # each case builds its own engine: give its memory back before the next one sizes its KV cache
        llm.worker.shutdown()
        del llm
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()


def _measure(llm: LLM, model: str, device: str, batch: int, prompt_len: int, new_tokens: int,
             overlap: bool) -> dict[str, Any]:
    vocab = min(llm.model_config.vocab_size, 4096)
    g = torch.Generator().manual_seed(batch)
    prompts = torch.randint(4, vocab, (batch, prompt_len), generator=g).tolist()
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
    clock = StageClock()
    instrument(llm, clock)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for p in prompts:
        llm.add_request(p, params)
    while llm.has_unfinished():
        llm.step()
    clock.steps = clock.decode_steps()
    med = clock.medians_us()
    outside = statistics.median(s["step_wall"] - s.get("forward", 0.0) for s in clock.steps) * 1e6
    step_us = med.pop("step_wall")
    med.pop("step", None)
    forward_us = graph_forward_us(llm, batch) if llm.worker.runner.graphs is not None else med["forward"]
    host = sum(v for k, v in med.items() if k not in ("forward", "to_host"))
    return {"bench": "host_step", "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "model": model, "batch": batch, "async": overlap, "decode_steps": len(clock.steps), "stages_us": med,
            "host_us": round(host, 1), "step_minus_forward_us": round(outside, 1),
            "forward_us": round(forward_us, 1), "step_us": step_us,
            "host_share": round(1 - forward_us / step_us, 3), "host_over_forward": round(host / forward_us, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cuda = torch.cuda.is_available()
    ap.add_argument("--model", choices=["tiny", "qwen2-0.5b"], default="qwen2-0.5b" if cuda else "tiny")
    ap.add_argument("--device", default="cuda" if cuda else "cpu")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--async-scheduling", choices=["both", "on", "off"], default="both",
                    help="run each case with async scheduling off and on, or only one way")
    args = ap.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)  # steadier medians on a shared machine
    modes = {"both": [False, True], "on": [True], "off": [False]}[args.async_scheduling]
    for batch in args.batch:
        for overlap in modes:
            print(json.dumps(run_case(args.model, args.device, batch, args.prompt_len, args.new_tokens, overlap)),
                  flush=True)


if __name__ == "__main__":
    main()
