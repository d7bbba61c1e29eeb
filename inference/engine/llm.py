"""The engine: requests in, outputs out. Validation, scheduling, detokenization and stop strings.

`LLM` drives one Worker. With tensor parallelism every rank runs its own LLM over the same requests
in lockstep (SPMD): scheduling is deterministic, logits are gathered to every rank and the sampling
generators share a seed, so all ranks produce the same tokens; the sidecar's rank loop
(sidecar/ranks/server.py) feeds every rank the same calls at the same step boundary.

With async scheduling (SchedulerConfig.async_scheduling; docs/dev/design.md, "Async scheduling") a
step() schedules and launches step i + 1 while step i still runs on the device, then reads back and
commits step i: step i + 1 stays in flight when step() returns. Everything that must not overlap a
step (sleep, a weight update) first settles the step in flight (`_settle`; inference/engine/async_step.py).
A weight sync goes live between two steps; each request's SyncPolicy (on_sync, max_staleness) then
says whether it keeps its KV, recomputes it or restarts from its prompt (Scheduler.on_weights_live).
A request with return_routing (an MoE model) gets, per completion, the experts chosen for each token it
computed: the runner stores them in the sequence by position, the prefix cache keeps them with the
blocks they describe, and the output reads them back as an array (docs/moe.md).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from inference import envs
from inference.config import EngineConfig, build_engine_config
from inference.core import (
    CompletionOutput,
    FinishReason,
    InvalidRequestError,
    OnSync,
    RequestOutput,
    SamplingParams,
    StateError,
    SyncPolicy,
    routing_dtype,
)
from inference.engine.async_step import StepOverlap
from inference.engine.step_stats import StepLog
from inference.engine.warm_up import warm_up_engine
from inference.engine.worker import Worker
from inference.memory.sleep import TransitionStats
from inference.models.hub_cache import resolve_model_dir
from inference.parallel import TPInfo
from inference.sched.block_manager import BlockManager
from inference.sched.routing_rows import RoutingRows
from inference.sched.scheduler import ScheduledBatch, Scheduler, StepResult
from inference.sched.sequence import Sequence
from inference.speculative.decoder import SpecDecodeStats
from inference.text.prompts import check_text, check_token_ids
from inference.text.stop_strings import StopDetector, StopStrings
from inference.text.tokenizer import Tokenizer

Prompt = str | Seq[int]


def check_tp_size(config: EngineConfig, tp: TPInfo | None) -> None:
    """Refuse a tensor-parallel size this process cannot run (InvalidRequestError naming tp_size).

    An LLM is one rank in one process: TP=N needs N processes that each build an LLM with their
    TPInfo (the rank, the size and the process group), as `sidecar launch --tp N` does for you
    (sidecar/ranks/pool.py). So `LLM(model, tp_size=2)` without a TPInfo is refused rather than run at
    TP 1, and a TPInfo whose size differs from config.tp_size is refused as a contradiction.
    """
    size = 1 if tp is None else tp.size
    if config.tp_size == size:
        return
    if tp is None:
        raise InvalidRequestError(
            "tp_size", f"LLM(tp_size={config.tp_size}) cannot shard the model by itself: an in-process LLM is "
            f"one rank. Serve it with `sidecar launch --tp {config.tp_size}` (one process per rank: gloo on CPU, "
            "NCCL on CUDA), or build one LLM per rank in your own process group with tp=TPInfo(rank, size, group)")
    raise InvalidRequestError("tp_size", f"config.tp_size is {config.tp_size} but tp (TPInfo) has size {tp.size}")


def model_dirs(config: EngineConfig) -> EngineConfig:
    """`config` with its model and draft model as directories: a model id (ORG/NAME) becomes its snapshot
    in the local Hugging Face cache, by the rule `sidecar launch --model` follows (hub_cache.py); a name
    that is neither is an InvalidRequestError naming the field, the id and the cache directory."""
    model = resolve_model_dir(config.model)
    draft = None if config.draft_model is None else resolve_model_dir(config.draft_model, field="draft_model")
    if (model, draft) == (config.model, config.draft_model):
        return config
    return replace(config, model=model, draft_model=draft)


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    seqs: list[Sequence]
    arrival: float
    detoks: dict[int, StopDetector] = field(default_factory=dict)  # stop-string detection, per sequence
    stops: StopStrings | None = None  # the stop strings' automaton, shared by the request's sequences


class LLM:
    """`LLM(model_dir).generate(prompts, SamplingParams(...))`; model_dir None is the embedded tiny model."""

    def __init__(self, model: str | Path | None = None, *, config: EngineConfig | None = None,
                 tp: TPInfo | None = None, dp_rank: int = 0, **overrides: Any) -> None:
        if config is None:
            if model is None:
                from inference.models.tiny import default_model_dir
                model = default_model_dir()
            overrides.setdefault("tp_size", 1 if tp is None else tp.size)
            config = build_engine_config(str(model), **overrides)
        check_tp_size(config, tp)  # refused before anything is looked up or loaded
        config = model_dirs(config)
        SyncPolicy(config.on_sync)  # InvalidRequestError naming on_sync for an unknown mode
        envs.use_kernel_cache()  # before the first compile: kernels persist under SIDECAR_HOME when set
        self.config = config
        self.worker = Worker(config, tp, dp_rank=dp_rank)
        self.worker.init_device()
        self.worker.load_model()
        mc = self.worker.model_config
        assert mc is not None and self.worker.runner is not None and self.worker.device is not None
        self.model_config = mc
        kv_bytes = self.worker.determine_available_memory()
        num_blocks = kv_bytes // self.worker.kv_bytes_per_block(config.cache.block_size)
        self.worker.initialize_kv_cache(num_blocks)
        self.worker.warm_up()
        self.tokenizer = Tokenizer.from_dir(config.tokenizer or config.model)
        self.max_model_len = self.worker.max_model_len
        eos = mc.eos_token_ids or (self.tokenizer.eos_token_ids if self.tokenizer else ())
        self.eos_token_ids = tuple(eos)
        self.block_manager = BlockManager(num_blocks, config.cache.block_size, config.cache.enable_prefix_caching)
        # the scheduler gets max_num_seqs as resolved at KV sizing (the worker owns that value)
        self.scheduler = Scheduler(replace(config.scheduler, max_num_seqs=self.worker.max_num_seqs),
                                   self.block_manager, self.max_model_len, self.eos_token_ids,
                                   self.worker.num_speculative_tokens,
                                   self.worker.spec is not None and self.worker.spec.shares_kv)
        self.spec_stats = SpecDecodeStats()  # draft tokens proposed / accepted (speculative decoding)
        self.step_log: StepLog | None = None  # assign a StepLog to keep one record per step (benchmarks)
        self._requests: dict[str, _Request] = {}
        self._ids = itertools.count()
        self._finished_while_draining: list[RequestOutput] = []  # finished outside step(): take_finished
        # async scheduling: the step in flight and the step that overlaps it (None: synchronous steps)
        self._overlap = (StepOverlap(self.scheduler, self.worker, self._apply_results)
                         if config.scheduler.overlaps_steps(self.worker.device.type) else None)
        self._num_with_stops = 0  # live requests with stop strings (their steps run the detokenizer)
        self._num_with_routing = 0  # live requests with return_routing (their blocks keep routing)
        weights = self.worker.weights  # however a sync reaches it (this API or a rank server), the engine hears
        weights.before_write, weights.on_live = self._before_weight_write, self._on_weights_live
        # compile what rollouts run now rather than in the first batch (on CPU nothing compiles)
        self.warm_up_s = warm_up_engine(self) if self.worker.device.type == "cuda" else 0.0

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None, *, wait: bool = True, prompt_text: str | None = None,
                    on_sync: OnSync | None = None, max_staleness: int | None = None, share: str | None = None) -> str:
        """Validate and queue one prompt. Raises InvalidRequestError naming the field; queues nothing then.

        `on_sync` ("keep", "recompute", "abort"; None: EngineConfig.on_sync) and `max_staleness` say
        what a weight sync that goes live while it runs does to it (inference.core.SyncPolicy).

        While the engine is asleep (or its weights await a sync) the request waits in the queue;
        with wait=False it is refused with a StateError instead. `prompt_text`: the text that `prompt`'s
        token ids were tokenized from by the caller (the sidecar tokenizes off the step loop), kept
        for the output only. `share`: the unit of fair admission (the sidecar passes its HTTP call's id, so
        the prompts of one call share one turn); None: this request alone.
        """
        params = params or SamplingParams()
        policy = SyncPolicy(on_sync, max_staleness)  # checked here, before anything is queued
        if not wait:
            self.check_ready()
        text, ids = self._checked(prompt, params)
        return self._enqueue(text if prompt_text is None else prompt_text, ids, params, request_id, policy, share)

    def _checked(self, prompt: Prompt, params: SamplingParams) -> tuple[str | None, list[int]]:
        """(text, token ids) of a valid request; InvalidRequestError naming the field otherwise."""
        text, ids = self._tokenize(prompt)
        self._check_prompt(ids, params)
        return text, ids

    def _enqueue(self, text: str | None, ids: list[int], params: SamplingParams, request_id: str | None,
                 policy: SyncPolicy, share: str | None = None) -> str:
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in flight")
        seqs = Sequence.group(request_id, ids, params)
        for s in seqs:
            s.on_sync = policy.on_sync or self.config.on_sync
            s.max_staleness = policy.max_staleness
            s.share = share if share is not None else request_id
        req = _Request(request_id, text, list(ids), seqs, time.monotonic())
        if params.stop and self.tokenizer is not None:
            req.stops = StopStrings(params.stop)  # linear in their characters (the HTTP intake bounds them)
            req.detoks = {s.index: StopDetector(self.tokenizer, ids, req.stops) for s in seqs}
            self._num_with_stops += 1
        if params.return_routing:
            runner = self.worker.runner
            assert runner is not None and runner.routing is not None, "return_routing checked on a dense model"
            for s in seqs:
                s.routing = RoutingRows(runner.routing.row_bytes)
            self._num_with_routing += 1
        self._requests[request_id] = req
        for s in seqs:
            self.scheduler.add(s)
        return request_id

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("prompt", "this model has no tokenizer.json: send token ids")
            check_text(prompt)  # a lone surrogate is a bad prompt, not a tokenizer crash
            return prompt, self.tokenizer.encode(prompt)
        if not isinstance(prompt, Seq) or isinstance(prompt, bytes):
            raise InvalidRequestError("prompt", f"must be a string or a list of token ids, got {type(prompt).__name__}")
        return None, list(prompt)

    def _check_prompt(self, ids: list[int], params: SamplingParams) -> None:
        vocab = self.model_config.vocab_size
        check_token_ids(ids, vocab)
        params.check_limits(vocab, self.max_model_len, len(ids))  # the one policy: inference/core.py
        if params.return_routing and not self.model_config.num_moe_layers:
            raise InvalidRequestError("sampling_params.return_routing", f"{self.model_config.family} is a dense "
                                      "model: it has no experts to route (return_routing needs an MoE model: "
                                      "qwen3_moe, mixtral)")
        self.scheduler.validate(len(ids), params)  # and what the KV cache can ever hold

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)
        req = self._requests.pop(request_id, None)
        if req is not None:
            self._num_with_stops -= bool(req.detoks)
            self._num_with_routing -= req.seqs[0].params.return_routing

    def live_sequences(self, request_id: str) -> list[Sequence]:
        """The samples of a request not returned yet ([] otherwise): what a streaming caller reads. Their
        committed tokens are the first `num_generated - num_pending` of the completion."""
        req = self._requests.get(request_id)
        return req.seqs if req is not None else []

    def has_unfinished(self) -> bool:
        """Requests not returned yet, or a step in flight (async scheduling): step() has work."""
        return bool(self._requests) or (self._overlap is not None and self._overlap.in_flight is not None)

    # ---- stepping -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; return the requests that finished in it. Asleep: nothing runs.

        With async scheduling the step launched here stays in flight and the requests returned are
        those that finished in the step launched by the call before (read back after this launch);
        when nothing is left to run, the step in flight is read back too."""
        if not self.worker.is_ready():
            return self._settle()
        overlap = self._overlap
        # a speculative step (the drained tail, with a draft) runs synchronously: settle the step in
        # flight first, so the scheduler sees every token
        settled = bool(overlap is not None and overlap.in_flight is not None
                       and self.scheduler.speculates_next() and overlap.finish())
        batch = self.scheduler.schedule()
        if batch.is_empty and (overlap is None or overlap.in_flight is None):
            if self.scheduler.has_unfinished() and not settled:
                raise StateError("scheduler made no progress with requests pending (KV cache too small?)")
            return self._collect_finished() if settled else []
        if overlap is not None and not any(batch.num_lookahead):
            finished = overlap.step(batch, self.step_log)
        else:
            finished = self._step_sync(batch)
        # a request completes only when one of its sequences finishes (abort drops it at once)
        return self._collect_finished() if finished or settled else []

    def _step_sync(self, batch: ScheduledBatch) -> list[Sequence]:
        steps = self.step_log
        pending = steps.begin(batch) if steps is not None else None
        results = self.worker.execute_model(batch)
        finished = self._apply_results(batch, results, self.scheduler.commit)
        self._count_speculation(batch, results)
        if steps is not None and pending is not None:
            steps.end(pending, len(finished))
        return finished

    def _settle(self) -> list[RequestOutput]:
        """Read back and commit the step in flight, if any; the requests it finished."""
        if self._overlap is None:
            return []
        return self._collect_finished() if self._overlap.finish() else []

    def _apply_results(self, batch: ScheduledBatch, results: list[StepResult],
                       commit: Callable[[ScheduledBatch, list[StepResult]], list[Sequence]]) -> list[Sequence]:
        """Commit a step's results (scheduler.commit, or commit_pending for a step with placeholders),
        then its stop strings; return the sequences that finished. Routing rows the step brought go to
        the blocks already registered first (async scheduling registers them at launch), before a
        commit that finishes a sequence frees them."""
        if self._num_with_routing:
            for seq in batch.seqs:
                if seq.routing is not None:
                    self.block_manager.keep_routing(seq)
        self._record_versions(batch.seqs, results)
        stops = self._num_with_stops > 0
        before = [s.num_tokens - s.num_pending for s in batch.seqs] if stops else []
        finished = commit(batch, results)
        if stops:
            finished += self._apply_stop_strings(batch.seqs, results, before)
        return finished

    def _count_speculation(self, batch: Any, results: list) -> None:
        proposed = sum(batch.num_lookahead)
        if proposed:
            self.spec_stats.steps += 1
            self.spec_stats.proposed += proposed
            self.spec_stats.accepted += sum(len(r) - 1 for r in results if isinstance(r, list))

    def _record_versions(self, seqs: list[Sequence], results: list) -> None:
        """Before a commit: the step's tokens start a span when the weight version (the target's, and
        the draft's if there is one) changed."""
        weights = self.worker.weights
        version = self.weight_version
        draft = weights.version("draft") if weights.has_draft else None
        for seq, res in zip(seqs, results):  # runs for every row of every step: reads the sequence only
            if res is None or seq.is_finished:
                continue
            if seq.span_version != version:
                seq.start_span(seq.num_generated - seq.num_pending, version)
            if draft is not None and seq.draft_span_version != draft:
                seq.start_draft_span(seq.num_generated - seq.num_pending, draft)

    def _apply_stop_strings(self, seqs: list[Sequence], results: list, before: list[int]) -> list[Sequence]:
        """Finish sequences whose new text completes a stop string (detection only; see _output);
        return them.

        A speculative step appends several tokens: they are checked one at a time and the tokens
        after the one that completes the stop string are dropped. A run that the token rules finished
        (a stop token, EOS, max_tokens) is checked up to its last token too: a stop string completed
        earlier in the run wins, as it would have one token a step (on the same token the token rule
        does, as there)."""
        finished = []
        for seq, res, start_len in zip(seqs, results, before):
            if res is None:
                continue
            req = self._requests.get(seq.request_id)
            if req is None or not req.detoks:
                continue
            done = seq.is_finished  # by a token rule in this step (or aborted: then nothing was appended)
            detector = req.detoks[seq.index]
            for end in range(start_len + 1, seq.num_tokens + (0 if done else 1)):
                hit = detector.add(seq.token_ids[end - 1:end])
                if hit is None:
                    continue
                if done:
                    seq.finish_reason, seq.stop_reason = FinishReason.STOP, hit[1]
                else:
                    self.scheduler.finish(seq, FinishReason.STOP, hit[1])
                    finished.append(seq)
                seq.truncate(end)
                break
        return finished

    def _collect_finished(self) -> list[RequestOutput]:
        done = [r for r in self._requests.values() if all(s.is_finished for s in r.seqs)]
        for r in done:
            del self._requests[r.request_id]
            self._num_with_stops -= bool(r.detoks)
            self._num_with_routing -= r.seqs[0].params.return_routing
        return [self._output(r) for r in done]

    def _output(self, req: _Request) -> RequestOutput:
        outs = []
        for s in req.seqs:
            text = None
            if self.tokenizer is not None:
                text = self.tokenizer.decode(s.completion_token_ids)
                if isinstance(s.stop_reason, str) and s.stop_reason in text:
                    text = text[:text.index(s.stop_reason)]  # the stop string is not part of the output
            outs.append(CompletionOutput(
                index=s.index, token_ids=list(s.completion_token_ids), logprobs=list(s.logprobs),
                finish_reason=s.finish_reason, text=text,
                top_logprobs=list(s.top_logprobs) if s.top_logprobs is not None else None,
                stop_reason=s.stop_reason, weight_version_spans=list(s.version_spans),
                draft_version_spans=list(s.draft_version_spans), restarts=s.restarts,
                routing=self._routing_array(s)))
        versions = [v for s in req.seqs for _, v in s.version_spans]
        metrics = {"latency_s": time.monotonic() - req.arrival}
        proposed, accepted = sum(s.spec_proposed for s in req.seqs), sum(s.spec_accepted for s in req.seqs)
        if proposed:
            metrics.update(spec_acceptance_rate=accepted / proposed, draft_tokens_proposed=proposed,
                           draft_tokens_accepted=accepted)
        preemptions = sum(s.preemptions for s in req.seqs)
        if preemptions:
            metrics["preemptions"] = preemptions
        return RequestOutput(
            request_id=req.request_id, prompt_token_ids=req.prompt_ids, outputs=outs,
            weight_version=min(versions, default=self.weight_version), prompt=req.prompt,
            num_cached_tokens=sum(s.num_cached_tokens for s in req.seqs),
            metrics=metrics)

    def _routing_array(self, seq: Sequence) -> np.ndarray | None:
        """seq's routing [tokens, moe layers, k] (CompletionOutput.routing): the rows of every token
        computed, i.e. all but the last (or, aborted, those written so far); None unless it asked."""
        rows = seq.routing
        if rows is None:
            return None
        mc = self.model_config
        n = min(rows.length, seq.num_tokens - 1)
        shape = (n, mc.num_moe_layers, mc.num_experts_per_tok)
        return np.frombuffer(rows.read(0, n), dtype=routing_dtype(mc.num_experts)).reshape(shape).copy()

    def generate(self, prompts: Prompt | Seq[Prompt],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None, *,
                 on_sync: OnSync | None = None, max_staleness: int | None = None) -> list[RequestOutput]:
        """Generate for every prompt; outputs in prompt order. Nothing is queued if any input is bad.
        `on_sync`, `max_staleness`: as add_request's, for every prompt."""
        policy = SyncPolicy(on_sync, max_staleness)  # checked here, before anything is queued
        if isinstance(prompts, str) or (isinstance(prompts, Seq) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if isinstance(sampling_params, Seq):
            if len(sampling_params) != len(prompts):
                raise InvalidRequestError("sampling_params", f"{len(sampling_params)} given for {len(prompts)} prompts")
            params_list = list(sampling_params)
        else:
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        checked = self._validate_all(prompts, params_list)
        self.check_ready()  # a synchronous call cannot wait for a wake-up that only the caller can do
        share = f"generate-{next(self._ids)}"  # one call, one turn of fair admission: FCFS inside it
        ids = [self._enqueue(text, tokens, sp, None, policy, share) for (text, tokens), sp in zip(checked, params_list)]
        results: dict[str, RequestOutput] = {}
        while any(i not in results for i in ids):
            for out in self.step():
                results[out.request_id] = out
        return [results[i] for i in ids]

    def _validate_all(self, prompts: list, params_list: list[SamplingParams]) -> list[tuple[str | None, list[int]]]:
        """Every request checked (and tokenized once) before any is queued."""
        checked = []
        for i, (p, sp) in enumerate(zip(prompts, params_list)):
            try:
                checked.append(self._checked(p, sp))
            except InvalidRequestError as e:
                raise InvalidRequestError(e.field.replace("prompt", f"prompts[{i}]", 1)
                                          if e.field == "prompt" else f"{e.field} (prompt {i})", e.message) from None
        return checked

    # ---- sleep and wake -------------------------------------------------------------------
    def check_ready(self) -> None:
        """Raise StateError saying why no step can run (asleep, or weights awaiting a sync); the worker
        decides (Worker.check_ready)."""
        self.worker.check_ready()

    @property
    def weight_version(self) -> int:
        """The live version of the target's weights (the weights component owns it)."""
        return self.worker.weights.version("target")

    @property
    def is_sleeping(self) -> bool:
        return self.worker.memory is not None and self.worker.memory.is_sleeping

    def sleep(self, level: int = 1, in_flight: str = "finish") -> TransitionStats:
        """Give the device memory back. in_flight="finish" first runs every queued request to the end;
        "hold" keeps them (their KV is recomputed after wake_up). No request is dropped either way.
        The KV cache and the prefix cache are dropped at every level.
        """
        if in_flight not in ("finish", "hold"):
            raise InvalidRequestError("in_flight", f"must be 'finish' or 'hold', got {in_flight!r}")
        if level not in (1, 2) or isinstance(level, bool):
            raise InvalidRequestError("level", f"sleep level must be 1 or 2, got {level!r}")
        if self.is_sleeping:
            raise StateError("sleep: already asleep; call wake_up first")
        # Requests that cannot run now (weights torn or awaiting a sync) are held, not waited for.
        while in_flight == "finish" and self.has_unfinished() and self.worker.is_ready():
            self._finished_while_draining.extend(self.step())
        self._finished_while_draining.extend(self._settle())
        self.scheduler.preempt_all()
        self.block_manager.reset_prefix_cache()
        return self.worker.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> TransitionStats:
        """Map "weights" and/or "kv_cache" back (None: all). Generation resumes once all is awake and
        the weights are valid (after a level-2 sleep: after the next weight sync)."""
        return self.worker.wake_up(tags)

    def take_finished(self) -> list[RequestOutput]:
        """Outputs of requests that finished outside step(): while sleep() drained the queue, or in the
        step in flight that sleep() or a weight update read back first (async scheduling)."""
        out, self._finished_while_draining = self._finished_while_draining, []
        return out

    # ---- weight updates (the worker's weights component runs them: inference/weights/updater.py) ----
    def start_weight_update(self, version: int, manifest: Any, *, allow_cast: bool = False) -> None:
        self.worker.weights.start("target", version, manifest, allow_cast=allow_cast)

    def start_draft_weight_update(self, version: int, manifest: Any, *, allow_cast: bool = False) -> None:
        self.worker.weights.start("draft", version, manifest, allow_cast=allow_cast)

    def update_weights(self, update_info: Any = None, *, digests_follow: bool = False) -> Any:
        return self.worker.weights.update(update_info, digests_follow=digests_follow)

    def finish_weight_update(self, sender_digests: Any, **kwargs: Any) -> Any:
        """Audit the update; on success the version goes live (a target update is then the engine's
        weight_version). A mismatch raises (the model stays torn, nothing changes here)."""
        return self.worker.weights.finish(sender_digests, **kwargs)

    def _before_weight_write(self) -> None:
        """A sync is about to write or audit the weights: no step may be in flight on them."""
        self._finished_while_draining.extend(self._settle())

    def _on_weights_live(self, which: str) -> None:
        """A version of `which` went live (its audit passed; no step in flight: `_before_weight_write`
        settled it). Every live sequence follows its SyncPolicy (Scheduler.on_weights_live): kept,
        recomputed, or restarted from its prompt (its stop-string detector restarts too). The prefix
        cache is dropped: its KV came from the old weights (a kept sequence's blocks chain from the
        forgotten entries, so they are never hit)."""
        for seq in self.scheduler.on_weights_live(self.weight_version):
            req = self._requests.get(seq.request_id)
            if req is not None and req.stops is not None and self.tokenizer is not None:
                req.detoks[seq.index] = StopDetector(self.tokenizer, req.prompt_ids, req.stops)
        self.block_manager.reset_prefix_cache()
