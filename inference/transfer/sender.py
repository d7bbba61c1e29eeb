"""The trainer's end of the weight wire: `WeightSender`. Imports no engine module (torch, checksum,
inference.core and the light inference.transfer modules only), so any trainer process can use it.

Lifecycle: `init_info()` (starts the store; a JSON-able dict for the sidecar's
init_weight_transfer_engine), `connect()` (blocks until every receiver joined; run it while the
sidecar joins), then per sync: `manifest(named_tensors, version)` (for the sidecar's start; it names
the sync's digest rule), `send(named_tensors)` (concurrently with the sidecar's update_weights;
returns the sender's digests for its finish, or with `deliver_digests=True` hands them to the ranks
in the sync, inference/transfer/delivery.py), and at the end `close()`. After any TransferError the
group is broken: call init_info() again (a new session id), give it to the sidecar, and connect()
again; the store server is reused.

How the bytes move is the backend's (inference/transfer/backends/): the sender builds its end from
the registry by name and keeps it across sessions. gloo and nccl pack bucket k+1 while bucket k is on
the wire; ipc lets the ranks copy straight from the trainer's GPU memory (inference/transfer/ipc.py).
With `delta=True` (negotiated in init_info) a sync moves only what changed since the copy every rank
holds, or the full tensors when some rank does not hold it (inference/transfer/delta.py). With
`send_fp8=True` (negotiated likewise) a sync into a model the ranks hold in FP8 sends each linear weight
quantized by the FP8 rule, values and row scales (inference/transfer/fp8_payload.py): digests, a delta and
the byte counters are then of that payload. With `check_installed` (the default) a sync that delivers its
digests also delivers what every rank that holds the model in FP8 must have installed, computed here by
the rule while the bytes move, so a rank that installed other bytes never goes live
(inference/transfer/installed_digests.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from checksum import TensorRecord, dtype_name, pick_algorithm
from inference.core import InvalidRequestError, StateError
from inference.transfer.backends import check_backend
from inference.transfer.backends.base import TransferBackend, backend_class
from inference.transfer.delivery import PLAN_SUFFIX, send_digests
from inference.transfer.delta import (
    SLICE_CODES,
    KeptCopy,
    SliceTable,
    offer_agreed,
    offer_slices,
    offer_values,
)
from inference.transfer.delta_codec import CODES, DeltaLayout
from inference.transfer.digests import PendingRecords, RecordDigests, check_algorithm
from inference.transfer.fp8_payload import payload_specs, payload_tensors
from inference.transfer.groups import (
    InitInfo,
    TransferError,
    TransferGroup,
    master_store,
    new_session_id,
    new_session_secret,
    owner_key,
)
from inference.transfer.installed_digests import (
    ExpectedShares,
    SharesLayout,
    failed_section,
    sender_values,
)
from inference.transfer.plan import (
    DEFAULT_BUCKET_BYTES,
    ParsedManifest,
    TensorSpec,
    plan_buckets,
)

NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
IPC_MODES = ("auto", "direct", "packed")


class WeightSender:
    """Rank 0 of a transfer group: owns the store, plans and sends every sync (see module docstring)."""

    def __init__(self, backend: str = "gloo", *, num_receivers: int = 1, master_host: str = "127.0.0.1",
                 master_port: int = 0, bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout_s: float = 120.0,
                 device: torch.device | str | None = None, ipc_mode: str = "auto",
                 digest_algorithm: str | None = None, delta: bool = False, send_fp8: bool = False,
                 check_installed: bool = True) -> None:
        """`digest_algorithm`: the digest rule of every sync (None: picked per sync from the tensors).
        `delta`: after a full sync, send only the elements that changed (module docstring); the sender
        then keeps a copy of what it sent, where the tensors live (one model's bytes).
        `send_fp8`: quantize the linear weights here and send FP8 values and scales (module docstring);
        each sync's manifest() says whether it does (its `fp8`).
        `check_installed`: a sync that delivers its digests (send(deliver_digests=True)) also delivers the
        installed FP8 digests the ranks that hold the model in FP8 ask for, each rank's share, computed here
        by the rule (on receive: one more quantization of the linears on their device, beside the wire);
        each such rank checks them before its version goes live. False: those ranks go live on their own
        audits (docs/fp8.md)."""
        spec = check_backend(backend, "backend")
        if ipc_mode not in IPC_MODES:
            raise InvalidRequestError("ipc_mode", f"must be one of {list(IPC_MODES)}, got {ipc_mode!r}")
        if digest_algorithm is not None:
            check_algorithm(digest_algorithm, "digest_algorithm")
        plan_buckets([], bucket_bytes)  # validates bucket_bytes
        self.backend, self.num_receivers, self.bucket_bytes = backend, num_receivers, bucket_bytes
        self.timeout_s, self.ipc_mode = timeout_s, ipc_mode
        self._called_off: str | None = None  # set by call_off_connect: the join in progress is refused
        self._host, self._port = master_host, master_port
        default = "cuda" if spec.cuda else "cpu"
        self.device = torch.device(device if device is not None else default)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._store: Any = None
        self._next_info: InitInfo | None = None  # handed out by init_info(), consumed by connect()
        self._group: TransferGroup | None = None
        self.digest_algorithm = digest_algorithm
        # (version, wire specs, algorithm, whether the payload is FP8) of manifest()
        self._pending: tuple[int, ParsedManifest, str, bool] | None = None
        self._last_specs: ParsedManifest | None = None  # reused while the layout repeats (memoized plan)
        self._last_meta: list[tuple[str, torch.dtype, torch.Size, torch.device]] = []  # _last_specs' source
        self._last_fp8 = False  # whether _last_specs are the FP8 payload's
        self._picked = ""  # pick_algorithm over the tensors _last_meta describes (their devices)
        self._algorithm: str | None = None  # of the last manifest()
        self._end: TransferBackend = backend_class(spec)(spec, self.device, "sender", bucket_bytes, ipc_mode)
        self._digests = RecordDigests("sender-digest")
        self._digest_streams: dict[torch.device, Any] = {}
        self._warmed = False  # the digest kernel is compiled for self.device (connect())
        self.delta = bool(delta)
        self.send_fp8 = bool(send_fp8)
        self.check_installed = bool(check_installed)
        self._expected = ExpectedShares()
        self.kept = KeptCopy()  # the base of the next delta (used only with delta=True)
        # how the last send() went: mode (full or delta), fp8 (the payload was quantized here), wire_bytes
        # (moved), full_bytes (a full sync of the wire form), source_bytes (the tensors as given), encodings
        self.last_sync: dict[str, Any] = {}

    # ---- lifecycle ----------------------------------------------------------------------------
    def init_info(self) -> dict[str, Any]:
        """The dict the sidecar's init_weight_transfer_engine takes, for the next connect().

        Each connect() consumes one: a re-init (after a failure, or to replace a healthy group) gets a
        fresh session id, so it never meets the store keys of an earlier group.
        """
        if self._store is None:
            self._store = master_store(self._host, self._port, self.num_receivers + 1, self.timeout_s)
        if self._next_info is None:
            self._next_info = InitInfo(self.backend, self._host, self._store.port, self.num_receivers + 1,
                                       self.bucket_bytes, float(self.timeout_s), new_session_id(),
                                       auth=new_session_secret(), delta=self.delta, send_fp8=self.send_fp8)
        return self._next_info.to_dict()

    def connect(self) -> None:
        """Join the group as rank 0; blocks until every receiver joined (TransferError on timeout).

        Replaces the current group, if any. A failed connect burns its session id too. On CUDA it
        compiles the digest kernel (seconds, once) while the receivers join.
        """
        if self._next_info is None:
            raise StateError("call init_info() and give it to the sidecar's init_weight_transfer_engine "
                             "before connect()")
        info, self._next_info = self._next_info, None
        self._called_off = None
        if self._group is not None:
            self._group.close()
            self._group = None
        self._end.new_session()
        if self.device.type != "cuda" or self._warmed:
            self._group = self._join(info)
            return
        with ThreadPoolExecutor(1, thread_name_prefix="sender-warm-up") as pool:  # compiles while they join
            warming = pool.submit(self._digests.warm_up, self.device)
            self._group = self._join(info)
        warming.result()  # a kernel that cannot build fails here, not in the first sync
        self._warmed = True

    def _join(self, info: InitInfo) -> TransferGroup:
        return TransferGroup(info, 0, self.device, store=self._store, label="sender", data_plane=self._end.data_plane,
                             cancelled=lambda: self._called_off)

    def call_off_connect(self, reason: str) -> None:
        """Make a connect() that waits for receivers fail now with TransferError(reason): the sidecar
        refused the init_info (SidecarClient.connect_sender calls it), so nobody will join. Thread-safe."""
        self._called_off = reason

    def close(self) -> None:
        if self._group is not None:
            self._group.close()
        self._group, self._next_info, self._store = None, None, None
        self._end.close()
        self._digests.close()
        self._expected.close()
        self.kept.close()

    @property
    def connected(self) -> bool:
        return self._group is not None and self._group.broken is None

    # ---- one sync -----------------------------------------------------------------------------
    def manifest(self, named_tensors: NamedTensors, version: int, *, fp8: bool | None = None) -> dict[str, Any]:
        """What the sidecar's start_weight_update takes: {"version", "tensors": [spec dicts in send order],
        "algorithm": the digest rule of this sync, "layout": the key that may stand for "tensors" once the
        receivers parsed them (inference/transfer/plan.py ManifestCache)}. The dicts are fresh each call.
        The rule (inference/transfer/digests.py): the device rule for CUDA tensors, the host rule for CPU
        tensors, unless `digest_algorithm` fixes one; every receiver knows it at start.
        `fp8`: this sync sends the FP8 payload (None: `send_fp8`); only for a model every rank holds in FP8
        (the sidecar's init answers which: trainer_hooks/sync.py), a rank refuses it otherwise."""
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise InvalidRequestError("version", f"must be an integer >= 0, got {version!r}")
        fp8 = self.send_fp8 if fp8 is None else bool(fp8)
        if fp8 and not self.send_fp8:
            raise InvalidRequestError("fp8", "this sender was made without send_fp8=True, so its session did not "
                                      "negotiate FP8 payloads and the ranks refuse them")
        items = _items(named_tensors)
        meta = [(name, t.dtype, t.shape, t.device) for name, t in items]
        if self._last_specs is None or meta != self._last_meta or fp8 != self._last_fp8:  # parse a layout once
            specs = tuple(TensorSpec.of(name, t) for name, t in items)
            if fp8:
                specs = tuple(payload_specs(specs))
            if self._last_specs is None or self._last_specs.specs != specs:
                self._last_specs = ParsedManifest(specs)
            self._last_meta, self._last_fp8 = meta, fp8
            self._picked = pick_algorithm(t for _, t in items)
        fixed = self.digest_algorithm
        algorithm = check_algorithm(fixed, "digest_algorithm") if fixed is not None else self._picked
        self._pending, self._algorithm = (version, self._last_specs, algorithm, fp8), algorithm
        return {"version": version, "tensors": [s.to_dict() for s in self._last_specs],
                "algorithm": algorithm, "layout": self._last_specs.layout_key}

    @property
    def algorithm(self) -> str | None:
        """The digest rule manifest() named last (None before the first call)."""
        return self._algorithm

    def send(self, named_tensors: NamedTensors, *, digest: bool = True,
             deliver_digests: bool = False, owner: str | None = None) -> list[TensorRecord]:
        """Move every byte to every receiver; returns the digests of the full tensors sent, in order
        (empty when digest=False). Returns only after every receiver reported success.

        `deliver_digests`: the receivers get the digests too, over the group, right after the bytes
        (inference/transfer/delivery.py), so each audits and commits in its update: the sidecar's
        update must say so (POST /weights/update "finish": true), else both ends stop at the plan
        agreement with nothing written.

        The digest starts before the plan agreement, while the receivers are still on their way to it:
        CUDA tensors in ONE kernel launch on a digest stream of the sender's own, ordered after the
        trainer's writes (it only reads, so it may run beside packing and the receivers' reads), CPU
        tensors on a side thread. It is collected while the receivers copy when this end only waits
        (ipc direct), else after the transfer. A CUDA tensor never goes through host memory to be hashed.

        `owner`: the nonce the sidecars' init answered (trainer_hooks/sync.py); receivers whose update has
        another owner refuse the plan agreement (groups.owner_key), so no byte of this send fills it."""
        group = self._require_group()
        if self._pending is None:
            raise StateError("send() before manifest(): the receivers need the manifest to start")
        if deliver_digests and not digest:
            raise InvalidRequestError("deliver_digests", "needs digest=True: there is nothing to deliver")
        version, specs, algorithm, fp8 = self._pending
        items = _items(named_tensors)
        source_bytes = sum(t.numel() * t.element_size() for _, t in items)
        problem: InvalidRequestError | None = None
        if fp8:  # quantized here, on the tensors' device: a refused tensor stops the sync at the agreement
            try:
                items = payload_tensors(items)
            except InvalidRequestError as e:
                problem = e
        tensors = [t for _, t in items]  # every reader (packer, exporter, digests) detaches on its own
        problem = problem or _mismatch(specs, items)
        # Started before the agreement: the receivers are still on their way to it (their start and update
        # requests), so the launch's host work and the kernel cost them nothing, and the kernel is done
        # before their copies compete for the GPU. A failure to start is raised after the status step,
        # so the receivers are never left waiting in it. The digests are always of the FULL tensors; the
        # slices that TP ranks hold of them, known after a delta's offer, follow then.
        digests, failure = None, None
        if digest and problem is None:
            try:
                digests = self._start_digests(items, specs.specs, algorithm)
            except Exception as e:
                failure = e
        delta: tuple[DeltaLayout, torch.Tensor] | None = None
        table: SliceTable | None = None
        if self.delta:
            try:
                delta, table, problem = self._offer(group, specs, tensors, problem, deliver_digests)
            except BaseException:
                _settle(digests)
                self.kept.forget()
                raise
        slice_digests = None
        if table is not None and table.distinct and digests is not None and problem is None:
            try:
                slice_digests = self._start_digests(*table.items(specs, tensors), algorithm)
            except Exception as e:
                failure = failure or e
        wire_specs, wire_tensors = (delta[0].wire_specs(), [delta[1]]) if delta is not None else (specs, tensors)
        keys, values = [0] * self._end.agreement_size[0], [0] * self._end.agreement_size[1]
        if problem is None:
            try:
                keys, values = self._end.prepare_send(wire_specs, wire_tensors)
            except InvalidRequestError as e:
                problem = e
            assert (len(keys), len(values)) == self._end.agreement_size, "every end adds the same to step 1"
        if self.device.type == "cuda":  # before the agreement: ipc receivers may read right after it
            torch.cuda.current_stream(self.device).synchronize()  # the trainer's writes have landed
        plan_id = self._end.plan_id() + (PLAN_SUFFIX if deliver_digests else "")
        fingerprint = wire_specs.fingerprint(version, self.bucket_bytes, plan_id)
        delivers = deliver_digests and self.check_installed and problem is None
        # one all-reduce (inference/transfer/receiver.py); 0 never matches: on a problem the receivers stop cleanly
        try:
            same, maxima = group.agree_many([0 if problem else fingerprint, owner_key(owner), *keys],
                                            [*values, *sender_values(delivers)])
        except BaseException:
            _settle(digests, slice_digests)
            self.kept.forget()
            raise
        if not same[0]:  # nothing was written anywhere: the ranks hold the base, the copy is past it
            self._end.withdraw()
            _settle(digests, slice_digests)
            self._forget_if(delta)
            raise problem or TransferError(
                "the receivers' plan differs from the sender's (a different manifest, version or bucket "
                "size was started on the sidecar, one end delivers the digests in the sync and the other "
                "does not expect them, or it runs another release of the backend); nothing was written")
        if not same[1]:  # after the plan: a receiver that refused its start passes 0 for both
            self._end.withdraw()
            _settle(digests, slice_digests)
            self._forget_if(delta)
            raise TransferError("the receivers' update belongs to another owner (the session nonce differs: "
                                "another trainer's init replaced this one's); nothing was written")
        # the ranks that install FP8 weights asked for their shares of the installed digests: computed beside
        # the wire, from the tensors as sent (quantized here on receive's behalf, the payload on send)
        layout = SharesLayout.agreed(specs, maxima[len(values):])
        expected = self._expected.start(layout, items, algorithm) if layout.size and digests is not None else None
        records: list[TensorRecord] | None = None
        if digests is not None and self._end.sends_by_waiting():
            # send() only waits while the receivers copy: collect the digests in that wait, not after it
            records, failure = _collect(digests, failure)
        try:
            self._end.send(group, self._end.plan(wire_specs), wire_tensors, same[2:])
        except BaseException:
            self.kept.forget()
            raise
        finally:
            if records is None and digests is not None:
                records, failure = _collect(digests, failure)
            if slice_digests is not None:  # after the full tensors' in the delivered list
                more, failure = _collect(slice_digests, failure)
                records = [*(records or []), *more]
            section, unexpected = _section(expected, layout)
        delivered = len(specs) + (len(table.distinct) if table is not None else 0)
        if deliver_digests:  # every receiver waits for this message once the status step passed
            send_digests(group, records if failure is None else None, delivered, section)
        failure = failure or unexpected  # only the ranks that asked for the section failed on it
        if failure is not None:
            self.kept.forget()
            raise failure
        self._pending = None
        self.last_sync = {"mode": "delta" if delta is not None else "full", "fp8": fp8,
                          "wire_bytes": sum(s.nbytes for s in wire_specs), "full_bytes": sum(s.nbytes for s in specs),
                          "source_bytes": source_bytes}
        if delta is not None:
            self.last_sync["encodings"] = delta[0].counts()
        if self.delta:  # every rank wrote it (the status step passed): the base of the next delta
            self.kept.commit(version, specs, tensors, delta)
        return (records or [])[:len(specs)]

    def _offer(self, group: TransferGroup, specs: ParsedManifest, tensors: list[torch.Tensor],
               problem: InvalidRequestError | None, deliver_digests: bool
               ) -> tuple[tuple[DeltaLayout, torch.Tensor] | None, SliceTable | None, InvalidRequestError | None]:
        """The delta offer (inference/transfer/delta.py): the delta to send, or None (full), the slices the
        ranks hold (None: every rank holds every tensor whole), and the problem that stops this sync at the
        plan agreement. Encoded only once every rank holds the base; an encode that fails still sends codes
        (none changed), so the receivers reach the agreement and stop there."""
        base = self.kept.base_for(specs) if problem is None else -1
        got = group.all_max(offer_values(base), "delta offer")
        if not offer_agreed(got):
            return None, None, problem
        receivers = group.info.world_size - 1
        delta, codes = None, [0] * (CODES * len(specs))
        try:
            with torch.no_grad():
                delta = self.kept.encode(specs, tensors)
            codes = delta[0].codes
        except Exception as e:
            self.kept.forget()  # the encode may have written part of the copy
            problem = InvalidRequestError("named_tensors", f"the delta could not be encoded: {e}")
        rows = [0] * (receivers * SLICE_CODES * len(specs)) if offer_slices(got) else []
        values = group.all_max(codes + rows, "delta codes")
        table = SliceTable.from_values(values[len(codes):], len(specs), receivers) if rows else None
        if table is not None and not deliver_digests:  # the ranks offer no base then: not reached
            problem = problem or InvalidRequestError("deliver_digests", "a delta into TP slices needs the digests "
                                                     "delivered in the sync")
        return delta, table, problem

    def _forget_if(self, delta: tuple[DeltaLayout, torch.Tensor] | None) -> None:
        """A sync that encoded a delta (the copy became the tensors) and then moved nothing: the ranks
        still hold the base, which the copy no longer is, so the next sync is full."""
        if delta is not None:
            self.kept.forget()

    def _start_digests(self, items: list[tuple[str, torch.Tensor]], specs: Sequence[TensorSpec],
                       algorithm: str) -> PendingRecords:
        """The digests of `items`, started as the bytes move (see the module docstring). `specs` describe
        `items` (send() checked them), so the records are named from them."""
        stream, after = None, None
        if self.device.type == "cuda":  # the launch uses it when the tensors are on self.device
            stream = self._digest_streams.get(self.device)
            if stream is None:
                stream = self._digest_streams[self.device] = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))  # after the trainer's last write
            after = self.device  # the host rule over CUDA tensors: its thread waits for that write too
        return self._digests.launch(items, algorithm, stream=stream, after=after, specs=specs)

    def _require_group(self) -> TransferGroup:
        if self._group is None:
            raise StateError("connect() first")
        if self._group.broken is not None:
            raise TransferError(f"the transfer group is broken ({self._group.broken}); call init_info() and "
                                "connect() again, and give the new init_info to the sidecar")
        return self._group


def _collect(digests: PendingRecords, failure: BaseException | None) -> tuple[list[TensorRecord], BaseException | None]:
    """The digests' records, or ([], the first failure): raised by send() after the status step."""
    try:
        return digests.result(), failure
    except Exception as e:
        return [], failure or e


def _section(expected: Future[bytes] | None, layout: SharesLayout) -> tuple[bytes, BaseException | None]:
    """The installed section of step 4, once its computation ended (it reads the caller's tensors), or a
    failed one and the computation's error (raised by send() after step 4)."""
    if not layout.size:
        return b"", None
    if expected is None:  # the sender's digests failed to start: the ranks fail on them already
        return failed_section(layout), None
    try:
        return expected.result(), None
    except Exception as e:
        return failed_section(layout), e


def _settle(*pending: PendingRecords | None) -> None:
    """No byte was sent: wait until the digests no longer read the caller's tensors."""
    for digests in pending:
        if digests is not None:
            digests.settle()


def _items(named_tensors: NamedTensors) -> list[tuple[str, torch.Tensor]]:
    pairs = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    return [(name, t) for name, t in pairs]


def _mismatch(specs: ParsedManifest, items: list[tuple[str, torch.Tensor]]) -> InvalidRequestError | None:
    """send() must get exactly the tensors manifest() described, in the same order."""
    if len(items) != len(specs):
        return InvalidRequestError("named_tensors", f"{len(items)} tensors given, the manifest has {len(specs)}")
    for spec, (name, t) in zip(specs, items):
        if name != spec.name or t.dtype != spec.torch_dtype or t.shape != spec.shape:
            got = TensorSpec(name, dtype_name(t.dtype), tuple(t.shape))
            return InvalidRequestError(name, f"differs from the manifest: {got} vs {spec}")
    return None
