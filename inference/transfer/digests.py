"""The digests of a sync on both ends of the wire: which rule, and digests started where the bytes are.

The SENDER picks the rule of a sync (checksum.pick_algorithm over its tensors, i.e. the device rule for
tensors on a GPU and the host rule for CPU tensors, unless its owner fixed one) and states it in the start
manifest (`"algorithm"`) and with its finish digests; every receiving rank digests what it holds under
that rule, on whatever device it has (a CPU rank computes the device rule on the host).

`RecordDigests.launch(items, algorithm)` starts the digests of (name, tensor) pairs and returns at once:
- DEVICE_ALGORITHM over tensors of one device the kernel can hash: ONE kernel launch (checksum's
  DeviceDigester) on the given stream, or the current one, after whatever was queued there; only 8 bytes
  per 64 KiB come back, and nothing waits until `PendingRecords.result()`. No byte goes through host memory.
- anything else (the host rule, CPU tensors, tensors of several devices): checksum.digest_tensors on this
  owner's side thread, after the work queued so far on the current stream of `after` (a CUDA device) when given.
The tensors must stay alive and unchanged until `result()` (or `settle()`) returned. One RecordDigests
per owner (a WeightSender, a Worker), launching from one thread at a time.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import torch

from checksum import (
    ALGORITHM,
    ALGORITHMS,
    DEVICE_ALGORITHM,
    DeviceDigester,
    Manifest,
    ManifestError,
    PendingDigests,
    TensorRecord,
    can_hash_on,
    digest_tensors,
    dtype_name,
)
from inference.core import InvalidRequestError
from inference.transfer.plan import TensorSpec

log = logging.getLogger(__name__)

NamedTensorList = Sequence[tuple[str, torch.Tensor]]
_SPEC_FIELDS = operator.attrgetter("name", "dtype", "shape")
_DIGEST = operator.attrgetter("digest")
_TENSOR = operator.itemgetter(1)
_DEVICE = operator.attrgetter("device")
# Segment counts whose kernel variants Triton compiles apart (it specializes an int argument on == 1 and
# on divisibility by 16): one launch of each at warm-up, so no sync pays a compile.
_WARM_SEGMENTS = (1, 2, 16)


def check_algorithm(value: object, where: str = "algorithm") -> str:
    """`value` if it names a digest rule; InvalidRequestError naming `where` and the supported rules."""
    if isinstance(value, str) and value in ALGORITHMS:
        return value
    raise InvalidRequestError(where, f"unknown checksum algorithm {value!r} (supported: "
                              f"{', '.join(map(repr, ALGORITHMS))})")


def manifest_algorithm(manifest: object, where: str = "manifest") -> str:
    """The rule a start manifest (or finish digests dict) names; ALGORITHM when it names none (what a
    sender from before the field digested with)."""
    if isinstance(manifest, dict) and manifest.get("algorithm") is not None:
        return check_algorithm(manifest["algorithm"], f"{where}.algorithm")
    return ALGORITHM


def kernel_device(items: NamedTensorList, algorithm: str) -> torch.device | None:
    """The one device whose kernel hashes `items` under `algorithm`, or None (they go to the host path)."""
    if algorithm != DEVICE_ALGORITHM or not items:
        return None
    devices = set(map(_DEVICE, map(_TENSOR, items)))
    if len(devices) != 1:
        return None
    device = devices.pop()
    return device if can_hash_on(device) else None


class PendingRecords:
    """Digests in flight (one device launch, or a host future); `result()` gives the records in input order.
    `specs`: what each record names (name, dtype, shape), one per item, e.g. the manifest's TensorSpecs."""

    def __init__(self, specs: Sequence[TensorSpec] | None, device: PendingDigests | None = None,
                 host: Future[list[TensorRecord]] | None = None) -> None:
        assert (device is None) != (host is None), "one launch or one future"
        assert device is None or specs is not None, "a device launch needs its records' specs"
        self._specs, self._device, self._host = specs, device, host

    @property
    def on_device(self) -> bool:
        """A kernel launch (done within a kernel's time of its stream's work), not a host thread's hashing."""
        return self._device is not None

    def result(self) -> list[TensorRecord]:
        if self._host is not None:
            return self._host.result()
        assert self._device is not None and self._specs is not None
        return _records(self._specs, self._device.result())

    def settle(self) -> None:
        """Wait until nothing reads the tensors any more; the outcome (even an error) is left for result()."""
        if self._host is not None:
            wait([self._host])
        else:
            assert self._device is not None
            try:
                self._device.result()
            except Exception:  # reading is over either way; result() raises it again for whoever asks
                log.debug("a settled device digest failed", exc_info=True)


class RecordDigests:
    """One owner's digests (see the module docstring). Its DeviceDigester keeps the segment tables of the
    layouts it saw (a sync's tensors keep their addresses, so each later launch finds its table) and is
    not thread-safe, so an owner launches from one thread at a time."""

    def __init__(self, thread_name: str) -> None:
        self._thread_name = thread_name
        self._pool: ThreadPoolExecutor | None = None
        self._device = DeviceDigester()

    def launch(self, items: NamedTensorList, algorithm: str, *, stream: Any = None,
               after: torch.device | None = None,
               specs: Sequence[TensorSpec] | None = None) -> PendingRecords:
        """Start digesting `items` under `algorithm`; see the module docstring for where each runs.
        `stream`: the CUDA stream of a device launch on its device (default: the current one); `after`:
        a CUDA device whose current stream's queued work the host path waits for before reading (an
        event is recorded there now; a device launch is ordered by its stream instead); `specs`: each
        item's (name, dtype, shape) when the caller holds them already (its manifest's), which spares
        reading them off the tensors every sync (host time, per tensor)."""
        items = list(items)
        device = kernel_device(items, algorithm)
        if device is None:
            written = None
            if after is not None and after.type == "cuda":
                written = torch.cuda.Event()
                written.record(torch.cuda.current_stream(after))
            return PendingRecords(None, host=self._executor().submit(_host_records, items, algorithm, written))
        if specs is None:
            specs = [TensorSpec(name, dtype_name(t.dtype), tuple(t.shape)) for name, t in items]
        assert len(specs) == len(items), (len(specs), len(items))
        tensors = list(map(_TENSOR, items))  # the kernel reads addresses only: no detach needed
        if device.type == "cuda" and stream is not None and stream.device == device:
            with torch.cuda.stream(stream):
                return PendingRecords(specs, device=self._device.launch(tensors, device))
        return PendingRecords(specs, device=self._device.launch(tensors, device))

    def digest(self, items: NamedTensorList, algorithm: str) -> list[TensorRecord]:
        """The records of `items` now (a device launch waited for, or the host path on this thread)."""
        items = list(items)
        if kernel_device(items, algorithm) is None:
            return digest_tensors(items, algorithm=algorithm)
        return self.launch(items, algorithm).result()

    def warm_up(self, device: torch.device) -> None:
        """Compile the kernel's variants for `device` (seconds the first time) so no sync pays for it."""
        if not can_hash_on(device):
            return
        sizes = [n * (64 << 10) for n in _WARM_SEGMENTS]
        buf = torch.zeros(sum(sizes), dtype=torch.uint8, device=device)
        offset = 0
        for n in sizes:
            self._device.digest([buf[offset : offset + n]])
            offset += n
        self._device.clear()  # the scratch layouts are of no later use

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._device.clear()

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix=self._thread_name)
        return self._pool


def _host_records(items: NamedTensorList, algorithm: str, written: Any) -> list[TensorRecord]:
    if written is not None:
        written.synchronize()
    return digest_tensors(items, algorithm=algorithm)


def expected_manifest(sender_digests: Any, *, which: str, version: int, rank: str, specs: Sequence[TensorSpec],
                      algorithm: str) -> Manifest:
    """The sender's finish digests as one rank's expectation. Accepted: a Manifest; records (TensorRecords
    or their dicts); {"tensors": records}; {"digests": [one hex digest per manifest tensor, in manifest
    order]} (names, dtypes and shapes are then the manifest's: the sender checks what it sends against
    them). A dict may name its "algorithm"; otherwise they are taken to be of `algorithm` (the session's).
    InvalidRequestError naming the field when malformed."""
    if isinstance(sender_digests, Manifest):
        return _manifest(which, version, rank, sender_digests.records, sender_digests.algorithm)
    if isinstance(sender_digests, dict):
        algorithm = manifest_algorithm({"algorithm": sender_digests.get("algorithm", algorithm)}, "sender_digests")
        if "digests" in sender_digests:
            return _manifest(which, version, rank, _records_in_order(sender_digests["digests"], specs), algorithm)
    items = sender_digests.get("tensors") if isinstance(sender_digests, dict) else sender_digests
    return _manifest(which, version, rank, sender_records(items, "sender_digests"), algorithm)


def plain_digests(sender_digests: Any, algorithm: str, n: int) -> list[str] | None:
    """The sender's digest list when it sent the plain form ({"digests": [n strings]}, of `algorithm`),
    else None. Nothing is validated here: a list only ever stands for a Manifest after
    `digests_match` found it equal to validated records; otherwise expected_manifest judges it."""
    if not isinstance(sender_digests, dict) or set(sender_digests) - {"digests", "algorithm"}:
        return None
    digests = sender_digests.get("digests")
    if sender_digests.get("algorithm", algorithm) != algorithm or type(digests) is not list or len(digests) != n:
        return None
    return digests


def digests_match(digests: Sequence[str], specs: Sequence[TensorSpec], records: Sequence[TensorRecord]) -> bool:
    """Whether `records` (one per spec, in spec order) are exactly the records expected_manifest would
    build from `digests` and `specs`, in C-level passes; False sends the caller to the full compare (which
    names each differing tensor), so a False here is never wrong, only slower."""
    return (list(map(_DIGEST, records)) == digests
            and list(map(_SPEC_FIELDS, records)) == list(map(_SPEC_FIELDS, specs)))


def sender_records(items: object, where: str) -> list[TensorRecord]:
    """The sender's records (TensorRecords, or their JSON dicts: name, dtype, shape, digest), as the one
    parser of them (a rank's finish, and the sidecar's POST /audit `expected`). Values are checked by
    the Manifest that holds them; InvalidRequestError naming `where` (and the index) when malformed."""
    if not isinstance(items, (list, tuple)):
        raise InvalidRequestError(where, f"must be a list of records, got {type(items).__name__}")
    records = []
    for i, r in enumerate(items):
        if isinstance(r, TensorRecord):
            records.append(r)
        elif isinstance(r, dict) and {"name", "dtype", "shape", "digest"} <= set(r):
            shape = tuple(r["shape"]) if isinstance(r["shape"], (list, tuple)) else r["shape"]
            records.append(TensorRecord(r["name"], r["dtype"], shape, r["digest"]))
        else:
            raise InvalidRequestError(f"{where}[{i}]", "a record needs name, dtype, shape and digest")
    return records


def _records_in_order(digests: Any, specs: Sequence[TensorSpec]) -> list[TensorRecord]:
    if not isinstance(digests, (list, tuple)) or len(digests) != len(specs):
        got = f"{len(digests)} digests" if isinstance(digests, (list, tuple)) else type(digests).__name__
        raise InvalidRequestError("sender_digests.digests", f"must be one digest per manifest tensor "
                                  f"({len(specs)}), got {got}")
    return _records(specs, digests)


def _records(specs: Sequence[TensorSpec], digests: Sequence[str]) -> list[TensorRecord]:
    """One record per (spec, digest), built in C-level passes (hundreds per sync on each end)."""
    assert len(specs) == len(digests), (len(specs), len(digests))
    names, dtypes, shapes = zip(*map(_SPEC_FIELDS, specs)) if specs else ((), (), ())
    return list(map(TensorRecord, names, dtypes, shapes, digests))


def _manifest(which: str, version: int, rank: str, records: Sequence[TensorRecord], algorithm: str) -> Manifest:
    try:
        return Manifest(which, version, rank, tuple(records), algorithm)
    except ManifestError as e:
        raise InvalidRequestError("sender_digests", str(e)) from e
