"""What crosses the pipes between the sidecar process and its rank processes, declared in one place.

Every command is a frozen dataclass, sent by the driver (sidecar/ranks/driver.py) to rank 0, whose
engine loop (sidecar/ranks/server.py) hands every rank the same commands at the same step boundary.
Queue commands (AddRequests, AbortRequests, SetPaused, Stop) get no reply: rank 0 reports unasked,
in `Events`, what finished, what it refused and its status. A control command (the rest) gets one
`Reply` from every rank, whose value is its `reply` type (asserted on the rank). A command not in
COMMANDS is refused on both sides with UnknownCommandError naming it: no method name crosses.

Also here: RankSpec (what a rank is built from), RankPlan (what it reports at startup), RankStatus
(its state, on every report), Reply and ErrorInfo (an exception as it travels). Everything crossing
is a typed, picklable value, never a dict read by key: these dataclasses or the engine's own
(TransitionStats, checksum.Manifest).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from checksum import Manifest
from inference.config import EngineConfig
from inference.core import DEFAULT_SYNC_POLICY, RequestOutput, SamplingParams, SidecarError, SyncPolicy
from inference.memory.sleep import TransitionStats

ErrorKind = Literal["invalid", "state", "checksum", "busy", "transfer", "unavailable", "memory", "internal"]
WaitMode = Literal["never", "sync", "always"]


@dataclass(frozen=True)
class TokenizedPrompt:
    """A prompt the sidecar process already checked and tokenized (sidecar/api/intake.py), so that no
    rank step ever waits on a tokenizer; `text` is kept for the output (None for token-id prompts)."""

    text: str | None
    token_ids: list[int]


Prompt = str | list[int] | TokenizedPrompt


@dataclass(frozen=True)
class ErrorInfo:
    """An exception that happened on a rank, as it travels back (picklable, no torch types)."""

    type: str
    message: str
    kind: ErrorKind  # picks the HTTP status (sidecar/api/common.py)
    field: str | None = None
    rank: str | None = None
    index: int | None = None  # which prompt of a request group failed


@dataclass(frozen=True)
class RankStatus:
    """One rank's state as it reported it last: `arenas` maps each memory arena's tag to its state
    ("awake", "asleep", ...); `unfinished` counts the requests its engine holds."""

    rank: str
    pid: int
    ready: bool
    sleeping: bool
    arenas: dict[str, str]
    weight_versions: dict[str, int]
    torn: dict[str, bool]
    loaded: dict[str, bool]
    unfinished: int
    gc_frozen: int  # objects frozen once at start (inference/memory/host_heap.py)
    # per model, why its bytes are not its live version's (WeightUpdater.needs_sync_reason); None: they are
    needs_sync: dict[str, str | None] = field(default_factory=dict)


@dataclass(frozen=True)
class RankPlan:
    """What one rank reports once, at startup: its device memory plan, the model's facts, and the torch
    thread count it runs with (--threads, or sidecar/ranks/pool.py `rank_threads`)."""

    rank: str
    pid: int
    device: str
    dtype: str
    weights_bytes: dict[str, int]  # per weights arena tag
    kv_blocks: int
    kv_bytes: int
    block_size: int
    max_model_len: int
    vocab_size: int
    models: tuple[str, ...]
    model: str
    draft_model: str | None
    has_tokenizer: bool
    num_threads: int
    warm_up_s: float = 0.0  # the start-up pass that compiled what rollouts run (inference/engine/warm_up.py)
    routing_row_bytes: int = 0  # one token's routing (moe layers x k expert ids; docs/moe.md); 0: a dense model


@dataclass
class Reply:
    """One rank's answer to one control command. `finished`: outputs that finished during it (rank 0
    only: a sleep that drained the queue, a step in flight that a weight sync settled)."""

    ok: bool
    value: Any = None
    error: ErrorInfo | None = None
    status: RankStatus | None = None
    finished: list[RequestOutput] = field(default_factory=list)


@dataclass(frozen=True)
class RankSpec:
    """Everything a rank process needs to build its engine (picklable)."""

    rank: int
    size: int
    engine: EngineConfig
    dist_port: int
    backend: str  # "gloo" or "nccl" for the TP group
    num_threads: int
    log_level: str
    dist_timeout_s: float
    parent_pid: int
    dp_rank: int = 0  # this replica's place in a fleet: the dp{i} of its rank keys
    log_format: str = "text"  # sidecar/log_format.py


class UnknownCommandError(SidecarError):
    """A message on the rank pipe that COMMANDS does not declare (a bug in the sidecar, never a user's)."""

    def __init__(self, command: object, where: str = "the rank pipe") -> None:
        self.command = type(command).__name__
        declared = ", ".join(c.__name__ for c in COMMANDS)
        super().__init__(f"{where}: {self.command!r} is not a declared rank command (declared: {declared})")


@dataclass(frozen=True)
class StreamDelta:
    """Tokens one sample of a streamed request (RequestGroup.stream) committed since its last delta:
    `first` is the index of the first of them in its completion, so a sample that a weight sync sent
    back to its prompt (`restarts` grew) starts again at 0. Only rank 0 reports them."""

    request_id: str
    index: int  # the sample (0..n-1)
    first: int
    restarts: int
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    top_logprobs: tuple[dict[int, float], ...] | None = None


@dataclass
class Events:
    """What a rank reports unasked at a step boundary (rank 0 at every boundary that has news; another
    rank only when its step failed). `applied`: the commands rank 0 took from the sidecar process so
    far; with `stepping` (it steps on) it tells the driver whether it owes news, so that a rank that
    stopped answering is told from an idle one (sidecar/ranks/driver.py). `steps`: the steps this rank
    ran (the same count on every rank). `rejected`: request groups refused at admission (group id ->
    why). `failed`: the last step raised; the requests `dropped` are gone. `progress`: the new tokens
    of streamed requests still running (a finished one's come whole in `finished`)."""

    applied: int
    stepping: bool
    steps: int
    status: RankStatus
    finished: list[RequestOutput] = field(default_factory=list)
    rejected: dict[str, ErrorInfo] = field(default_factory=dict)
    failed: ErrorInfo | None = None
    dropped: tuple[str, ...] = ()
    progress: list[StreamDelta] = field(default_factory=list)


@dataclass(frozen=True)
class Heartbeat:
    """A rank's sign of life, sent by a thread of its own at least every HEARTBEAT_S whatever its engine
    loop is doing (sidecar/ranks/server.py), so a rank that is busy (a long step, a long command) is told
    from one that stopped (sidecar/ranks/driver.py). `applied`: as in Events (rank 0). `doing`: "step",
    a control command's name, or None while it waits for commands; `for_s`: how long it has been doing it."""

    applied: int
    steps: int
    doing: str | None
    for_s: float


# ---- replies --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TransferJoined:
    """A rank's answer to InitWeightTransfer: the models it holds in FP8 (they take a sender's FP8 payloads)."""

    fp8_models: tuple[str, ...] = ()


@dataclass(frozen=True)
class SyncResult:
    """A passed audit at the end of one weight sync on one rank (a failed one raises instead): the
    tensors it compared, the digest rule, the seconds the rank spent in finish (the audit), and on an FP8
    model how many installed tensors (`name:fp8`, `name:scale`) it checked against the sender's expected
    digests before going live (0: the sender delivered none)."""

    model: str
    version: int
    rank: str
    ok: bool
    summary: str
    tensors_checked: int = 0
    algorithm: str = ""
    audit_s: float = 0.0
    installed_checked: int = 0


@dataclass(frozen=True)
class UpdateReply:
    """One rank's answer to UpdateWeights: the seconds its start took and the passed audit; `rank_s`: the
    rank's whole time on the command (start, receive, audit), so the sidecar can tell its own hops
    (driver thread, rank pipe) from the rank's work."""

    start_s: float = 0.0
    result: SyncResult | None = None
    rank_s: float = 0.0


# ---- commands -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Command:
    """Base of every rank command; `reply` is the type of each rank's answer value."""

    reply: ClassVar[type] = type(None)


@dataclass(frozen=True)
class RequestGroup:
    """The prompts of one HTTP call: (request id, prompt, params) each; added all or none.

    `wait`, when the engine cannot generate as the group arrives: "never" refuses it (409); "sync"
    holds it through a weight sync in progress but refuses it while the sidecar sleeps, a model is torn
    or awaits its first sync (states that end only when the trainer acts: holding would hang the
    caller silently); "always" holds it through all of these (--hold-while-asleep). `sync`: what a
    weight sync that goes live while they run does to them (None fields: the engine's default).
    `stream`: rank 0 reports their new tokens as they are committed (Events.progress)."""

    group_id: str
    requests: tuple[tuple[str, Prompt, SamplingParams], ...]
    wait: WaitMode
    sync: SyncPolicy = DEFAULT_SYNC_POLICY
    stream: bool = False


@dataclass(frozen=True)
class AddRequests(Command):
    """Queue one request group (all or none); it is answered in Events: finished, or rejected."""

    group: RequestGroup


@dataclass(frozen=True)
class AbortRequests(Command):
    """Drop these requests (their caller went away); nothing answers them."""

    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class SetPaused(Command):
    """Stop (or resume) stepping; queued requests wait, control commands still run."""

    paused: bool


@dataclass(frozen=True)
class Stop(Command):
    """Shut the engine down and exit; the rank sends no reply."""


@dataclass(frozen=True)
class Sleep(Command):
    """Release device memory. Reply: the rank's TransitionStats."""

    level: int = 1
    in_flight: Literal["finish", "hold"] = "finish"  # "finish": run queued requests to the end first
    reply: ClassVar[type] = TransitionStats


@dataclass(frozen=True)
class WakeUp(Command):
    """Map "weights" and/or "kv_cache" back (None: all). Reply: the rank's TransitionStats."""

    tags: tuple[str, ...] | None = None
    reply: ClassVar[type] = TransitionStats


@dataclass(frozen=True)
class InitWeightTransfer(Command):
    """Join the sender's transfer group (blocks until every receiver joined)."""

    info: dict[str, Any]
    reply: ClassVar[type] = TransferJoined


@dataclass(frozen=True)
class WeightStart:
    """What opens a sync's session on a rank: `model` ("target" or "draft"), its new version and its
    manifest (validated whole before any byte is written). It travels inside UpdateWeights, never alone."""

    model: Literal["target", "draft"]
    version: int
    manifest: Any
    allow_cast: bool = False


@dataclass(frozen=True)
class UpdateWeights(Command):
    """The whole sync on a rank (POST /weights/update): open the session of `start` (a start that fails
    refuses the sender's plan agreement, so the trainer's send() stops at once instead of waiting out its
    timeout), receive every bucket, take the digests the sender delivers in the sync
    (inference/transfer/delivery.py), audit and commit. `session_id`: the transfer session the update
    belongs to (its init's): a rank whose group is another session's refuses it before any byte.
    `nonce`: when set, the sender must present it in the plan agreement (transfer.groups.owner_key)."""

    start: WeightStart
    info: Any = None
    session_id: str | None = None
    nonce: str | None = None
    reply: ClassVar[type] = UpdateReply


@dataclass(frozen=True)
class AbortWeightUpdate(Command):
    """End the open update session, if any (POST /weights/abort, or its lease ran out). The model is
    torn if any byte may have been written (so nothing half-written is served), else it serves its
    live version again. Reply: whether a session was open."""

    reason: str = "aborted by the caller"
    reply: ClassVar[type] = bool


@dataclass(frozen=True)
class ReadManifest(Command):
    """The digests of `model`: "held" (this rank's shards, engine names, digested now) or "received"
    (the last finished sync's full tensors, trainer names). `algorithm`: the digest rule of "held"
    (None: the rank's default, the device rule on a GPU); for "received" it must be the sync's rule, if
    given. Reply: the checksum.Manifest, its torn_reason set while the model is torn (its weight_version
    is then the live version the bytes are NOT)."""

    model: Literal["target", "draft"] = "target"
    source: Literal["held", "received"] = "held"
    algorithm: str | None = None
    reply: ClassVar[type] = Manifest


QUEUE_COMMANDS: tuple[type[Command], ...] = (AddRequests, AbortRequests, SetPaused, Stop)  # the driver's own
CONTROL_COMMANDS: tuple[type[Command], ...] = (Sleep, WakeUp, InitWeightTransfer, UpdateWeights, AbortWeightUpdate,
                                               ReadManifest)
COMMANDS: tuple[type[Command], ...] = QUEUE_COMMANDS + CONTROL_COMMANDS


def check_declared(command: object, where: str = "the rank pipe") -> None:
    """Raise UnknownCommandError unless `command` is an instance of a declared command (exactly)."""
    if type(command) not in COMMANDS:
        raise UnknownCommandError(command, where)
