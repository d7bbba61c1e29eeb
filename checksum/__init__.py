"""Checksums of model weights: tensor digests, per-rank manifests, comparison reports.

A leaf package: it imports torch, xxhash and the standard library only (never inference/,
sidecar/ or trainer_hooks/; Triton only on the first device digest). The digest and manifest formats
are specified in docs/checksums.md. Two digest rules: ALGORITHM (the default, host-hashed) and
DEVICE_ALGORITHM (hashed on the GPU where the tensors are); `pick_algorithm(tensors)` chooses.
"""

from __future__ import annotations

from checksum.compare import KINDS, ChecksumMismatch, Mismatch, Report, audit, compare, compare_each, compare_ranks
from checksum.definition import ALGORITHM, ALGORITHMS, DEVICE_ALGORITHM, SEGMENT_BYTES, digest_bytes
from checksum.device_digest import DeviceDigester, KernelConfig, PendingDigests, can_hash_on, pick_algorithm
from checksum.digest import DEFAULT_CHUNK_BYTES, Digester, TensorRecord, digest_tensor, digest_tensors
from checksum.dtypes import DTYPES, ITEMSIZE, UnknownDtypeError, dtype_from_name, dtype_name
from checksum.errors import ChecksumError, ManifestError
from checksum.manifest import (
    FORMAT_VERSION,
    Manifest,
    load_manifests,
    manifest_from_tensors,
    manifests_to_json,
    parse_rank_key,
    rank_key,
    save_manifests,
)
from checksum.tensor_bytes import flat_bytes

__all__ = [
    "ALGORITHM",
    "ALGORITHMS",
    "DEFAULT_CHUNK_BYTES",
    "DEVICE_ALGORITHM",
    "DTYPES",
    "FORMAT_VERSION",
    "ITEMSIZE",
    "KINDS",
    "SEGMENT_BYTES",
    "ChecksumError",
    "ChecksumMismatch",
    "DeviceDigester",
    "Digester",
    "KernelConfig",
    "Manifest",
    "ManifestError",
    "Mismatch",
    "PendingDigests",
    "Report",
    "TensorRecord",
    "UnknownDtypeError",
    "audit",
    "can_hash_on",
    "compare",
    "compare_each",
    "compare_ranks",
    "digest_bytes",
    "digest_tensor",
    "digest_tensors",
    "dtype_from_name",
    "dtype_name",
    "flat_bytes",
    "load_manifests",
    "manifest_from_tensors",
    "manifests_to_json",
    "parse_rank_key",
    "pick_algorithm",
    "rank_key",
    "save_manifests",
]
