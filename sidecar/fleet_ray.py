"""`place_fleet`: N sidecar replicas placed as Ray actors, returned as a `RayFleet` (a Fleet that owns them).

Placement: one placement-group bundle per replica, {"CPU": cpus_per_replica, "GPU": tp_i} on CUDA and
{"CPU": cpus_per_replica} on the CPU. A bundle lives on one node, so a replica's TP ranks share a node;
`strategy` (Ray's PACK, SPREAD, STRICT_PACK, STRICT_SPREAD) says how the replicas spread over nodes.
Replica i's actor holds bundle i and runs, as its child process, the `sidecar launch` line that
sidecar/cli/fleet.py ReplicaPlan builds, with --host <its node's IP> --port 0 [--devices 0..T_i-1]:
- Ray sets the actor's CUDA_VISIBLE_DEVICES to its bundle's GPUs, so devices 0..T_i-1 are those;
  a fractional `gpus_per_replica` (TP 1) lets several replicas share one GPU.
- Port 0: the replica binds a free port on its node, and the node's IP is the one Ray reaches it by,
  so the driver reaches it too.
- That address is not loopback, so a replica always has an API key: `api_key` (else $SIDECAR_API_KEY,
  else a random one per fleet, `RayFleet.api_key`), given to it as SIDECAR_API_KEY (not on its command
  line, where `ps` shows it) and to the Fleet's clients.
Nothing outlives the fleet: a failed start, close() and the driver's death each end every replica
(SIGTERM, then SIGKILL), actor and placement group. Ray is imported inside the functions only
(`pip install "sidecar[ray]"`): sidecar imports without it. Operating it: docs/fleet.md.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import queue
import re
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inference import envs
from inference.core import InvalidRequestError
from sidecar.child_process import die_with_parent, stdout_lines
from sidecar.cli.fleet import STOP_TIMEOUT_S, ReplicaPlan, launch_flags, plan_replicas
from sidecar.config import LaunchConfig
from trainer_hooks.fleet import Fleet
from trainer_hooks.fleet_replicas import FleetError

log = logging.getLogger("sidecar.fleet_ray")

POLL_S = 1.0  # longest single call into an actor while replicas start
TAIL_LINES = 40
STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")

__all__ = ["PlacedReplica", "RayFleet", "ReplicaStartError", "fleet_key", "place_fleet"]


class ReplicaStartError(FleetError):
    """Replicas that did not start; `failures` maps each one's name (dp{i}) to why, with its log's tail.
    Raised after every replica, actor and the placement group of the attempt are gone."""

    def __init__(self, failures: dict[str, str]) -> None:
        super().__init__("replica(s) did not start on the Ray cluster; every replica of the fleet was stopped"
                         + "".join(f"\n  {name}: {why}" for name, why in failures.items()))
        self.failures = dict(failures)


@dataclass(frozen=True)
class PlacedReplica:
    """Where one replica runs: its URL, node, the pids of `sidecar launch` and of its actor there."""

    dp_rank: int
    tp: int
    url: str
    node: str
    pid: int
    actor_pid: int


class ReplicaProcess:
    """Lives in replica i's Ray actor: its `sidecar launch` child, the child's stdout lines and log.
    Every method returns within about POLL_S (stop within stop_timeout_s)."""

    def __init__(self, plan: ReplicaPlan, device: str, extra: list[str], log_dir: str | None, api_key: str) -> None:
        import ray

        self.plan, self.node = plan, ray.util.get_node_ip_address()
        self.own_dir = log_dir is None  # a temporary directory, removed by stop()
        folder = Path(tempfile.mkdtemp(prefix="sidecar-ray-") if log_dir is None else log_dir)
        folder.mkdir(parents=True, exist_ok=True)
        self.log_path = folder / f"replica{plan.dp_rank}.log"
        with open(self.log_path, "a") as err:
            self.proc = subprocess.Popen(plan.command(self.node, device, extra), stdout=subprocess.PIPE, stderr=err,
                                         text=True, env={**os.environ, envs.API_KEY.name: api_key},
                                         preexec_fn=functools.partial(die_with_parent, os.getpid()))
        self.lines = stdout_lines(self.proc)

    def started(self) -> dict[str, Any]:
        return {"node": self.node, "pid": self.proc.pid, "actor_pid": os.getpid()}

    def poll(self, wait_s: float) -> dict[str, Any]:
        """{"url": ...} once it serves, {"exited": code, "tail": ...} if it ended, {} while it starts."""
        from sidecar.cli.launch import SERVING_LINE  # the line's owner

        pattern = re.compile(re.escape(SERVING_LINE).replace(re.escape("{url}"), r"(\S+)"))
        deadline = time.monotonic() + wait_s
        while True:
            try:
                line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                return {}
            if line is None:
                return {"exited": self.proc.wait(5 * POLL_S), "tail": self.tail()}  # its stdout closed
            match = pattern.search(line)
            if match:
                return {"url": match.group(1)}

    def tail(self, lines: int = TAIL_LINES) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""

    def stop(self, timeout_s: float) -> dict[str, Any]:
        """SIGTERM the replica and wait for it, SIGKILL after timeout_s; remove a temporary log."""
        killed = False
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                killed = True
                self.proc.kill()
                self.proc.wait(30)
        if self.own_dir:
            shutil.rmtree(self.log_path.parent, ignore_errors=True)
        return {"returncode": self.proc.returncode, "killed": killed}


class _Placement:
    """The placement group, the actors in it and what each replica reported; close() removes them all."""

    def __init__(self, pg: Any, stop_timeout_s: float) -> None:
        self.pg, self.stop_timeout_s = pg, stop_timeout_s
        self.actors: list[Any] = []
        self.placed: list[PlacedReplica] = []
        self.closed = False

    def close(self) -> None:
        """Stop every replica (each actor's own stop, concurrently), kill every actor, remove the group.
        Idempotent. A replica that had to be SIGKILLed, or whose actor was gone already (its replica got
        SIGTERM then), is logged as a warning: nothing is left either way."""
        if self.closed:
            return
        self.closed = True
        import ray
        from ray.util.placement_group import remove_placement_group

        try:
            stops = [a.stop.remote(self.stop_timeout_s) for a in self.actors]
            for i, ref in enumerate(stops):
                try:
                    done = ray.get(ref, timeout=self.stop_timeout_s + 30)
                except ray.exceptions.RayError as e:
                    log.warning("replica dp%d: its actor could not stop it (%s); it dies with the actor", i, e)
                    continue
                if done["killed"]:
                    log.warning("replica dp%d did not stop within %g s of SIGTERM: killed", i, self.stop_timeout_s)
        finally:
            for a in self.actors:
                ray.kill(a, no_restart=True)
            remove_placement_group(self.pg)


class RayFleet(Fleet):
    """A Fleet of the replicas `place_fleet` placed; close() (or leaving `with`) also stops every replica,
    kills every actor and removes the placement group. `placed`: each replica's URL, node and pids.

    close(): the Fleet's clients and transfer group close, every actor SIGTERMs its replica and waits for
    it (SIGKILL after `stop_timeout_s`), then every actor is killed and the placement group removed.
    Should the driver die instead, Ray ends the job's actors and each replica gets SIGTERM when its actor
    dies (PR_SET_PDEATHSIG: actor methods run on the worker's main thread, the one that forks the
    replica)."""

    def __init__(self, placement: _Placement, **fleet_options: Any) -> None:
        self._placement = placement
        self.placed = list(placement.placed)
        self.api_key: str | None = fleet_options.get("api_key")  # every replica's (module docstring)
        try:
            super().__init__([p.url for p in self.placed], **fleet_options)
        except BaseException:
            placement.close()
            raise

    @property
    def placement_group(self) -> Any:
        return self._placement.pg

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._placement.close()


def place_fleet(replicas: int, *, device: str = "cuda", tp: int | Sequence[int] = 1,
                launch_args: Sequence[str] | Sequence[Sequence[str]] = (), cpus_per_replica: float = 1.0,
                gpus_per_replica: float | None = None, strategy: str = "PACK", log_dir: str | None = None,
                startup_timeout_s: float = LaunchConfig.startup_timeout_s, stop_timeout_s: float = STOP_TIMEOUT_S,
                **fleet_options: Any) -> RayFleet:
    """Place `replicas` sidecar replicas on the Ray cluster this process is connected to (ray.init first,
    or Ray starts a local one) and return their RayFleet (module docstring).

    device: "cuda" or "cpu" (the nodes', not the driver's). tp: one size, or one per replica.
    launch_args: `sidecar launch` flags for every replica, or one list per replica (not those set here:
    --dp-rank, --tp, --host, --port, --device, --devices). gpus_per_replica: None gives each replica
    tp GPUs; a fraction below 1 shares a GPU between TP-1 replicas (give them --gpu-memory-utilization).
    log_dir: where each node writes replica<i>.log (unset: a temporary directory removed at close).
    fleet_options: passed to Fleet (api_key, timeout, max_retries, ...); api_key is every replica's too
    (unset: $SIDECAR_API_KEY, else a random one; module docstring).
    """
    plans, extras, bundles = _plan(replicas, device, tp, launch_args, cpus_per_replica, gpus_per_replica, strategy)
    fleet_options = {**fleet_options, "api_key": fleet_key(extras, fleet_options.get("api_key"))}
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group(bundles, strategy=strategy, name="sidecar-fleet")
    try:
        ray.get(pg.ready(), timeout=startup_timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        raise FleetError(f"Ray could not place {replicas} replica bundle(s) {bundles} ({strategy}) within "
                         f"{startup_timeout_s:g} s; the cluster has {ray.available_resources()} free") from None
    placement = _Placement(pg, stop_timeout_s)
    try:
        _start(placement, plans, extras, bundles, device, log_dir, startup_timeout_s, fleet_options["api_key"])
    except BaseException:
        placement.close()
        raise
    return RayFleet(placement, **fleet_options)


def fleet_key(extras: Sequence[Sequence[str]], api_key: str | None) -> str:
    """The API key of a fleet's replicas, which bind a non-loopback address: `api_key`, else
    $SIDECAR_API_KEY, else a random one. --api-key among the launch flags is refused: the fleet's clients
    must know the key, so it goes through place_fleet(api_key=...)."""
    for extra in extras:
        if any(a.split("=", 1)[0] == "--api-key" for a in extra):
            raise InvalidRequestError("launch_args", "--api-key is set by place_fleet for every replica and the "
                                      "fleet's clients: pass place_fleet(..., api_key=KEY) instead")
    return api_key or envs.API_KEY.get() or secrets.token_urlsafe(24)


def _plan(replicas: int, device: str, tp: int | Sequence[int], launch_args: Sequence[Any], cpus: float,
          gpus: float | None, strategy: str) -> tuple[list[ReplicaPlan], list[list[str]], list[dict[str, float]]]:
    """Each replica's launch plan, launch flags and bundle; InvalidRequestError naming the argument."""
    if device not in ("cuda", "cpu"):
        raise InvalidRequestError("device", f"must be cuda or cpu (the nodes' device), got {device!r}")
    if strategy not in STRATEGIES:
        raise InvalidRequestError("strategy", f"must be one of {list(STRATEGIES)}, got {strategy!r}")
    if cpus <= 0:
        raise InvalidRequestError("cpus_per_replica", f"must be > 0, got {cpus}")
    sizes = ",".join(map(str, [tp] if isinstance(tp, int) else tp))
    plans = plan_replicas(replicas, sizes, None, "cpu", 0)  # dp ranks and TP sizes; ports: each a free one
    per = list(launch_args)
    if per and not all(isinstance(a, str) for a in per):
        if len(per) != replicas or any(isinstance(a, str) for a in per):
            raise InvalidRequestError("launch_args", f"give one list of flags, or one list per replica ({replicas})")
        extras = [launch_flags(list(a)) for a in per]
    else:
        extras = [launch_flags([str(a) for a in per])] * replicas
    bundles: list[dict[str, float]] = []
    for i, plan in enumerate(plans):
        bundle = {"CPU": float(cpus)}
        if device == "cuda":
            share = float(plan.tp) if gpus is None else float(gpus)
            if not (share == plan.tp or (0 < share < 1 and plan.tp == 1)):
                raise InvalidRequestError("gpus_per_replica", f"replica dp{i} has tp {plan.tp}: give it tp GPUs "
                                          f"(unset), or a share below 1 of one GPU at tp 1, not {gpus}")
            bundle["GPU"] = share
            plans[i] = ReplicaPlan(plan.dp_rank, plan.tp, 0, tuple(range(plan.tp)))
        elif gpus is not None:
            raise InvalidRequestError("gpus_per_replica", "needs device='cuda'")
        bundles.append(bundle)
    return plans, extras, bundles


def _start(placement: _Placement, plans: list[ReplicaPlan], extras: list[list[str]], bundles: list[dict[str, float]],
           device: str, log_dir: str | None, timeout: float, api_key: str) -> None:
    """Create every actor (each starts its replica), wait for every serving line, then for every /health
    from here; fills placement.placed in dp order, or raises ReplicaStartError.

    Every actor starts its replica at once; the driver polls each for its serving line (short calls, so
    a stop is never queued behind a long one), then waits for the replica's /health from the driver
    itself. A replica that exits, does not serve in time or is not healthy from the driver raises
    ReplicaStartError naming dp{i}, its node and its log's tail, after everything started is stopped."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    actor_class = ray.remote(ReplicaProcess)
    for i, (plan, extra, bundle) in enumerate(zip(plans, extras, bundles)):
        where = PlacementGroupSchedulingStrategy(placement.pg, placement_group_bundle_index=i)
        placement.actors.append(actor_class.options(num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
                                                    scheduling_strategy=where, max_restarts=0)
                                .remote(plan, device, extra, log_dir, api_key))
    deadline = time.monotonic() + timeout
    infos, failures = _started(placement.actors, deadline)
    urls: dict[int, str] = {}
    waiting = {i: a.poll.remote(POLL_S) for i, a in enumerate(placement.actors) if i not in failures}
    while waiting and not failures:
        done, _ = ray.wait(list(waiting.values()), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not done:
            failures.update({f"dp{i}": f"did not serve within {timeout:g} s" + _tail(placement.actors[i])
                             for i in waiting})
            break
        i = next(j for j, ref in waiting.items() if ref == done[0])
        del waiting[i]
        try:
            answer = ray.get(done[0])
        except ray.exceptions.RayError as e:
            failures[f"dp{i}"] = f"its actor failed: {e}"
            continue
        if "url" in answer:
            urls[i] = answer["url"]
        elif "exited" in answer:
            failures[f"dp{i}"] = f"`sidecar launch` exited with {answer['exited']} on {infos[i]['node']}; its " \
                                 f"log ends:\n{answer['tail']}"
        else:
            waiting[i] = placement.actors[i].poll.remote(POLL_S)
    for i, url in sorted(urls.items()):
        if not failures and not _healthy(url, deadline):
            failures[f"dp{i}"] = f"serves {url} on {infos[i]['node']}, but its /health did not answer ok from " \
                                 f"this process within {timeout:g} s" + _tail(placement.actors[i])
    if failures:
        raise ReplicaStartError(dict(sorted(failures.items())))
    placement.placed = [PlacedReplica(p.dp_rank, p.tp, urls[i], infos[i]["node"], infos[i]["pid"],
                                      infos[i]["actor_pid"]) for i, p in enumerate(plans)]


def _started(actors: list[Any], deadline: float) -> tuple[dict[int, Any], dict[str, str]]:
    """Every actor's started() (its node and pids): ({index: answer}, {dp name: why its actor failed})."""
    import ray

    refs = [a.started.remote() for a in actors]
    answers, failures = {}, {}
    for i, ref in enumerate(refs):
        try:
            answers[i] = ray.get(ref, timeout=max(1.0, deadline - time.monotonic()))
        except ray.exceptions.RayError as e:  # GetTimeoutError too
            failures[f"dp{i}"] = f"its actor did not start: {e}"
    return answers, failures


def _tail(actor: Any) -> str:
    import ray

    try:
        return "; its log ends:\n" + ray.get(actor.tail.remote(), timeout=30)
    except ray.exceptions.RayError as e:
        return f"; its log could not be read: {e}"


def _healthy(url: str, deadline: float) -> bool:
    """Whether /health answers ok from here before the deadline (a replica's ranks may still settle)."""
    from trainer_hooks.client import SidecarClient

    with SidecarClient(url, timeout=5.0, retries=0) as client:
        while True:
            if client.is_healthy():
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)
