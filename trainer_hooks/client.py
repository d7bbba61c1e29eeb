"""`SidecarClient`: the HTTP API of one sidecar from Python, with typed errors, timeouts and safe retries.

- Every call has a timeout (the client's default, or the call's `timeout=`); generation and weight
  calls default to the longer `long_timeout` because the server answers only when they are done.
- The exchange itself (the kept-alive wire, retries of GETs only, error responses -> typed errors) is
  trainer_hooks/wire.py's; the errors are trainer_hooks/client_errors.py's (no httpx), so the hook
  catches them without importing httpx. 400/422 errors are also InvalidRequestError and 409 errors
  StateError (inference.core); a failed per-rank audit in a sync is SidecarChecksumError.
- `sync_weights(sender, named_tensors, version)` runs the weight-sync protocol (trainer_hooks/sync.py, the
  one choreography, which a Fleet runs too): ONE POST /weights/update beside sender.send(), whose answer
  is the audit. `connect_sender` joins sender and sidecar (POST /weights/init, protocol checked).

It lives with the trainer's side (the hook drives it); sidecar.client and `from sidecar import
SidecarClient` re-export it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import httpx

from inference.core import (
    CompletionOutput,
    FinishReason,
    RequestOutput,
    SamplingParams,
    SidecarError,
    decode_routing,
)
from trainer_hooks.client_errors import (
    SidecarAuthError,
    SidecarBusyError,
    SidecarChecksumError,
    SidecarConnectionError,
    SidecarHTTPError,
    SidecarMemoryError,
    SidecarNotFoundError,
    SidecarProtocolError,
    SidecarRequestError,
    SidecarServerError,
    SidecarStateError,
    SidecarTransferError,
    SidecarUnavailableError,
)
from trainer_hooks.rollout_pool import (
    DEFAULT_POOL,
    TAKE_MARGIN_S,
    RolloutStream,
    RolloutTake,
    TakeOrder,
    Tickets,
    prompt_list,
    sync_fields,
)
from trainer_hooks.sync import SyncPeer, connect_one, sync_one
from trainer_hooks.wire import Wire, error_from_response

__all__ = [
    "SidecarAuthError",
    "SidecarBusyError",
    "SidecarChecksumError",
    "SidecarClient",
    "SidecarConnectionError",
    "SidecarHTTPError",
    "SidecarMemoryError",
    "SidecarNotFoundError",
    "SidecarProtocolError",
    "SidecarRequestError",
    "SidecarServerError",
    "SidecarStateError",
    "SidecarTransferError",
    "SidecarUnavailableError",
    "error_from_response",
    "records_json",
]


class SidecarClient:
    def __init__(self, url: str, api_key: str | None = None, timeout: float = 30.0, *,
                 long_timeout: float = 900.0, retries: int = 3, backoff_s: float = 0.25,
                 transport: httpx.BaseTransport | None = None) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.url = url.rstrip("/")
        self.timeout, self.long_timeout = timeout, long_timeout
        self.wire = Wire(self.url, headers, timeout, retries=retries, backoff_s=backoff_s, transport=transport)
        self.weights = SyncPeer(self.wire, long_timeout)  # the weight routes (trainer_hooks/sync.py)
        self.tickets = Tickets()  # the rollout takes this client has not acknowledged yet, per pool

    def close(self) -> None:
        self.wire.close()

    def __enter__(self) -> SidecarClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _get(self, path: str, **kw: Any) -> Any:
        return self.wire.request("GET", path, **kw).json()

    def _post(self, path: str, body: Any = None, *, timeout: float | None = None) -> Any:
        return self.wire.request("POST", path, json=body if body is not None else {}, timeout=timeout).json()

    # ---- reads --------------------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        """{"status": "ok"} or {"status": "unhealthy", "error": ...} (a 503 is an answer, not an error)."""
        return self.wire.request("GET", "/health", ok_statuses=(503,)).json()
    def is_healthy(self) -> bool:
        try:
            return self.health().get("status") == "ok"
        except SidecarError:
            return False

    def state(self) -> dict[str, Any]:
        return self._get("/state")

    def checksums(self, model: str = "target", source: str = "held",
                  algorithm: str | None = None) -> list[dict[str, Any]]:
        """Every rank's manifest (checksum.Manifest.from_dict reads each). `algorithm`: the digest rule of
        "held" (default: the rank's, the device rule on a GPU)."""
        params = {"model": model, "source": source, **({"algorithm": algorithm} if algorithm else {})}
        return self._get("/checksums", params=params, timeout=self.long_timeout)["manifests"]

    def metrics(self) -> str:
        return self.wire.request("GET", "/metrics").text

    # ---- generation ---------------------------------------------------------------------------
    def generate(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
                 sampling_params: SamplingParams | Mapping[str, Any] | Sequence[Any] | None = None, *,
                 wait: bool = True, timeout: float | None = None, on_sync: str | None = None,
                 max_staleness: int | None = None) -> list[RequestOutput]:
        """RequestOutputs in prompt order (token ids, logprobs, text, weight versions per token).
        `on_sync` ("keep", "recompute", "abort"; None: the sidecar's --on-sync) and `max_staleness`
        (None: unbounded): what a weight sync that lands while they run does to them
        (inference.core.SyncPolicy)."""
        body = {**_work_body(prompts, sampling_params, on_sync, max_staleness), "wait": wait}
        data = self._post("/generate", body, timeout=timeout or self.long_timeout)
        return [request_output(i, o) for i, o in enumerate(data["outputs"])]

    # ---- rollout pools (sidecar/api/rollouts.py; trainer_hooks/rollout_pool.py) ----------------------
    def submit_rollouts(self, prompts: Any, sampling_params: Any = None, *, pool: str = DEFAULT_POOL,
                        on_sync: str | None = None, max_staleness: int | None = None) -> list[str]:
        """POST /rollouts: one group (n samples) per prompt in `pool`; the group ids in prompt order.
        `on_sync` and `max_staleness` as for generate (what a sync that goes live mid-group does)."""
        body = {"pool": pool, **_work_body(prompts, sampling_params, on_sync, max_staleness)}
        return list(self._post("/rollouts", body)["group_ids"])

    def take_rollouts(self, min_groups: int = 1, max_groups: int | None = None, *, pool: str = DEFAULT_POOL,
                      timeout_s: float = 600.0, group_ids: Sequence[str] | None = None,
                      order: TakeOrder = "submitted", ack: bool = True, lease_s: float | None = None) -> RolloutTake:
        """POST /rollouts/take: once `min_groups` groups of `pool` are finished (or none is unfinished, or
        after timeout_s), at most `max_groups` of them, oldest submitted first (`order="completed"`: the
        first finished first); only the groups named by `group_ids` when given.

        Two-phase: the answer's groups stay leased in the sidecar under its ticket until this client
        acknowledges it, which its next take of the pool does (`ack=False` defers it) or `ack_rollouts`;
        a trainer that dies first loses nothing. The first take of a pool by this client says it is a new
        consumer: the pool's unacknowledged leases (a dead predecessor's) return to it first."""
        body = {"pool": pool, "min_groups": min_groups, "max_groups": max_groups, "timeout_s": timeout_s,
                "group_ids": list(group_ids) if group_ids is not None else None, "order": order,
                **({"lease_s": lease_s} if lease_s is not None else {})}
        with self.tickets.acking(pool, ack) as acks:
            data = self._post("/rollouts/take", {**body, "ack": acks}, timeout=timeout_s + TAKE_MARGIN_S)
            self.tickets.hold(pool, data.get("ticket"))
        groups = []
        for g in data["groups"]:
            out = request_output(0, g["output"])
            out.request_id = g["group_id"]
            out.metrics = {**out.metrics, "resubmitted": int(g.get("resubmitted", 0))}  # for max_staleness
            groups.append(out)
        failed = {f["group_id"]: f"{f['error']['type']}: {f['error']['message']}" for f in data["failed"]}
        return RolloutTake(groups, data["weight_version"], failed, dict(data["counts"]), ticket=data.get("ticket"))

    def ack_rollouts(self, pool: str = DEFAULT_POOL) -> int:
        """POST /rollouts/ack: acknowledge every take of `pool` this client holds (their groups leave the
        sidecar); for a client that never took from it, end the pool's leases instead. Groups removed."""
        with self.tickets.acking(pool, True) as acks:
            return int(self._post("/rollouts/ack", {"pool": pool, "ack": acks})["acked"])

    def cancel_rollouts(self, group_ids: Sequence[str] | None = None, *, pool: str = DEFAULT_POOL) -> dict[str, Any]:
        """POST /rollouts/cancel: drop the named groups of `pool` (None: all of them), aborting those still
        generating. {"cancelled": [ids], "unknown": [ids], "counts": {...}}."""
        body = {"pool": pool, "group_ids": list(group_ids) if group_ids is not None else None}
        return dict(self._post("/rollouts/cancel", body))

    def rollout_counts(self, pool: str = DEFAULT_POOL, *, wait_s: float = 0.0,
                       order: TakeOrder = "submitted") -> dict[str, Any]:
        """GET /rollouts/{pool}: pending, finished, leased, failed (groups), sequences, finished_ids (in
        `order`). wait_s > 0: a long poll, answered once a group is finished or none is unfinished."""
        params = {"wait_s": wait_s, "order": order} if wait_s > 0 or order != "submitted" else None
        return dict(self._get(f"/rollouts/{pool}", params=params, timeout=wait_s + TAKE_MARGIN_S))

    def rollouts(self, prompts: Any, sampling_params: Any = None, *, min_groups: int, max_groups: int | None = None,
                 pool: str = DEFAULT_POOL, timeout_s: float = 600.0, on_sync: str | None = None,
                 max_staleness: int | None = None) -> RolloutTake:
        """Submit `prompts` as new groups of `pool` (none when empty; their ids in the answer's `submitted`),
        then take: earlier unfinished groups come first (oldest first); `max_groups` None takes min_groups.
        The take acknowledges this client's earlier takes of the pool (take_rollouts)."""
        submitted = (self.submit_rollouts(prompts, sampling_params, pool=pool, on_sync=on_sync,
                                          max_staleness=max_staleness) if prompt_list(prompts) else [])
        take = self.take_rollouts(min_groups, max_groups if max_groups is not None else (min_groups or None),
                                  pool=pool, timeout_s=timeout_s)
        take.submitted = submitted
        return take

    def iter_rollouts(self, prompts: Any, sampling_params: Any = None, *, count: int, pool: str = DEFAULT_POOL,
                      timeout_s: float = 600.0, on_sync: str | None = None,
                      max_staleness: int | None = None) -> RolloutStream:
        """Submit `prompts` as new groups, then yield finished groups of `pool` one by one in completion order
        (each take waits in the sidecar for the next to finish: no polling) until `count` came, none is
        left unfinished, or timeout_s passed. The first take acknowledges this client's earlier takes; the
        stream's own are acknowledged by the next call's. The stream's `failed`, `counts`,
        `weight_version`, `submitted` say what the takes said."""
        submitted = (self.submit_rollouts(prompts, sampling_params, pool=pool, on_sync=on_sync,
                                          max_staleness=max_staleness) if prompt_list(prompts) else [])

        def take(max_groups: int, wait_s: float, first: bool) -> RolloutTake:
            return self.take_rollouts(1, max_groups, pool=pool, timeout_s=wait_s, order="completed", ack=first)

        return RolloutStream(take, count, timeout_s, submitted)

    def completions(self, prompt: Any, *, timeout: float | None = None, **fields: Any) -> dict[str, Any]:
        """POST /v1/completions with OpenAI fields (model, max_tokens, temperature, n, stop, seed, ...)."""
        return self._post("/v1/completions", {"prompt": prompt, **fields}, timeout=timeout or self.long_timeout)

    # ---- control ------------------------------------------------------------------------------
    def sleep(self, level: int = 1, in_flight: str = "finish", *, timeout: float | None = None) -> dict[str, Any]:
        return self._post("/sleep", {"level": level, "in_flight": in_flight}, timeout=timeout or self.long_timeout)

    def wake_up(self, tags: list[str] | None = None, *, timeout: float | None = None) -> dict[str, Any]:
        return self._post("/wake_up", {"tags": tags}, timeout=timeout or self.long_timeout)

    def pause(self, lease_s: float | None = None) -> dict[str, Any]:
        """Hold generation steps until resume(), or until the lease runs out (None: the sidecar's
        --max-pause-s); pausing again renews it."""
        return self._post("/pause", {"lease_s": lease_s} if lease_s is not None else None)

    def resume(self) -> dict[str, Any]:
        return self._post("/resume")

    def init_weights(self, init_info: Mapping[str, Any]) -> dict[str, Any]:
        """POST /weights/init alone (connect_sender runs it beside the sender's connect())."""
        return self.weights.init(init_info)

    def abort_weights(self) -> dict[str, Any]:
        """POST /weights/abort: end the open update session now ({"aborted": whether one was open})."""
        return self.weights.abort()

    def audit(self, model: str = "target", source: str = "held", expected: Any = None, *,
              algorithm: str | None = None, timeout: float | None = None) -> dict[str, Any]:
        """POST /audit. `algorithm`: the rule of "held" digests (default: the one `expected` manifests
        name, else the rank's)."""
        body = {"model": model, "source": source,
                "expected": records_json(expected) if expected is not None else None}
        params = {"algorithm": algorithm} if algorithm else None
        return self.wire.request("POST", "/audit", json=body, params=params,
                                 timeout=timeout or self.long_timeout).json()

    # ---- a whole sync with inference.transfer.sender.WeightSender (trainer_hooks/sync.py) --------
    def connect_sender(self, sender: Any) -> dict[str, Any]:
        """Join sender and sidecar: POST /weights/init while sender.connect() blocks. A refused init (a 400
        naming the field, a 409 such as SidecarProtocolError, a dead rank) calls the sender's wait off at
        once and that error is raised, not a join timeout minutes later."""
        return connect_one(self.weights, sender)

    def sync_weights(self, sender: Any, named_tensors: Mapping[str, Any] | Iterable[tuple[str, Any]],
                     version: int, model: str = "target", *, allow_cast: bool = False) -> dict[str, Any]:
        """ONE request: the update carrying the start, beside sender.send(), whose answer is the audit of
        what every rank received against the sender's digests (its "ok" is True; a mismatch raises
        SidecarChecksumError naming tensor and rank). Joins the sender first if it is not connected."""
        named = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        return sync_one(self.weights, sender, named, version, model, allow_cast)


def records_json(records: Any) -> Any:
    """TensorRecords (or a Manifest) -> JSON dicts; dicts and lists of dicts pass through."""
    if hasattr(records, "to_dict"):
        return records.to_dict()
    if isinstance(records, (list, tuple)):
        return [{"name": r.name, "dtype": r.dtype, "shape": list(r.shape), "digest": r.digest}
                if dataclasses.is_dataclass(r) else r for r in records]
    return records


def params_dict(p: Any) -> dict[str, Any]:
    """SamplingParams (tuples as lists) or a mapping -> the JSON dict of one prompt's sampling params."""
    if isinstance(p, SamplingParams):
        d = dataclasses.asdict(p)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}
    return dict(p)


def request_output(i: int, o: dict[str, Any]) -> RequestOutput:
    """One entry of /generate's "outputs" -> the RequestOutput of prompt `i` (its request_id is str(i))."""
    outs = [CompletionOutput(
        index=c["index"], token_ids=c["token_ids"], logprobs=c["logprobs"],
        finish_reason=FinishReason(c["finish_reason"]) if c["finish_reason"] else None, text=c["text"],
        top_logprobs=[{int(k): v for k, v in d.items()} for d in c["top_logprobs"]] if c["top_logprobs"] else None,
        stop_reason=c.get("stop_reason"),
        weight_version_spans=[tuple(s) for s in c.get("weight_version_spans", [])],
        draft_version_spans=[tuple(s) for s in c.get("draft_version_spans", [])], restarts=c.get("restarts", 0),
        routing=decode_routing(c["routing"]) if c.get("routing") is not None else None)
        for c in o["completions"]]
    return RequestOutput(request_id=str(i), prompt_token_ids=o["prompt_token_ids"], outputs=outs,
                         weight_version=o["weight_version"], prompt=o["prompt"],
                         num_cached_tokens=o["num_cached_tokens"])


def _work_body(prompts: Any, sampling_params: Any, on_sync: str | None, max_staleness: int | None) -> dict[str, Any]:
    """What /generate and /rollouts both carry: the prompts (one, or a list), their sampling params (one
    for all, or one per prompt) and the sync policy's fields that are set."""
    body: dict[str, Any] = {"prompts": [p if isinstance(p, str) else list(p) for p in prompt_list(prompts)],
                            **sync_fields(on_sync, max_staleness)}
    if sampling_params is not None:
        body["sampling_params"] = ([params_dict(p) for p in sampling_params]
                                   if isinstance(sampling_params, Sequence) else params_dict(sampling_params))
    return body
