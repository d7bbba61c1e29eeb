"""Per-rank manifests: which tensors a rank holds (or was sent), with their digests, as JSON.

A manifest is canonical: records sorted by name, names unique, every field validated on
construction. `to_json()` of a loaded canonical file gives the file back byte for byte. Loading never
lets a KeyError or TypeError escape: any problem is a ManifestError naming the source and field.
The format is documented in docs/checksums.md.
"""

from __future__ import annotations

import itertools
import json
import operator
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from checksum.definition import ALGORITHM, ALGORITHMS, RETIRED_ALGORITHMS
from checksum.digest import Digester, NamedTensors, TensorRecord, digest_tensors
from checksum.dtypes import DTYPES, alias_of
from checksum.errors import ManifestError

FORMAT = "sidecar-checksum-manifest"
FORMAT_VERSION = 1  # the JSON layout's version; what the digests mean is `algorithm`'s business
MODELS = ("target", "draft")
_RANK_RE = re.compile(r"dp(\d+):pp(\d+):tp(\d+)")
_DIGEST_RE = re.compile(r"[0-9a-f]{32}")
_KEYS = ("format", "format_version", "algorithm", "model", "weight_version", "rank", "tensors")
_TORN_KEYS = ("torn", "torn_reason")  # optional: present (both) only in the manifest of a torn model
_RECORD_KEYS = ("name", "dtype", "shape", "digest")


def rank_key(dp: int, pp: int, tp: int) -> str:
    """The rank key "dp{dp}:pp{pp}:tp{tp}" that names a rank in manifests and reports."""
    for label, value in (("dp", dp), ("pp", pp), ("tp", tp)):
        if not _is_int(value) or value < 0:
            raise ValueError(f"rank_key: {label} must be an integer >= 0, got {value!r}")
    return f"dp{dp}:pp{pp}:tp{tp}"


def parse_rank_key(key: str) -> tuple[int, int, int]:
    """(dp, pp, tp) of a rank key; ValueError if it is not of the form "dp0:pp0:tp0"."""
    match = _RANK_RE.fullmatch(key) if isinstance(key, str) else None
    if match is None:
        raise ValueError(f"not a rank key of the form 'dp0:pp0:tp0': {key!r}")
    dp, pp, tp = (int(g) for g in match.groups())
    return dp, pp, tp


@dataclass(frozen=True)
class Manifest:
    """One rank's digests of one model at one weight version. Records end up sorted by name."""

    model: str
    weight_version: int
    rank: str
    records: tuple[TensorRecord, ...]
    algorithm: str = ALGORITHM
    format_version: int = FORMAT_VERSION
    # Set when the rank's model is torn (a sync failed or was abandoned after its first byte may have
    # been written): these bytes are then NOT `weight_version` (the last good version), and any audit
    # of the manifest fails with a "torn" mismatch, whatever its digests say.
    torn_reason: str | None = None

    def __post_init__(self) -> None:
        _check_header("<manifest>", self.format_version, self.algorithm, self.model,
                      self.weight_version, self.rank)
        if self.torn_reason is not None and (not isinstance(self.torn_reason, str) or not self.torn_reason):
            raise ManifestError("<manifest>", "torn_reason", f"must be a non-empty string, got {self.torn_reason!r}")
        if not isinstance(self.records, (tuple, list)):
            raise ManifestError("<manifest>", "records", f"must be a tuple of TensorRecords, got "
                                f"{_json_type(self.records)}")
        if not _records_valid(self.records):  # the common case, decided in bulk; else find the culprit
            for i, record in enumerate(self.records):
                if not isinstance(record, TensorRecord):
                    raise ManifestError("<manifest>", f"records[{i}]", f"must be a TensorRecord, got {record!r}")
                _check_record("<manifest>", f"records[{i}]", record)
        records = tuple(sorted(self.records, key=_NAME))
        object.__setattr__(self, "records", records)
        if len(set(map(_NAME, records))) != len(records):
            _check_unique("<manifest>", [(f"records[{i}]", r.name) for i, r in enumerate(records)])

    def by_name(self) -> dict[str, TensorRecord]:
        return {r.name: r for r in self.records}

    @property
    def torn(self) -> bool:
        return self.torn_reason is not None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "format": FORMAT,
            "format_version": self.format_version,
            "algorithm": self.algorithm,
            "model": self.model,
            "weight_version": self.weight_version,
            "rank": self.rank,
        }
        if self.torn:  # only a torn model's manifest carries the keys: a good one's file is unchanged
            out.update(torn=True, torn_reason=self.torn_reason)
        out["tensors"] = [{"name": r.name, "dtype": r.dtype, "shape": list(r.shape), "digest": r.digest}
                          for r in self.records]
        return out

    def to_json(self) -> str:
        """Canonical text: fixed key order, one tensor per line (diff-friendly), trailing newline."""
        data = self.to_dict()
        tensors = data.pop("tensors")
        lines = [f"  {json.dumps(k)}: {json.dumps(v)}," for k, v in data.items()]
        if tensors:
            rows = ",\n".join(f"    {json.dumps(t)}" for t in tensors)
            lines.append(f'  "tensors": [\n{rows}\n  ]')
        else:
            lines.append('  "tensors": []')
        return "{\n" + "\n".join(lines) + "\n}\n"

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json(), encoding="utf-8")

    @classmethod
    def from_dict(cls, data: object, source: str = "<dict>") -> Manifest:
        """Validate a parsed JSON object; ManifestError names `source` and the first bad field."""
        if not isinstance(data, dict):
            raise ManifestError(source, "<root>", f"expected a JSON object, got {_json_type(data)}")
        for key in data:
            if key not in _KEYS and key not in _TORN_KEYS:
                raise ManifestError(source, str(key), f"unknown field (known: {', '.join(_KEYS + _TORN_KEYS)})")
        for key in _KEYS:
            if key not in data:
                raise ManifestError(source, key, "missing field")
        if data["format"] != FORMAT:
            raise ManifestError(source, "format", f"expected {FORMAT!r}, got {data['format']!r}")
        _check_header(source, data["format_version"], data["algorithm"], data["model"],
                      data["weight_version"], data["rank"])
        records = _records_from_json(source, data["tensors"])
        torn_reason = _torn_reason(source, data)
        return cls(data["model"], data["weight_version"], data["rank"], records,
                   data["algorithm"], data["format_version"], torn_reason)

    @classmethod
    def from_json(cls, text: str, source: str = "<string>") -> Manifest:
        return cls.from_dict(_parse_json(text, source), source)

    @classmethod
    def load(cls, path: str | Path) -> Manifest:
        """Read one manifest (a file holding a list of several is an error here: use load_manifests)."""
        data = _parse_json(_read(path), str(path))
        if isinstance(data, list):
            raise ManifestError(str(path), "<root>", f"holds a list of {len(data)} manifests, expected one")
        return cls.from_dict(data, str(path))


def load_manifests(path: str | Path) -> list[Manifest]:
    """Every manifest in a file: a single JSON object, a JSON list of them (one per rank), or a sidecar's
    GET /checksums answer saved as it came ({"model", "source", "manifests": [...]})."""
    source = str(path)
    data = _parse_json(_read(path), source)
    if isinstance(data, dict) and "manifests" in data and "format" not in data:
        if not isinstance(data["manifests"], list):
            raise ManifestError(source, "manifests", f"expected a list, got {_json_type(data['manifests'])}")
        data, source = data["manifests"], f"{source}: manifests"
    if not isinstance(data, list):
        return [Manifest.from_dict(data, source)]
    if not data:
        raise ManifestError(source, "<root>", "empty list: expected at least one manifest")
    return [Manifest.from_dict(item, f"{source}[{i}]") for i, item in enumerate(data)]


def manifests_to_json(manifests: Sequence[Manifest]) -> str:
    """A JSON list of manifests (the multi-rank file format), each in its canonical layout."""
    bodies = ["  " + m.to_json().rstrip("\n").replace("\n", "\n  ") for m in manifests]
    return "[\n" + ",\n".join(bodies) + "\n]\n"


def save_manifests(path: str | Path, manifests: Sequence[Manifest]) -> None:
    Path(path).write_text(manifests_to_json(manifests), encoding="utf-8")


def manifest_from_tensors(
    named_tensors: NamedTensors,
    *,
    model: str,
    weight_version: int,
    rank: str,
    digester: Digester | None = None,
    algorithm: str = ALGORITHM,
) -> Manifest:
    """Digest a state dict (or (name, tensor) pairs) into a manifest by `algorithm`, which the
    manifest names; names must be unique."""
    if digester is not None:
        records = digester.digest(named_tensors, algorithm=algorithm)
    else:
        records = digest_tensors(named_tensors, algorithm=algorithm)
    return Manifest(model, weight_version, rank, tuple(records), algorithm)


# -- validation ---------------------------------------------------------------------------------


MAX_FILE_BYTES = 1 << 28  # ~1.5M tensors. records: a bound, so /dev/zero or a FIFO cannot be read forever


def _read(path: str | Path) -> str:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
        if len(data) > MAX_FILE_BYTES:
            raise ManifestError(str(path), "<file>", f"larger than {MAX_FILE_BYTES} bytes: not a manifest file")
        return data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ManifestError(str(path), "<file>", f"cannot read: {reason}") from exc


def _parse_json(text: str, source: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ManifestError(source, "<json>", f"invalid JSON at line {exc.lineno} column {exc.colno}: "
                            f"{exc.msg}") from None
    except RecursionError:
        raise ManifestError(source, "<json>", "nests too deeply: a manifest is an object of tensor records") from None


def _check_header(source: str, format_version: object, algorithm: object, model: object,
                  weight_version: object, rank: object) -> None:
    if not _is_int(format_version):
        raise ManifestError(source, "format_version", f"must be an integer, got {_json_type(format_version)}")
    if format_version != FORMAT_VERSION:
        raise ManifestError(source, "format_version", f"unsupported version {format_version} "
                            f"(this reader knows {FORMAT_VERSION})")
    supported = ", ".join(map(repr, ALGORITHMS))
    if isinstance(algorithm, str) and algorithm in RETIRED_ALGORITHMS:
        raise ManifestError(source, "algorithm", f"{algorithm!r} is no longer supported: it is "
                            f"{RETIRED_ALGORITHMS[algorithm]} (this reader reads {supported})")
    if not isinstance(algorithm, str) or algorithm not in ALGORITHMS:
        raise ManifestError(source, "algorithm", f"unknown algorithm {algorithm!r} (supported: {supported})")
    if model not in MODELS:
        raise ManifestError(source, "model", f"must be one of {', '.join(map(repr, MODELS))}, got {model!r}")
    if not _is_int(weight_version) or weight_version < 0:
        raise ManifestError(source, "weight_version", f"must be an integer >= 0, got {weight_version!r}")
    if not isinstance(rank, str) or _RANK_RE.fullmatch(rank) is None:
        raise ManifestError(source, "rank", f"must be a rank key like 'dp0:pp0:tp0', got {rank!r}")


def _torn_reason(source: str, data: dict) -> str | None:
    """The torn reason of a parsed manifest: "torn" must be true and come with a non-empty reason."""
    if "torn" not in data and "torn_reason" not in data:
        return None
    if data.get("torn") is not True:
        raise ManifestError(source, "torn", f"must be true when present (with torn_reason), got {data.get('torn')!r}")
    reason = data.get("torn_reason")
    if not isinstance(reason, str) or not reason:
        raise ManifestError(source, "torn_reason", f"must be a non-empty string with torn: true, got {reason!r}")
    return reason


def _records_from_json(source: str, tensors: object) -> list[TensorRecord]:
    if not isinstance(tensors, list):
        raise ManifestError(source, "tensors", f"must be a list, got {_json_type(tensors)}")
    records = []
    for i, item in enumerate(tensors):
        where = f"tensors[{i}]"
        if not isinstance(item, dict):
            raise ManifestError(source, where, f"must be an object, got {_json_type(item)}")
        for key in item:
            if key not in _RECORD_KEYS:
                known = ", ".join(_RECORD_KEYS)
                raise ManifestError(source, f"{where}.{key}", f"unknown field (known: {known})")
        for key in _RECORD_KEYS:
            if key not in item:
                raise ManifestError(source, f"{where}.{key}", "missing field")
        shape = item["shape"]
        if not isinstance(shape, list) or not all(_is_int(s) for s in shape):
            raise ManifestError(source, f"{where}.shape", f"must be a list of integers, got {shape!r}")
        record = TensorRecord(item["name"], item["dtype"], tuple(shape), item["digest"])
        _check_record(source, where, record)
        records.append(record)
    if len({r.name for r in records}) != len(records):
        _check_unique(source, [(f"tensors[{i}]", r.name) for i, r in enumerate(records)])
    return records


_NAME = operator.attrgetter("name")
_FIELDS = operator.attrgetter("name", "dtype", "shape", "digest")
_DIGESTS_RE = re.compile(r"(?:[0-9a-f]{32})*")


def _records_valid(records: Sequence[object]) -> bool:
    """Whether every record passes `_check_record`'s fast test, decided with C-level passes over all of
    them (a manifest of hundreds of records is built several times a sync). False: check one by one."""
    if set(map(type, records)) - {TensorRecord}:
        return False
    names, dtypes, shapes, digests = zip(*map(_FIELDS, records)) if records else ((), (), (), ())
    if set(map(type, names)) - {str} or not all(names) or not all(map(str.isascii, names)):
        return False  # a non-ASCII name is checked one by one (a lone surrogate)
    if set(map(type, dtypes)) - {str} or not DTYPES.keys() >= set(dtypes):
        return False
    dims = list(itertools.chain.from_iterable(shapes)) if not set(map(type, shapes)) - {tuple} else None
    if dims is None or set(map(type, dims)) - {int} or min(dims, default=0) < 0:
        return False
    return (not set(map(type, digests)) - {str} and not set(map(len, digests)) - {32}
            and _DIGESTS_RE.fullmatch("".join(digests)) is not None)


def _is_unicode(text: str) -> bool:
    """No lone surrogate (JSON's unpaired \\ud800 escapes): such a name can be neither printed nor saved."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_record(source: str, where: str, record: TensorRecord) -> None:
    name, dtype, shape, digest = record.name, record.dtype, record.shape, record.digest
    # type(dtype) before membership: a list or dict as a dtype is unhashable (a TypeError, not a ManifestError)
    if (type(name) is str and name and (name.isascii() or _is_unicode(name)) and type(dtype) is str
            and dtype in DTYPES and type(shape) is tuple
            and all(type(s) is int and s >= 0 for s in shape)
            and type(digest) is str and _DIGEST_RE.fullmatch(digest) is not None):
        return  # the common case, decided without building a message
    _check_record_fully(source, where, record)


def _check_record_fully(source: str, where: str, record: TensorRecord) -> None:
    if not isinstance(record.name, str) or not record.name:
        raise ManifestError(source, f"{where}.name", f"must be a non-empty string, got {record.name!r}")
    if not _is_unicode(record.name):
        raise ManifestError(source, f"{where}.name", f"is not valid Unicode (a lone surrogate): {record.name!r}")
    # one spelling per dtype (DTYPES' names), so comparing strings is exact
    if not isinstance(record.dtype, str) or record.dtype not in DTYPES:
        canonical = alias_of(record.dtype)
        problem = (f"write {canonical!r}, not the alias {record.dtype!r}" if canonical is not None
                   else f"unknown dtype {record.dtype!r}")
        raise ManifestError(source, f"{where}.dtype", f"{problem} (tensor {record.name!r})")
    if not isinstance(record.shape, tuple) or not all(_is_int(s) and s >= 0 for s in record.shape):
        raise ManifestError(source, f"{where}.shape", f"must be non-negative integers, got {record.shape!r} "
                            f"(tensor {record.name!r})")
    if not isinstance(record.digest, str) or _DIGEST_RE.fullmatch(record.digest) is None:
        raise ManifestError(source, f"{where}.digest", f"must be 32 lowercase hex digits, got "
                            f"{record.digest!r} (tensor {record.name!r})")


def _check_unique(source: str, names: list[tuple[str, str]]) -> None:
    seen: dict[str, str] = {}
    for where, name in names:
        if name in seen:
            raise ManifestError(source, f"{where}.name", f"duplicate tensor name {name!r} "
                                f"(also {seen[name]})")
        seen[name] = where


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _json_type(value: object) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}
    if _is_int(value) or isinstance(value, float):
        return "a number"
    return names.get(type(value), type(value).__name__)
