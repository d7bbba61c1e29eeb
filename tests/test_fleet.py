"""trainer_hooks.Fleet's rules against fake replicas (no processes): least-outstanding routing with the n
samples of a prompt together and results in prompt order, retries of a dead replica's prompts (at most
max_retries), one transfer group with a rank map per replica, rotation (out on a failed audit, a missed
sync or another version; back after a good sync), the hook's warning, and `sidecar fleet`'s placement.
The same behaviour with real sidecar processes: tests/test_fleet_processes.py."""

from __future__ import annotations

import logging
from typing import Any, ClassVar

import pytest
from torch import nn

from inference.core import (
    CompletionOutput,
    FinishReason,
    InvalidRequestError,
    RequestOutput,
    SamplingParams,
    SidecarError,
)
from sidecar.cli.fleet import launch_flags, plan_replicas
from trainer_hooks import Fleet, FleetError, FleetGoneError, WeightSyncHook
from trainer_hooks.client_errors import (
    SidecarChecksumError,
    SidecarConnectionError,
    SidecarRequestError,
    SidecarTransferError,
)
from trainer_hooks.fleet_replicas import FleetSyncError, fleet_rank_key, pick_replicas
from trainer_hooks.sync import SYNC_PROTOCOL, SyncPeer
from trainer_hooks.wire import ReadOnce

ROUND = {"refused": False, "send_failed": False}  # the group's shared fate in one sync round


class _FakeWire:
    """A FakeReplica's weight routes as trainer_hooks/sync.py reaches them over a wire: an update's start
    runs when it is written (a refused one makes the group's send() fail, as the ranks' plan agreement
    does), its answer when it is read."""

    def __init__(self, replica: FakeReplica) -> None:
        self.replica = replica

    def begin(self, method: str, path: str, json: Any, timeout: Any = None) -> ReadOnce:
        if path == "/weights/init":
            return ReadOnce(lambda: self.replica.init_weights(json["init_info"]))
        assert path == "/weights/update", path
        try:
            self.replica.start_weights(json["start"])
        except SidecarError as e:  # refused, or the replica went away: the group's send() fails
            ROUND["refused"] = True
            refused = e
            return ReadOnce(lambda: (_ for _ in ()).throw(refused))
        return ReadOnce(lambda: self.replica.update_weights(json["start"]))


class FakeReplica:
    """A SidecarClient stand-in that records calls; `alive`, `fail_audit`, `answer_version` steer it. Its
    `weights` are the real trainer_hooks/sync.py peer over a fake wire."""

    def __init__(self, url: str, ranks: int = 1, version: int = 0, dp: int = 0, torn: bool = False) -> None:
        self.url, self.version, self.torn = url, version, torn
        self.weights = SyncPeer(_FakeWire(self))  # type: ignore[arg-type]
        self.keys = [f"dp{dp}:pp0:tp{k}" for k in range(ranks)]
        self.pids = [1000 + k for k in range(ranks)]
        self.alive, self.fail_audit, self.answer_version = True, False, None
        self.answer_spans: list[tuple[int, int]] = []  # an answer begun under older weights (on_sync keep)
        self.calls: list[tuple[str, Any]] = []
        self.prompts: list[Any] = []
        self.policies: list[dict[str, Any]] = []

    def _check(self) -> None:
        if not self.alive:
            raise SidecarConnectionError(f"POST {self.url}: ConnectError")

    def state(self) -> dict[str, Any]:
        self._check()
        return {"healthy": True, "weight_versions": {"target": self.version}, "torn": {"target": self.torn},
                "ranks": [{"rank": k, "pid": p} for k, p in zip(self.keys, self.pids)], "queued_sequences": 0,
                "transfer": {"backend": None, "bucket_bytes": 1 << 20, "num_receivers": len(self.keys)}}

    def sleep(self, level: int, in_flight: str, timeout: Any = None) -> dict[str, Any]:
        self._check()
        self.calls.append(("sleep", level))
        return {}

    def wake_up(self, tags: Any, timeout: Any = None) -> dict[str, Any]:
        self._check()
        self.calls.append(("wake_up", tags))
        return {}

    def init_weights(self, info: dict[str, Any]) -> dict[str, Any]:
        self._check()
        self.calls.append(("init", info["ranks"]))
        return {"protocol": SYNC_PROTOCOL}

    def start_weights(self, start: dict[str, Any]) -> None:
        """The start an update carries, run when the update is written (tests replace it to refuse)."""
        self._check()
        self.calls.append(("start", start["version"]))
        self._pending = start["version"]

    def update_weights(self, start: dict[str, Any]) -> dict[str, Any]:
        """The update's answer, read after send(): this replica's audit."""
        self._check()
        self.calls.append(("update", None))
        if ROUND["send_failed"]:  # its ranks saw the group's plan agreement refused
            raise SidecarTransferError(502, "TransferError", "the sender's plan agreement was refused", None,
                                       self.keys[0])
        if self.fail_audit:
            self.torn = True
            raise SidecarChecksumError(409, "ChecksumMismatch", "rank dp0:pp0:tp0: tensor 'w' differs",
                                       None, self.keys[0])
        self.version, self.torn = self._pending, False
        return {"audit": {"ok": True, "ranks": list(self.keys), "tensors_checked": 1, "algorithm": "x",
                          "summary": "ok"}}

    def generate(self, prompts: list[Any], params: Any, wait: bool = True, timeout: Any = None,
                 **policy: Any) -> list[Any]:
        self._check()
        self.prompts.append(prompts)
        self.policies.append(policy)
        version = self.version if self.answer_version is None else self.answer_version
        spans = list(self.answer_spans)
        oldest = spans[0][1] if spans else version
        return [RequestOutput(str(i), list(p), [CompletionOutput(0, [7, 7], None, FinishReason.LENGTH,
                                                                 weight_version_spans=spans)], oldest)
                for i, p in enumerate(prompts)]


class FakeSender:
    made: ClassVar[list[FakeSender]] = []

    def __init__(self, num_receivers: int) -> None:
        self.num_receivers, self.connected, self.closed, self.sent = num_receivers, False, False, 0
        FakeSender.made.append(self)

    def init_info(self) -> dict[str, Any]:
        return {"world_size": self.num_receivers + 1}

    def connect(self) -> None:
        self.connected = True

    def manifest(self, named: Any, version: int, fp8: bool = False) -> dict[str, Any]:
        return {"version": version, "tensors": [], "algorithm": "x"}

    def send(self, named: Any, deliver_digests: bool = False, owner: str | None = None) -> list[Any]:
        self.sent += 1
        self.delivered = deliver_digests
        ROUND["send_failed"], ROUND["refused"] = ROUND["refused"], False
        if ROUND["send_failed"]:
            raise RuntimeError("a receiver refused the plan agreement")
        return []

    def call_off_connect(self, why: str) -> None:
        self.called_off = why

    def close(self) -> None:
        self.closed, self.connected = True, False


def _fleet(*replicas: FakeReplica, max_retries: int = 1) -> Fleet:
    FakeSender.made = []
    ROUND.update(refused=False, send_failed=False)
    return Fleet(list(replicas), max_retries=max_retries)


def _three() -> list[FakeReplica]:
    return [FakeReplica("http://a", ranks=2), FakeReplica("http://b"), FakeReplica("http://c")]


# ---- rollouts ------------------------------------------------------------------------------------


def test_pick_replicas_takes_the_least_outstanding_counting_earlier_picks() -> None:
    assert pick_replicas({0: 0, 1: 0, 2: 0}, [4, 1, 1, 1, 1], [set()] * 5) == [0, 1, 2, 1, 2]
    assert pick_replicas({0: 5, 1: 0}, [1, 1], [{1}, set()]) == [0, 1]
    assert pick_replicas({0: 0}, [1], [{0}]) == [None]


def test_prompts_keep_their_order_and_their_n_samples_on_one_replica() -> None:
    reps = _three()
    params = [SamplingParams(n=4, max_tokens=1), *[SamplingParams(max_tokens=1)] * 4]
    prompts = [[1], [2], [3], [4], [5]]
    with _fleet(*reps) as fleet:
        outs = fleet.generate(prompts, params)
    assert [o.prompt_token_ids for o in outs] == prompts and [o.request_id for o in outs] == list("01234")
    assert [o.metrics["replica"] for o in outs] == [0, 1, 2, 1, 2]  # prompt 0 counts 4 sequences on dp0
    assert [r.prompts for r in reps] == [[[[1]]], [[[2], [4]]], [[[3], [5]]]]  # one call per replica
    assert all(o.metrics["retries"] == 0 for o in outs)


def test_a_replica_dying_mid_request_is_retried_once_on_the_others() -> None:
    reps = _three()
    with _fleet(*reps) as fleet:
        fleet.status()  # first contact: all three in rotation
        reps[1].alive = False  # then dp1 dies; prompt 1 goes to it (least outstanding), then elsewhere
        outs = fleet.generate([[1], [2], [3], [4]])
        assert [o.prompt_token_ids for o in outs] == [[1], [2], [3], [4]]
        placed = [(o.metrics["replica"], o.metrics["retries"]) for o in outs]
        assert placed[0] == (0, 0) and placed[2:] == [(2, 0), (0, 0)] and placed[1] in ((0, 1), (2, 1))
        assert fleet.in_rotation == [0, 2] and "died mid-request" in str(fleet.replicas[1].reason)
        reps[0].alive = reps[2].alive = False
        with pytest.raises(FleetGoneError) as gone:
            fleet.generate([[1]])
        assert isinstance(gone.value, SidecarConnectionError) and "dp1 (http://b)" in str(gone.value)
    reps = _three()
    with _fleet(*reps, max_retries=0) as fleet:
        fleet.status()
        reps[0].alive = False
        with pytest.raises(FleetError, match="prompt 0 failed on dp0"):
            fleet.generate([[1], [2]])


def test_a_bad_request_is_raised_not_retried() -> None:
    reps = _three()

    def refuse(*a: Any, **k: Any) -> Any:
        raise SidecarRequestError(400, "InvalidRequestError", "too long", "prompts[0]")

    reps[0].generate = refuse  # type: ignore[method-assign]
    with _fleet(*reps) as fleet, pytest.raises(SidecarRequestError):
        fleet.generate([[1], [2], [3]])
    assert fleet.in_rotation == [0, 1, 2]
    with _fleet(*_three()) as fleet, pytest.raises(InvalidRequestError, match="sampling_params"):
        fleet.generate([[1], [2]], [SamplingParams()])


def test_first_contact_admits_the_newest_healthy_version_and_a_stale_answer_takes_one_out() -> None:
    reps = [FakeReplica("http://a", version=3), FakeReplica("http://b", version=2),
            FakeReplica("http://c", version=3, torn=True), FakeReplica("http://d", version=3)]
    with _fleet(*reps) as fleet:
        assert fleet.generate([[1], [2]])[1].metrics["replica"] == 3
        assert fleet.in_rotation == [0, 3] and fleet.version == 3
        assert "version 2" in str(fleet.replicas[1].reason) and "torn" in str(fleet.replicas[2].reason)
        reps[3].answer_version = 1  # e.g. restarted behind the fleet's back
        outs = fleet.generate([[1], [2]])
        assert {o.metrics["replica"] for o in outs} == {0} and fleet.in_rotation == [0]


def test_an_answer_that_spans_a_sync_is_judged_by_its_newest_tokens() -> None:
    """With on_sync keep or recompute an output begun under version 2 ends under 3: a replica whose newest
    tokens are the fleet's version stays in rotation; one whose newest are older is taken out."""
    reps = [FakeReplica("http://a", version=3), FakeReplica("http://b", version=3)]
    with _fleet(*reps) as fleet:
        reps[0].answer_spans = [(0, 2), (1, 3)]
        outs = fleet.generate([[1], [2], [3]], on_sync="keep")
        assert fleet.in_rotation == [0, 1] and {o.weight_version for o in outs} <= {2, 3}
        assert all(p == {"on_sync": "keep"} for r in reps for p in r.policies)  # the policy reaches each call
        reps[0].answer_spans = [(0, 1), (1, 2)]
        outs = fleet.generate([[1], [2], [3]])
        assert fleet.in_rotation == [1] and {o.metrics["replica"] for o in outs} == {1}


def test_sleep_and_wake_reach_every_replica_and_fail_only_when_all_do() -> None:
    reps = _three()
    with _fleet(*reps) as fleet:
        reps[2].alive = False
        reply = fleet.sleep(2)
        assert set(reply["replicas"]) == {"dp0", "dp1"} and "ConnectError" in reply["failed"]["dp2"]
        assert [r.calls for r in reps[:2]] == [[("sleep", 2)]] * 2 and fleet.in_rotation == [0, 1]
        reps[0].alive = reps[1].alive = False
        with pytest.raises(FleetGoneError, match="every replica is gone"):
            fleet.wake_up(["kv_cache"])


def test_a_replica_launched_with_another_dp_rank_is_named_in_the_error() -> None:
    with pytest.raises(FleetError, match="--dp-rank 3"):
        _fleet(FakeReplica("http://a"), FakeReplica("http://b", dp=3)).status()
    assert fleet_rank_key(2, "dp0:pp0:tp1") == "dp2:pp0:tp1" and fleet_rank_key(1, "pp0:tp0") == "dp1:pp0:tp0"


# ---- syncs ---------------------------------------------------------------------------------------


def test_every_rank_of_every_replica_joins_one_group_and_the_audit_is_keyed_by_replica() -> None:
    reps = _three()
    with _fleet(*reps) as fleet:
        report = fleet.sync_weights(FakeSender, {"w": 0}, 1)
        assert [s.num_receivers for s in FakeSender.made] == [4] and FakeSender.made[0].sent == 1
        assert [r.calls[0] for r in reps] == [("init", {"dp0:pp0:tp0": 1, "dp0:pp0:tp1": 2}),
                                              ("init", {"dp0:pp0:tp0": 3}), ("init", {"dp0:pp0:tp0": 4})]
        assert report["ok"] and report["ranks"] == ["dp0:pp0:tp0", "dp0:pp0:tp1", "dp1:pp0:tp0", "dp2:pp0:tp0"]
        assert report["out_of_rotation"] == {} and fleet.version == 1
        fleet.sync_weights(FakeSender, {"w": 0}, 2)  # the same members: the group is reused
        assert len(FakeSender.made) == 1
        assert [c[0] for c in reps[1].calls] == ["init", *["start", "update"] * 2]
        assert FakeSender.made[0].delivered  # the digests travel in the sync: the update's answer is the audit


def test_a_missed_sync_takes_a_replica_out_until_its_next_good_sync() -> None:
    reps = _three()
    with _fleet(*reps) as fleet:
        fleet.sync_weights(FakeSender, {"w": 0}, 1)
        reps[2].alive = False
        report = fleet.sync_weights(FakeSender, {"w": 0}, 2)
        assert report["ok"] and list(report["out_of_rotation"]) == ["dp2"]
        assert "missed the sync of target v2: unreachable" in report["out_of_rotation"]["dp2"]
        assert [s.num_receivers for s in FakeSender.made] == [4, 3] and FakeSender.made[0].closed
        assert {o.metrics["replica"] for o in fleet.generate([[1], [2], [3], [4]])} == {0, 1}
        reps[2].alive, reps[2].pids, reps[2].version = True, [2000], 0  # restarted: its checkpoint again
        assert {o.metrics["replica"] for o in fleet.generate([[1], [2], [3], [4]])} == {0, 1}
        report = fleet.sync_weights(FakeSender, {"w": 0}, 3)
        assert report["ok"] and report["out_of_rotation"] == {} and fleet.in_rotation == [0, 1, 2]
        assert [s.num_receivers for s in FakeSender.made] == [4, 3, 4] and reps[2].version == 3


def test_a_failed_audit_fails_only_that_replica() -> None:
    reps = _three()
    with _fleet(*reps) as fleet:
        reps[1].fail_audit = True
        report = fleet.sync_weights(FakeSender, {"w": 0}, 1)
        assert report["ok"] and fleet.version == 1 and fleet.in_rotation == [0, 2]
        assert [r["ok"] for r in report["replicas"]] == [True, False, True]
        assert "audit failed: rank dp1:pp0:tp0: tensor 'w' differs" in report["replicas"][1]["summary"]
        assert report["ranks"] == ["dp0:pp0:tp0", "dp0:pp0:tp1", "dp2:pp0:tp0"]
        for r in reps:
            r.fail_audit = True
        report = fleet.sync_weights(FakeSender, {"w": 0}, 2)
        assert not report["ok"] and fleet.version == 1 and fleet.in_rotation == []


def test_a_start_refused_by_one_replica_drops_it_and_by_all_is_raised() -> None:
    reps = _three()

    def refuse(*a: Any, **k: Any) -> Any:
        raise SidecarRequestError(400, "InvalidRequestError", "no such tensor", "model.x")

    with _fleet(*reps) as fleet:
        reps[2].start_weights = refuse  # type: ignore[method-assign]
        report = fleet.sync_weights(FakeSender, {"w": 0}, 1)
        assert "refused the start" in report["out_of_rotation"]["dp2"]
        assert [s.num_receivers for s in FakeSender.made] == [4, 3]  # the retry ran in a fresh group
        for r in reps:
            r.start_weights = refuse  # type: ignore[method-assign]
        with pytest.raises(SidecarRequestError, match="no such tensor"):
            fleet.sync_weights(FakeSender, {"w": 0}, 2)
        for r in reps:
            r.alive = False
        with pytest.raises(FleetGoneError, match="no replica can take the sync"):
            fleet.sync_weights(FakeSender, {"w": 0}, 3)


def test_a_replica_dying_while_the_bytes_move_is_dropped_and_a_wire_failure_names_each_replica() -> None:
    reps = _three()

    def die(*a: Any, **k: Any) -> Any:
        reps[1].alive = False
        raise SidecarConnectionError("POST http://b/weights/update: RemoteProtocolError")

    def broken(*a: Any, **k: Any) -> Any:
        raise SidecarTransferError(502, "TransferError", "another rank of the group failed", None, "dp0:pp0:tp0")

    with _fleet(*reps) as fleet:
        reps[1].start_weights = die  # type: ignore[method-assign]
        report = fleet.sync_weights(FakeSender, {"w": 0}, 1)
        assert report["ok"] and "went away at update" in report["out_of_rotation"]["dp1"]
        assert [s.num_receivers for s in FakeSender.made] == [4, 3] and FakeSender.made[1].sent == 1
        reps[2].start_weights = broken  # type: ignore[method-assign]
        with pytest.raises(FleetSyncError, match="dp2 \\(http://c\\): HTTP 502") as failed:
            fleet.sync_weights(FakeSender, {"w": 0}, 2)
        assert "another rank of the group failed" in str(failed.value.errors["dp2 (http://c)"])
        assert "sender" in failed.value.errors  # the sender's own failure is named too
        del reps[2].start_weights  # healthy again
        report = fleet.sync_weights(FakeSender, {"w": 0}, 3)
        assert report["ok"] and len(FakeSender.made) == 3  # the failed step's group was not reused


def test_a_replica_gone_after_the_others_audited_misses_the_sync_and_nothing_runs_again() -> None:
    reps = _three()

    def gone_after_audit(*a: Any) -> dict[str, Any]:
        reps[2].alive = False
        raise SidecarConnectionError("POST http://c/weights/update: RemoteProtocolError")

    with _fleet(*reps) as fleet:
        reps[2].update_weights = gone_after_audit  # type: ignore[method-assign]
        report = fleet.sync_weights(FakeSender, {"w": 0}, 1)
        assert report["ok"] and fleet.in_rotation == [0, 1] and "went away" in report["out_of_rotation"]["dp2"]
        assert len(FakeSender.made) == 1 and FakeSender.made[0].sent == 1  # no second send of version 1
        assert reps[0].version == reps[1].version == 1


def test_the_hook_gives_a_fleet_a_sender_maker_and_warns_naming_the_replica_out(
        caplog: pytest.LogCaptureFixture) -> None:
    reps = _three()
    with _fleet(*reps) as fleet:
        hook = WeightSyncHook(fleet, nn.Linear(2, 2))
        made: list[int] = []
        hook._new_sender = lambda transfer, n: made.append(n) or FakeSender(n)  # type: ignore[method-assign]
        reps[1].fail_audit = True
        with caplog.at_level(logging.WARNING, logger="trainer_hooks"), hook.training():
            pass
        assert made == [4] and hook.version == 1 and hook.stats["audit"] == "ok"
        assert list(hook.stats["out_of_rotation"]) == ["dp1"]
        assert "dp1" in caplog.text and "tensor 'w' differs" in caplog.text
        assert [c[0] for c in reps[0].calls[:3]] == ["sleep", "wake_up", "init"]
        hook.close()
        assert FakeSender.made[-1].closed


# ---- sidecar fleet's placement --------------------------------------------------------------------


def test_fleet_cli_places_ranks_on_gpus_and_ports_and_refuses_per_replica_flags() -> None:
    plans = plan_replicas(3, "2,1,1", None, "cuda", 8000)
    assert [(p.dp_rank, p.tp, p.port, p.gpus) for p in plans] == [(0, 2, 8000, (0, 1)), (1, 1, 8001, (2,)),
                                                                  (2, 1, 8002, (3,))]
    shared = plan_replicas(4, "1", "0,0,0,0", "cuda", 0)
    assert [(p.port, p.gpus) for p in shared] == [(0, (0,))] * 4
    assert "--dp-rank" in plans[1].command("127.0.0.1", "cuda", []) and plans[0].command("h", "cuda", [])[-1] == "0,1"
    assert [p.gpus for p in plan_replicas(2, "1", None, "cpu", 9000)] == [None, None]
    for args, field in (((2, "1,1,1", None, "cpu", 0), "tp"), ((2, "2", "0,0,1,1", "cuda", 0), "gpus"),
                        ((1, "1", "0", "cpu", 0), "gpus"), ((2, "1", None, "cpu", 65535), "port")):
        with pytest.raises(InvalidRequestError) as bad:
            plan_replicas(*args)
        assert bad.value.field == field
    assert launch_flags(["--", "--max-model-len", "512"]) == ["--max-model-len", "512"]
    with pytest.raises(InvalidRequestError, match="per replica"):
        launch_flags(["--", "--port=9"])
