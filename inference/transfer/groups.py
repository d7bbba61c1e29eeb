"""The trainer <-> sidecar group: its own TCPStore, a gloo control plane, and the backend's data plane.

Never the default process group, never torch.distributed's global state: the backend objects are
built directly on a PrefixStore keyed by a fresh session id, so a re-init after a crash never meets
the keys of a stale group. Rank 0 is the sender (and the store's master); receivers are 1..N.

Every operation has a timeout. A failed collective (timeout, peer gone) raises TransferError and
marks the group broken: every later call fails at once, and the caller must build a new group (a
new init_info with a new session id). Two ends that merely disagree on a plan (`agree` -> False)
leave the group healthy. Control traffic (plan agreement, status, the
ipc layout) always runs over gloo on the CPU; bulk bytes go over the backend's data plane when it
builds one (`TransferBackend.data_plane`: NCCL's), else over the same gloo group. The group knows no
backend by name: the backend's end hands its data plane in.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import socket
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from inference.core import InvalidRequestError, SidecarError
from inference.transfer.backends import check_backend

log = logging.getLogger(__name__)

_KEY_PREFIX = "sidecar-transfer"
# The most timeouts a join waits out in a row, so a caller can bound it: the store connect (torch retries
# it once, after a random delay of up to the timeout: 2), the secret's proofs, the control group's
# rendezvous, the data plane's, and its warm-up broadcast.
JOIN_TIMEOUTS = 6
_POLL_S = 2e-4  # data plane completion polling interval: small next to any bucket's transfer time


class TransferError(SidecarError, RuntimeError):
    """The wire failed (a timeout, a peer that died) or the two ends disagree on the plan.

    After a failed collective the group is broken (`TransferGroup.broken`) and a new
    init_weight_transfer_engine (new session) is needed; after a disagreement it is still usable.
    """


MAX_WORLD_SIZE = 1 << 16  # processes in one weight-transfer group; torch's own bound (int32) failed late


@dataclass(frozen=True)
class InitInfo:
    """What a receiver needs to join the sender's group (JSON-able; the sidecar forwards it).

    `ranks` optionally maps a rank key ("dp0:pp0:tp1") to its group rank (a group of several sidecars);
    without it the group is one sidecar's and a receiver's rank is 1 + tp_rank, whatever its dp rank.
    `auth`: the session's secret (WeightSender makes a random one per session). It travels only in this
    dict (over the sidecar's authenticated HTTP API), never through the store: every rank proves it holds
    it before any group traffic (`authenticate`).
    """

    backend: str
    master_host: str
    master_port: int
    world_size: int
    bucket_bytes: int
    timeout_s: float
    session_id: str
    ranks: dict[str, int] | None = None
    auth: str | None = None
    delta: bool = False  # every sync of the session starts with the delta offer (inference/transfer/delta.py)
    # the sender may send FP8 payloads, quantized on send (inference/transfer/fp8_payload.py); every rank
    # refuses the init when it holds no model in FP8, and answers which of its models take them
    send_fp8: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: object) -> InitInfo:
        if isinstance(d, InitInfo):
            return d
        if not isinstance(d, dict):
            raise InvalidRequestError("init_info", f"must be an object, got {type(d).__name__}")
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(d) - known)
        if unknown:
            raise InvalidRequestError(f"init_info.{unknown[0]}", f"unknown field (known: {sorted(known)})")
        missing = sorted(known - {"ranks", "auth", "delta", "send_fp8"} - set(d))
        if missing:
            raise InvalidRequestError(f"init_info.{missing[0]}", "missing field")
        info = cls(**d)
        info.validate()
        return info

    def validate(self) -> None:
        def bad(name: str, msg: str) -> InvalidRequestError:
            return InvalidRequestError(f"init_info.{name}", msg)

        for name in ("backend", "master_host", "session_id", "auth"):
            value = getattr(self, name)
            if isinstance(value, str) and not value.isascii():
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError:  # JSON's lone \ud800: no socket or store key can carry it
                    raise bad(name, "is not valid Unicode (a lone surrogate)") from None
        check_backend(self.backend, "init_info.backend")
        if not isinstance(self.master_port, int) or not 0 < self.master_port < 65536:
            raise bad("master_port", f"must be a TCP port, got {self.master_port!r}")
        if not isinstance(self.world_size, int) or not 2 <= self.world_size <= MAX_WORLD_SIZE:
            raise bad("world_size", f"must be an integer in [2, {MAX_WORLD_SIZE}] (sender + receivers), got "
                                    f"{self.world_size!r}")
        if not isinstance(self.bucket_bytes, int) or self.bucket_bytes <= 0:
            raise bad("bucket_bytes", f"must be a positive integer, got {self.bucket_bytes!r}")
        if not isinstance(self.timeout_s, (int, float)) or not self.timeout_s > 0:
            raise bad("timeout_s", f"must be a positive number, got {self.timeout_s!r}")
        if not isinstance(self.session_id, str) or not self.session_id:
            raise bad("session_id", "must be a non-empty string")
        for name in ("delta", "send_fp8"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, f"must be true or false, got {getattr(self, name)!r}")
        if self.auth is not None and (not isinstance(self.auth, str) or len(self.auth) < 16):
            raise bad("auth", "must be the session's secret, a string of 16 or more characters")

    @property
    def timeout(self) -> timedelta:
        return timedelta(seconds=float(self.timeout_s))

    def receiver_rank(self, rank_key: str, tp_rank: int) -> int:
        """The group rank of one sidecar rank: `ranks` names it when the group holds several sidecars (a
        fleet). Without it the group is the sender and ONE sidecar, whose ranks are 1..tp in TP order
        whatever its dp rank: the dp rank names a replica in reports, it places nothing in a group."""
        rank = self.ranks.get(rank_key) if self.ranks else 1 + tp_rank
        if not isinstance(rank, int) or not 1 <= rank < self.world_size:
            raise InvalidRequestError(
                "init_info.ranks", f"rank {rank_key} maps to group rank {rank!r}, outside 1..{self.world_size - 1}")
        return rank


def owner_key(owner: str | None) -> int:
    """The plan agreement's key of an update's owner (the nonce its sidecar's init answered; None: no
    owner named), in [1, 2**62): both ends put it in the one all-reduce, so bytes and digests of a sender
    that is not the owner's are refused before any moves."""
    digest = hashlib.sha256(f"owner/{owner or ''}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % ((1 << 62) - 1) + 1


def new_session_id() -> str:
    return uuid.uuid4().hex


def new_session_secret() -> str:
    return secrets.token_hex(16)


def _proof(info: InitInfo, rank: int) -> str:
    assert info.auth is not None
    return hmac.new(info.auth.encode(), f"{info.session_id}/rank {rank}".encode(), hashlib.sha256).hexdigest()


def authenticate(store: dist.Store, info: InitInfo, rank: int, cancelled: Cancelled | None = None) -> None:
    """Prove this rank holds the session's secret, and check its peers' proofs (the sender checks every
    receiver's, a receiver the sender's), before any group traffic. A proof is an HMAC of the session id
    and the rank under the secret: it reveals nothing a store reader could reuse, for another rank or
    session. Raises TransferError naming the peer whose proof is wrong. docs/limits.md says what this
    protects (a store client without the secret is never counted as a member) and what not."""
    store.set(f"auth/{rank}", _proof(info, rank))
    for peer in range(1, info.world_size) if rank == 0 else [0]:
        _wait_key(store, f"auth/{peer}", info.timeout, cancelled)
        if not hmac.compare_digest(store.get(f"auth/{peer}"), _proof(info, peer).encode()):
            raise TransferError(f"group rank {peer} of session {info.session_id} did not prove the session's "
                                "secret (init_info.auth): a store client that is not the trainer's peer")


Cancelled = Callable[[], "str | None"]  # why the join was called off (the sidecar refused it), or None


def _wait_key(store: dist.Store, key: str, timeout: timedelta, cancelled: Cancelled | None) -> None:
    """store.wait, but a join the other side already refused (its /weights/init answered an error) is
    called off within ~20 ms instead of waiting out the whole timeout."""
    if cancelled is None:
        store.wait([key], timeout)
        return
    deadline = time.monotonic() + timeout.total_seconds()
    while not store.check([key]):
        reason = cancelled()
        if reason is not None:
            raise TransferError(f"the join was called off: {reason}")
        if time.monotonic() > deadline:
            store.wait([key], timedelta(milliseconds=1))  # the store's own timeout error
        time.sleep(0.02)


def master_store(host: str, port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    """A store server listening on `host` only; port 0 picks a free port (read it back from `.port`).

    torch's TCPStore server listens on every interface whatever host it is given, and its store has no
    authentication: so the socket is bound here, to `host` (the address the peers dial: loopback for a
    trainer beside its sidecar), and handed over (`master_listen_fd`)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(max(128, world_size))
        bound = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    return dist.TCPStore(host, bound, world_size, True, timedelta(seconds=timeout_s), wait_for_workers=False,
                         master_listen_fd=sock.detach())  # the store owns the socket from here


DataPlane = Callable[[dist.Store, int, int, InitInfo, torch.device], Any]  # TransferBackend.data_plane


class TransferGroup:
    """One session's process groups. Construction blocks until every rank has joined (or times out).
    `data_plane`: builds the backend's group for the bytes from the session's store, or returns None
    (the bytes then go over the gloo control group)."""

    def __init__(self, info: InitInfo, rank: int, device: torch.device, store: dist.Store | None = None,
                 label: str | None = None, data_plane: DataPlane | None = None,
                 cancelled: Cancelled | None = None) -> None:
        self.info = info
        self.rank = rank
        self.label = f"{label} (group rank {rank})" if label else f"group rank {rank}"
        self.device = device
        self.timeout = info.timeout
        self.broken: str | None = None
        self._data: Any = None
        try:
            if store is None:
                store = dist.TCPStore(info.master_host, info.master_port, info.world_size, False, self.timeout)
            session = dist.PrefixStore(f"{_KEY_PREFIX}/{info.session_id}", store)
            self._store = store
            if info.auth is not None:
                authenticate(session, info, rank, cancelled)
            self._control = dist.ProcessGroupGloo(
                dist.PrefixStore("control", session), rank, info.world_size, self.timeout)
            if data_plane is not None:
                self._data = data_plane(dist.PrefixStore("data", session), rank, info.world_size, info, device)
        except Exception as e:
            self.broken = str(e)
            raise TransferError(f"{self.label} could not join session {info.session_id} at "
                                f"{info.master_host}:{info.master_port}: {e}") from e
        if self._data is not None:  # communicators (NCCL's) start lazily: fail here, not mid-sync
            self.wait(self.broadcast(torch.zeros(1, dtype=torch.uint8, device=device)), "data plane warm-up")

    @property
    def has_data_plane(self) -> bool:
        return self._data is not None

    # ---- data plane ---------------------------------------------------------------------------
    def broadcast(self, tensor: torch.Tensor) -> Any:
        """Start broadcasting `tensor` (contiguous) from rank 0; returns the work to `wait` on."""
        self._check()
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor, opts.timeout = 0, 0, self.timeout
        try:
            if self.has_data_plane:
                with torch.cuda.device(self.device):
                    return self._data.broadcast([tensor], opts)
            return self._control.broadcast([tensor], opts)
        except Exception as e:
            raise self._fail("broadcast", e) from e

    def exchange(self, send: bool, tensor: torch.Tensor, peer: int, what: str, tag: int = 0) -> Any:
        """Start sending `tensor` (contiguous, on the host) to group rank `peer`, or receiving it from
        there, on the control group; returns the work to `wait` on. A send pairs with the receive of
        the same `tag` (>= 0); a pair's messages of one tag arrive in order. `what` names the operation
        in the error that breaks the group if it cannot start."""
        self._check()
        try:
            op = self._control.send if send else self._control.recv
            return op([tensor], peer, tag)
        except Exception as e:
            raise self._fail(what, e) from e

    def wait(self, work: Any, what: str) -> None:
        """Block until `work` is done; TransferError after the timeout or if a peer failed."""
        self._check()
        try:
            if self.has_data_plane:
                self._poll(work, what)
            else:
                work.wait(self.timeout)
        except TransferError:
            raise
        except Exception as e:
            raise self._fail(what, e) from e

    def _poll(self, work: Any, what: str) -> None:
        # A device work's wait() (NCCL's) only orders streams unless blocking wait is on; poll so the
        # timeout holds.
        deadline = time.monotonic() + self.timeout.total_seconds()
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise self._fail(what, TimeoutError(f"no progress in {self.timeout.total_seconds():.1f} s"))
            time.sleep(_POLL_S)
        work.wait()  # completed: raises the work's error, if any

    # ---- control plane (gloo, CPU, synchronous) -------------------------------------------------
    def all_max(self, values: list[int], what: str) -> list[int]:
        """Element-wise max over all ranks (statuses: 0 ok, non-zero failed)."""
        self._check()
        t = torch.tensor(values, dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp, opts.timeout = dist.ReduceOp.MAX, self.timeout
        try:
            self._control.allreduce([t], opts).wait(self.timeout)
        except Exception as e:
            raise self._fail(what, e) from e
        return t.tolist()

    def agree(self, fingerprint: int) -> bool:
        """True on every rank iff every rank passed the same fingerprint (0 < fingerprint < 2**62;
        0 never agrees: a rank that cannot go on passes it)."""
        return self.agree_many([fingerprint])[0][0]

    def agree_many(self, keys: Sequence[int], values: Sequence[int] = ()) -> tuple[list[bool], list[int]]:
        """One all-reduce: per key (0 <= key < 2**62), whether every rank passed the same non-zero
        key; per value, its maximum over the ranks (e.g. the size of a message rank 0 sends next).

        max(k) == -max(-k) only when min(k) == max(k), so every rank reaches the same verdicts.
        """
        assert all(0 <= k < 1 << 62 for k in keys), keys
        got = self.all_max([v for k in keys for v in (k, -k)] + list(values), "plan agreement")
        n = 2 * len(keys)
        return [got[i] != 0 and got[i] == -got[i + 1] for i in range(0, n, 2)], got[n:]

    def broadcast_bytes(self, payload: bytes | None, size: int | None = None) -> bytes:
        """Rank 0's payload on every rank (receivers pass None). `size`: its length when every rank
        already knows it (from `agree_many`), which saves the all-reduce that would share it."""
        return self.post_bytes(payload, size)()

    def post_bytes(self, payload: bytes | None, size: int | None = None) -> Callable[[], bytes]:
        """broadcast_bytes, started now: the returned callable (call it once) waits for it and returns the
        payload. A receiver posts its side early, so the sender's message meets a posted receive."""
        assert (payload is not None) == (self.rank == 0)
        assert size is None or payload is None or size == len(payload), (size, len(payload))
        if size is None:
            size = self.all_max([len(payload) if payload is not None else 0], "control message size")[0]
        buf = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload
               else torch.empty(size, dtype=torch.uint8))
        work = None
        if size:
            opts = dist.BroadcastOptions()
            opts.rootRank, opts.rootTensor, opts.timeout = 0, 0, self.timeout
            self._check()
            try:
                work = self._control.broadcast([buf], opts)
            except Exception as e:
                raise self._fail("control message", e) from e

        def done() -> bytes:
            if work is not None:
                try:
                    work.wait(self.timeout)
                except Exception as e:
                    raise self._fail("control message", e) from e
            return bytes(buf.numpy()) if payload is None else payload

        return done

    # ---- lifecycle ------------------------------------------------------------------------------
    def close(self) -> None:
        """Drop the groups; a data plane is aborted so no kernel waits on a dead peer."""
        self._abort_data()
        self._data = self._control = None
        self.broken = self.broken or "closed"

    def _abort_data(self) -> None:
        if self._data is None:
            return
        try:
            self._data.abort()
        except Exception as e:  # an already-failed communicator may refuse; the group is dropped anyway
            log.warning("aborting the data plane of session %s failed: %s", self.info.session_id, e)

    def _check(self) -> None:
        if self.broken is not None:
            raise TransferError(f"{self.label}: the group of session {self.info.session_id} is broken "
                                f"({self.broken}); call init_weight_transfer_engine again")

    def _fail(self, what: str, e: BaseException) -> TransferError:
        self.broken = f"{what}: {e}"
        self._abort_data()  # a timed-out device kernel (NCCL's) would spin forever: abort the communicator
        hint = ("; the trainer and this rank share one GPU, which NCCL refuses: sync over CUDA IPC "
                "(`sidecar launch --transfer ipc`)") if "Duplicate GPU detected" in str(e) else ""
        return TransferError(f"{what} failed on {self.label} (session {self.info.session_id}, "
                             f"timeout {self.timeout.total_seconds():g} s): {e}{hint}")

