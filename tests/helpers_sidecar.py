"""Launch a real `sidecar launch` subprocess on a free port for tests, and always clean it up."""

from __future__ import annotations

import contextlib
import functools
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
KV_BYTES = 4_000_000  # ~160 blocks of the tiny model: room for 64 short requests at once
START_TIMEOUT_S = 120.0


@dataclass
class Sidecar:
    proc: subprocess.Popen
    url: str
    log_path: Path

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        """Signal the sidecar and wait for it; kill it (and fail loudly later) if it hangs."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
                raise AssertionError(f"sidecar did not stop within {timeout} s after signal {sig}") from None
        return int(self.proc.returncode)


def launch(*args: str, env: dict[str, str] | None = None, timeout: float = START_TIMEOUT_S) -> Sidecar:
    """Start `sidecar launch --port 0 --device cpu ...` and wait for its "serving on" line."""
    cmd = [sys.executable, "-m", "sidecar.cli.main", "launch", "--port", "0", "--device", "cpu",
           "--kv-cache-bytes", str(KV_BYTES), "--log-level", "warning", *args]
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    full_env = {**os.environ, "PYTHONPATH": path, **(env or {})}
    fd, name = tempfile.mkstemp(prefix="sidecar-test-", suffix=".log", dir=_log_dir().name)
    log = Path(name)
    with os.fdopen(fd, "w") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=err, text=True)
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout
    try:
        while True:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            if line is None:
                raise AssertionError(f"sidecar exited with {proc.wait(10)} before serving:\n{log.read_text()}")
            match = re.search(r"Sidecar serving on (http://\S+)", line)
            if match:
                return Sidecar(proc, match.group(1), log)
    except BaseException:
        proc.kill()
        proc.wait(10)
        raise


@functools.cache
def _log_dir() -> tempfile.TemporaryDirectory:
    """Where this test process's sidecar logs go: one directory, removed with its logs when the process
    exits (tests read a log after stopping its sidecar, so each log lives until then). Made on first
    use, so processes that import this module and never launch (spawned helpers) make none."""
    return tempfile.TemporaryDirectory(prefix="sidecar-test-logs-")


def pid_exists(pid: int) -> bool:
    """True if a process (not a zombie) with this pid exists."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status


def cmdline(pid: int) -> str:
    try:
        return f"{pid}: " + Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except FileNotFoundError:
        return f"{pid}: gone"


def child_pids(pid: int) -> list[int]:
    """Pids whose parent is `pid` (rank processes, multiprocessing's resource tracker)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, IndexError, ProcessLookupError):
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def port_is_free(url: str) -> bool:
    import socket

    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.socket() as s:
        try:
            s.bind((host, int(port)))
        except OSError:
            return False
    return True


# ---- one trainer, several sidecars (replicas) ------------------------------------------------------


@contextlib.contextmanager
def launched(*arg_lists: Sequence[str]) -> Iterator[list[Sidecar]]:
    """Start one sidecar per argument list, all at once; on exit stop them all (each must exit 0)."""
    with ThreadPoolExecutor(len(arg_lists), thread_name_prefix="launch") as pool:
        starts = [pool.submit(launch, *args) for args in arg_lists]
    servers = [s.result() for s in starts if s.exception() is None]
    try:
        for s in starts:
            s.result()  # the first failed launch raises here, with every started one recorded above
        yield servers
    finally:
        with ThreadPoolExecutor(len(servers) or 1, thread_name_prefix="stop") as pool:
            codes = list(pool.map(lambda server: server.stop(), servers))
        assert codes == [0] * len(servers), "\n".join(s.log for s in servers)


def connect_replicas(clients: Sequence[Any], sender: Any) -> None:
    """Join one WeightSender to several sidecars (SidecarClients). Every sidecar names its ranks
    dp0:..., so each gets its own `ranks` map: its ranks take the next group ranks, in order."""
    info = sender.init_info()
    infos, next_rank = [], 1
    for c in clients:
        keys = [r["rank"] for r in c.state()["ranks"]]
        infos.append({**info, "ranks": {key: next_rank + i for i, key in enumerate(keys)}})
        next_rank += len(keys)
    if next_rank != info["world_size"]:
        raise AssertionError(f"the sender expects {info['world_size'] - 1} receivers, the sidecars have "
                             f"{next_rank - 1} ranks")
    from trainer_hooks.sync import join

    answers, error = join(sender, {i: (c.weights, info) for i, (c, info) in enumerate(zip(clients, infos))})
    for answer in answers.values():  # one nonce for the group, as a Fleet's join draws it
        if isinstance(answer, BaseException):
            raise answer
    if error is not None:
        raise error


def sync_replicas(clients: Sequence[Any], sender: Any, named: Mapping[str, Any], version: int) -> list[dict]:
    """One sync into every sidecar, the protocol's one round (trainer_hooks/sync.py): an update carrying the
    start on each beside one sender.send(); returns each sidecar's audit of what its ranks received."""
    from trainer_hooks.sync import sync_round

    answers, error = sync_round(sender, {i: c.weights for i, c in enumerate(clients)}, list(named.items()),
                                version, "target", False)
    for answer in answers.values():
        if isinstance(answer, BaseException):
            raise answer
    if error is not None:
        raise error
    return [answers[i]["audit"] for i in range(len(clients))]


def first_digest_wrong(monkeypatch: Any, kept: list[Any] | None = None) -> None:
    """The fault of a failed audit: every WeightSender delivers a first digest its bytes miss, until
    monkeypatch.undo() (the true records go to `kept`)."""
    import dataclasses

    from inference.transfer import sender as sender_module

    real = sender_module.send_digests

    def wrong(group: Any, records: Any, n: int, section: bytes = b"") -> None:
        if kept is not None:
            kept.extend(records or [])
        if records:
            records = [dataclasses.replace(records[0], digest="0" * len(records[0].digest)), *records[1:]]
        real(group, records, n, section)

    monkeypatch.setattr(sender_module, "send_digests", wrong)


def digests_by_rank(client: Any, source: str = "held") -> dict[str, dict[str, str]]:
    """{rank key: {tensor name: digest}} of one sidecar's target model; held digests by the host rule,
    loader_digests' (a GPU rank's own default is the device rule)."""
    from checksum import ALGORITHM

    manifests = client.checksums(source=source, algorithm=ALGORITHM if source == "held" else None)
    return {m["rank"]: {t["name"]: t["digest"] for t in m["tensors"]} for m in manifests}


def loader_digests(model_dir: str | Path, tp_size: int = 1) -> dict[str, dict[str, str]]:
    """{rank key: {parameter: digest}}: what loading the checkpoint in float32 gives each TP rank, built
    on the CPU (a rank's shard needs no process group to load)."""
    import torch

    from checksum import digest_tensors
    from inference.models import build_model
    from inference.models.hf_config import read_model_config
    from inference.models.loader import load_weights
    from inference.parallel import TPInfo

    config = read_model_config(model_dir)
    out = {}
    for rank in range(tp_size):
        tp = TPInfo(rank=rank, size=tp_size, group=object()) if tp_size > 1 else TPInfo()
        model = build_model(config, tp, torch.float32, "cpu")
        load_weights(model, Path(model_dir))
        out[f"dp0:pp0:tp{rank}"] = {r.name: r.digest for r in digest_tensors(list(model.named_parameters()))}
    return out


# ---- a trainer that dies mid-update ----------------------------------------------------------------
MID_UPDATE = "mid-update"


def dying_sender(out: Any, backend: str, device: str, weights: Mapping[str, Any], bucket_bytes: int,
                 timeout_s: float) -> None:
    """Run in a spawned process: put init_info, connect, put the manifest of `weights` (version 1),
    start send(); at the third bucket put MID_UPDATE and wait to be killed (see kill_when_told)."""
    import torch

    from inference.transfer.sender import WeightSender

    if torch.device(device).type == "cuda":
        torch.cuda.set_device(torch.device(device))
    sender = WeightSender(backend, bucket_bytes=bucket_bytes, timeout_s=timeout_s, device=device)
    out.put(sender.init_info())
    sender.connect()
    named = {k: v.to(device) for k, v in weights.items()}
    out.put(sender.manifest(named, 1))
    def third_message() -> None:  # bucket messages are under way: stall mid-send
        out.put(MID_UPDATE)
        time.sleep(600)

    on_bucket_message(sender._group, 3, third_message)
    sender.send(named, deliver_digests=True)


def on_bucket_message(group: Any, n: int, act: Callable[[], None]) -> None:
    """Run `act` when the sender starts its n-th bucket message, whichever way its backend moves
    buckets: a broadcast (nccl) or a point-to-point send (gloo's chain, inference/transfer/backends/chain.py)."""
    calls = [0]

    def counted(real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            if calls[0] == n:
                act()
            return real(*args, **kwargs)
        return call

    group.broadcast, group.exchange = counted(group.broadcast), counted(group.exchange)


def kill_when_told(out: Any, pid: int, timeout: float = 120.0) -> threading.Thread:
    """A thread that SIGKILLs `pid` once it reads MID_UPDATE from `out`."""

    def wait_and_kill() -> None:
        if out.get(timeout=timeout) == MID_UPDATE:
            os.kill(pid, signal.SIGKILL)

    thread = threading.Thread(target=wait_and_kill, name="kill-mid-update", daemon=True)
    thread.start()
    return thread


def check_killed_sender_recovers(server: Sidecar, backend: str, device: str, prompts: Sequence[Any],
                                 params: Any, new: Mapping[str, Any], want: list[list[int]],
                                 bucket_bytes: int, dead_timeout_s: float) -> None:
    """A sender process SIGKILLed mid-update: the update call fails with 502, the sidecar and its
    ranks live on, the model is torn and refuses generation; a new sender's init + sync of `new`
    (version 2) makes it serve `want` again. Shared by the gloo (CPU) and nccl (GPU) tests."""
    import multiprocessing as mp

    import pytest

    from inference.models.tiny import TinyModelSpec, random_weights
    from inference.transfer.sender import WeightSender
    from sidecar.client import SidecarClient, SidecarStateError, SidecarTransferError

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    doomed = random_weights(TinyModelSpec(seed=99))
    proc = ctx.Process(target=dying_sender, args=(out, backend, device, doomed, bucket_bytes, dead_timeout_s),
                       daemon=True)
    proc.start()
    sender = WeightSender(backend, num_receivers=server_ranks(server), bucket_bytes=bucket_bytes, timeout_s=120,
                          device=device)
    try:
        with SidecarClient(server.url, timeout=120) as c:
            c.init_weights(out.get(timeout=120))
            update = c.weights.update({"model": "target", "version": 1, "manifest": out.get(timeout=120)})
            killer = kill_when_told(out, int(proc.pid or 0))
            with pytest.raises(SidecarTransferError) as failed:
                update.result()
            assert failed.value.status == 502
            killer.join(30)
            proc.join(30)
            assert proc.exitcode == -signal.SIGKILL, f"the sender was not killed mid-update ({proc.exitcode})"
            state = c.state()
            assert server.proc.poll() is None and state["healthy"], state
            assert all(r["alive"] for r in state["ranks"]), state
            assert state["torn"] == {"target": True} and state["weight_versions"] == {"target": 0}
            with pytest.raises(SidecarStateError, match="weights first"):
                c.generate(prompts, params, wait=False)
            c.connect_sender(sender)
            result = c.sync_weights(sender, {k: v.to(device) for k, v in new.items()}, version=2)
            assert result["ok"], result["table"]
            got = c.generate(prompts, params)
            assert [o.outputs[0].token_ids for o in got] == want and {o.weight_version for o in got} == {2}
            assert c.state()["torn"] == {"target": False} and server.proc.poll() is None
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(10)
        sender.close()


def server_ranks(server: Sidecar) -> int:
    from sidecar.client import SidecarClient

    with SidecarClient(server.url) as c:
        return len(c.state()["ranks"])
