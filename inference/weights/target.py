"""The receiving model of one update session: manifest validation, unpacking, received digests.

`validate_manifest` checks the WHOLE manifest against the model before any byte moves: unknown
names, wrong shapes, wrong dtypes (unless casting is allowed), duplicates, missing tensors. A tied
`lm_head.weight` sent alongside the embedding is accepted but never loaded (it IS the embedding);
the audit requires its digest to equal the embedding's. Rotary tables are accepted and ignored.

`UpdateTarget` is the receiver's sink (`Sink` in inference/transfer/backends/base.py): it loads each
completed tensor through the naming module and the parameters' weight_loaders (TP slicing, fused
qkv/gate_up, casts), and keeps the digests of what arrived (full tensors, trainer names), under the
sync's digest rule (`algorithm`, named by the sender in the start manifest).

Decision (one hashing pass at TP=1): when this rank holds a tensor whole, in the sent dtype (TP=1,
no cast), its received digest is computed after the sync from the held parameter region it was
written to (the q rows of qkv_proj ARE the received q_proj tensor). That digest covers the wire,
the unpack and the placement at once, and costs no hashing while bytes are in flight. Every other
tensor (TP shards, casts, skipped names) is digested from the received bytes before its buffer is
reused. A delta sync (inference/transfer/delta.py) writes each tensor's region in place instead
(`delta_regions`: at TP > 1 the part this rank holds, from the parameter's `held_part`), and its audit
digests those regions: a TP shard as the slice of the full tensor it is (its shape in the records).

An FP8 linear's tensors (EngineConfig.quantization) are received in the model dtype and go through
weights/installed.py: quantized on the device as they land, installed, and audited a second time as held.
A sender that quantizes on send (inference/transfer/fp8_payload.py) sends `name:fp8` and `name:scale`
instead: each is routed to its FP8 layer's region, written as received (TP=1: a direct copy, digested
where held) or as this rank's slice of it; a model not in FP8 refuses them, naming the tensor.
A model served with a LoRA adapter (inference/models/lora_adapter.py) also takes its adapter tensors
(`<module>.lora_A.weight`, `<module>.lora_B.weight`): a manifest holds the base, the adapter, or both,
each whole. Each rank takes its slice of a full adapter tensor as of a base tensor (an AdapterTensor
says which); one it holds whole, in the sent dtype, is audited from where it is held, a slice from the
received bytes, so every rank's received digests are of the full tensors the sender digested.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from checksum import ALGORITHM, Manifest, Mismatch, Report, TensorRecord, digest_tensors, dtype_name
from inference.config import ModelConfig
from inference.core import InvalidRequestError
from inference.layers.lora import AdapterTensor
from inference.models.loader import load_hf_tensor
from inference.models.lora_adapter import adapter_regions
from inference.models.naming import (
    ShardId,
    expected_hf_tensors,
    expected_wire_tensors,
    hf_to_param,
    is_skipped,
    lora_base_name,
    param_to_hf,
)
from inference.quant.installed import FP8_SUFFIX, SCALE_SUFFIX, installed_part, is_fp8_linear
from inference.transfer.delta import Regions
from inference.transfer.delta_codec import Slice
from inference.transfer.fp8_payload import FP8_NAME, SCALE_DTYPE
from inference.transfer.ipc import copy_pairs
from inference.transfer.plan import TensorSpec
from inference.weights.installed import InstalledAudit, fp8_layers

EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"


@dataclass(frozen=True)
class Route:
    """Where one manifest tensor goes. param None: accepted but not loaded (tied lm_head, rotary)."""

    spec: TensorSpec
    param: str | None
    shard_id: ShardId
    held: torch.Tensor | None  # the exact region it fills when held whole in the sent dtype, else None
    sink: AdapterTensor | None = None  # an adapter tensor's place on this rank (its slice, cast if allowed)
    part: str | None = None  # an FP8 payload tensor (quantized on send): "fp8" (values) or "scale"
    tp_part: tuple[torch.Tensor, Slice | None] | None = None  # TP > 1: the region this rank holds, which part

    @property
    def delta_region(self) -> tuple[torch.Tensor, Slice | None] | None:
        """Where a delta writes this tensor on this rank (the whole held region, or a TP part), or None."""
        return (self.held, None) if self.held is not None else self.tp_part

    @property
    def adapter(self) -> bool:
        return self.sink is not None


@dataclass(frozen=True)
class Routing:
    """A validated manifest's routes and what every session re-uses while the model is unchanged:
    the parameters by name, and per manifest index the region a direct copy may write (or None)."""

    routes: tuple[Route, ...]
    params: dict[str, nn.Parameter]
    destinations: tuple[torch.Tensor | None, ...]
    fp8_layers: dict[str, nn.Module] = field(default_factory=dict)  # installed.fp8_layers of the model


def route_manifest(specs: Sequence[TensorSpec], model: nn.Module, config: ModelConfig, *, which: str,
                   rank: str, tp_size: int, allow_cast: bool) -> Routing:
    """validate_manifest, packaged for reuse across sessions (see Routing)."""
    params, layers = dict(model.named_parameters()), fp8_layers(model)
    routes = tuple(validate_manifest(specs, model, config, which=which, rank=rank, tp_size=tp_size,
                                     allow_cast=allow_cast, params=params, layers=layers))
    return Routing(routes, params, tuple(r.held for r in routes), layers)


def validate_manifest(specs: Sequence[TensorSpec], model: nn.Module, config: ModelConfig, *, which: str,
                      rank: str, tp_size: int, allow_cast: bool,
                      params: dict[str, nn.Parameter] | None = None,
                      layers: dict[str, nn.Module] | None = None) -> list[Route]:
    """Routes for every spec, or InvalidRequestError naming the first bad tensor and this rank."""
    params = dict(model.named_parameters()) if params is None else params
    layers = fp8_layers(model) if layers is None else layers
    parts = {s.name: installed_part(s.name) for s in specs}
    expected = expected_wire_tensors(config, [p[0] if p else name for name, p in parts.items()])
    adapter = adapter_regions(model)
    seen: set[str] = set()
    payload: dict[str, set[str]] = {}  # HF name -> the parts of its FP8 payload in the manifest
    routes = []
    for spec in specs:
        part = parts[spec.name]
        if spec.name in seen or (part is None and spec.name in payload) or (part is not None and part[0] in seen):
            raise InvalidRequestError(spec.name, f"rank {rank}: sent twice in the {which} manifest (whole or as "
                                      "an FP8 payload)")
        seen.add(spec.name)
        if part is not None:
            routes.append(_payload_route(spec, *part, params, layers, config, expected, which=which, rank=rank,
                                         tp_size=tp_size))
            payload.setdefault(part[0], set()).add(part[1])
            continue
        if lora_base_name(spec.name) is not None:
            routes.append(_adapter_route(spec, adapter, which=which, rank=rank, allow_cast=allow_cast))
            continue
        routes.append(_route(spec, params, config, expected, which=which, rank=rank, tp_size=tp_size,
                             allow_cast=allow_cast))
    for name, got in payload.items():  # a payload is its values and its scales
        if got != {"fp8", "scale"}:
            lacking = name + (SCALE_SUFFIX if "fp8" in got else FP8_SUFFIX)
            raise InvalidRequestError(lacking, f"rank {rank}: missing from the {which} manifest, which holds "
                                      f"the other half of {name}'s FP8 payload; nothing was written")
        seen.add(name)
    # the base and the adapter each come whole or not at all (an adapter-only sync leaves the base as held)
    wanted = [*(expected if len(routes) > sum(r.adapter for r in routes) else ()),
              *(adapter if any(r.adapter for r in routes) else ())]
    missing = [name for name in wanted if name not in seen]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise InvalidRequestError(missing[0], f"rank {rank}: {len(missing)} tensor(s) of the {which} model "
                                  f"missing from the manifest: {shown}; nothing was written")
    by_name = {s.name: s for s in specs}
    if LM_HEAD in by_name and is_skipped(LM_HEAD, config) and by_name[LM_HEAD].dtype != by_name[EMBED].dtype:
        raise InvalidRequestError(LM_HEAD, f"rank {rank}: the {which} model ties lm_head to the embedding, "
                                  f"but lm_head is {by_name[LM_HEAD].dtype} and the embedding "
                                  f"{by_name[EMBED].dtype}; nothing was written")
    return routes


def _adapter_route(spec: TensorSpec, adapter: dict[str, AdapterTensor], *, which: str, rank: str,
                   allow_cast: bool) -> Route:
    def bad(msg: str) -> InvalidRequestError:
        return InvalidRequestError(spec.name, f"rank {rank}: {msg}; nothing was written")

    region = adapter.get(spec.name)
    if region is None:
        why = ("it was launched without an adapter (sidecar launch --lora DIR)" if not adapter
               else "its adapter does not adapt this module")
        raise bad(f"a LoRA adapter tensor, but the {which} model takes none: {why}")
    if spec.shape != region.full_shape:
        raise bad(f"shape {list(spec.shape)} does not match the {which} model's adapter {list(region.full_shape)}")
    held_dtype = dtype_name(region.held.dtype)
    if spec.dtype != held_dtype and not allow_cast:
        raise bad(f"dtype {spec.dtype} differs from the {which} model's adapter {held_dtype}: send "
                  f"{held_dtype}, or pass allow_cast=True")
    held = region.held if region.whole and spec.dtype == held_dtype else None
    return Route(spec, spec.name, None, held, region)


def _payload_route(spec: TensorSpec, name: str, part: str, params: dict[str, nn.Parameter],
                   layers: dict[str, nn.Module], config: ModelConfig, expected: dict[str, tuple[int, ...]], *,
                   which: str, rank: str, tp_size: int) -> Route:
    """The route of one half of an FP8 payload (`part` of the HF tensor `name`) into its FP8 layer."""
    def bad(msg: str) -> InvalidRequestError:
        return InvalidRequestError(spec.name, f"rank {rank}: {msg}; nothing was written")

    if name not in expected:
        raise bad(f"an FP8 payload of {name}, which is not a tensor of the {which} model ({config.family})")
    if not is_fp8_linear(name):
        raise bad(f"an FP8 payload of {name}, which FP8 mode never quantizes (only the linears' weights)")
    param_name, shard_id = hf_to_param(name, config)
    layer = layers.get(param_name)
    if layer is None or param_name not in params:
        flag = "--draft-quantization fp8" if which == "draft" else "--quantization fp8"
        raise bad(f"an FP8 payload (quantized on send), but the {which} model is not in fp8 mode: launch it "
                  f"with {flag}, or send this model unquantized (WeightSender.manifest(..., fp8=False))")
    rows, cols = expected[name]
    dtype, shape = (FP8_NAME, (rows, cols)) if part == "fp8" else (SCALE_DTYPE, (rows,))
    if (spec.dtype, spec.shape) != (dtype, shape):
        raise bad(f"an FP8 payload's {part} must be {dtype} of shape {list(shape)}, got {spec.dtype} of "
                  f"shape {list(spec.shape)}")
    held = None
    if tp_size == 1:  # the rank holds it whole: a direct copy, digested where it is held
        region = layer.installed_region(shard_id)[0 if part == "fp8" else 1]
        held = region if tuple(region.shape) == shape and region.is_contiguous() else None
    return Route(spec, param_name, shard_id, held, part=part)


def _route(spec: TensorSpec, params: dict[str, nn.Parameter], config: ModelConfig,
           expected: dict[str, tuple[int, ...]], *, which: str, rank: str, tp_size: int,
           allow_cast: bool) -> Route:
    def bad(msg: str) -> InvalidRequestError:
        return InvalidRequestError(spec.name, f"rank {rank}: {msg}; nothing was written")

    if is_skipped(spec.name, config):
        if spec.name == LM_HEAD and spec.shape != expected[EMBED]:
            raise bad(f"tied lm_head has shape {list(spec.shape)}, the embedding {list(expected[EMBED])}")
        return Route(spec, None, None, None)
    if spec.name not in expected:
        raise bad(f"unknown tensor for the {which} model ({config.family})")
    if spec.shape != expected[spec.name]:
        raise bad(f"shape {list(spec.shape)} does not match the {which} model's {list(expected[spec.name])}")
    param_name, shard_id = hf_to_param(spec.name, config)
    if param_name not in params:
        raise bad(f"maps to {param_name}, which the {which} model does not have")
    param = params[param_name]
    # an FP8 weight takes the model dtype and quantizes it as it lands (weights/installed.py)
    held_dtype = dtype_name(getattr(param, "quantized_from", param.dtype))
    if spec.dtype != held_dtype and not allow_cast:
        raise bad(f"dtype {spec.dtype} differs from the {which} model's {held_dtype}: convert on the way in "
                  "with WeightSyncHook(..., allow_cast=True) (SidecarClient.sync_weights(..., allow_cast=True)), "
                  f"or serve the trainer's dtype: `sidecar launch --dtype {spec.dtype}`")
    held, tp_part = None, None
    if spec.dtype == dtype_name(param.dtype):  # an FP8 weight is never written directly
        if tp_size == 1:
            held = _held_region(param, param_name, shard_id, spec.shape, config)
        else:
            tp_part = _held_part(param, shard_id, spec)
    return Route(spec, param_name, shard_id, held, tp_part=tp_part)


def _held_part(param: nn.Parameter, shard_id: ShardId, spec: TensorSpec) -> tuple[torch.Tensor, Slice | None] | None:
    """At TP > 1: the region of `param` its loader fills from `spec`'s full tensor, and which part of it
    (the layer's `held_part`, inference/layers/linear.py); None when it has none or it is not one
    contiguous region of that part's shape."""
    part_of = getattr(param, "held_part", None)
    got = part_of(param, shard_id) if part_of is not None else None
    if got is None:
        return None
    region, where = got
    sl = Slice(*where) if where is not None else None
    if sl is not None and not sl.fits(spec.shape):
        return None
    shape = sl.shape(spec.shape) if sl is not None else spec.shape
    return (region, sl) if tuple(region.shape) == shape and region.is_contiguous() else None


def _held_region(param: nn.Parameter, param_name: str, shard_id: ShardId, shape: tuple[int, ...],
                 config: ModelConfig) -> torch.Tensor | None:
    """At TP=1 a fused parameter is its parts stacked along dim 0, in naming order (fused experts [E, rows,
    cols] flattened to [E * rows, cols] likewise); None if not so."""
    data = param.detach()
    if shard_id is None:
        return data if tuple(data.shape) == shape and data.is_contiguous() else None
    if not data.is_contiguous():
        return None
    if data.dim() > 2:
        data = data.flatten(0, -2)
    rows, total = _part_rows(param_name, config)
    if total != data.shape[0]:
        return None
    start, end = rows[shard_id]
    region = data.narrow(0, start, end - start)
    return region if tuple(region.shape) == shape else None


@functools.lru_cache(maxsize=8192)
def _part_rows(param_name: str, config: ModelConfig) -> tuple[dict[ShardId, tuple[int, int]], int]:
    """({shard id: its [start, end) rows in the parameter stacked along dim 0}, total rows) at TP=1.
    Cached: an MoE layer's expert parameters have hundreds of parts each."""
    expected = _expected(config)
    rows, start = {}, 0
    for hf, shard_id in param_to_hf(param_name, config):
        rows[shard_id] = (start, start + expected[hf][0])
        start += expected[hf][0]
    return rows, start


@functools.lru_cache(maxsize=8)
def _expected(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    return expected_hf_tensors(config)


class UpdateTarget:
    """The sink one session's bytes flow into (see the module docstring)."""

    def __init__(self, which: str, config: ModelConfig, routing: Routing, rank: str,
                 algorithm: str = ALGORITHM) -> None:
        self.which, self.config, self.routes, self.rank = which, config, routing.routes, rank
        self.algorithm = algorithm
        self._params = routing.params
        self._destinations = routing.destinations
        self._records: dict[str, TensorRecord] = {}  # digested from received bytes
        self._written: set[int] = set()
        self._delta: list[tuple[TensorSpec, torch.Tensor]] | None = None  # a delta's regions, as audited
        self.audited_parts = False  # the last delta was audited in TP parts (some record names a slice)
        self.on_landed: Callable[[], None] | None = None  # see landed()
        self.installed = InstalledAudit(routing.fp8_layers, which, rank, algorithm) if routing.fp8_layers else None
        # whether this session installs FP8 weights (a linear quantized on receive, or a payload)
        self.installs_fp8 = self.installed is not None and any(
            r.part is not None or self.installed.covers(r.param) for r in self.routes)

    def direct_destinations(self) -> Sequence[torch.Tensor | None]:
        """Per manifest index, the region a direct copy may write, or None to go through `put`."""
        return self._destinations

    def mark_direct(self, indices: Sequence[int]) -> None:
        """Record tensors written by a direct copy (their digests come from the held regions)."""
        self._written.update(indices)

    def delta_regions(self) -> Regions | None:
        """Per manifest tensor, the region a delta writes on this rank and which part of the tensor it holds
        (None: all of it); None when some tensor has none (a cast, an FP8 weight, a tied lm_head, an
        MoE layer's fused experts at TP > 1): that sync is full."""
        regions = [r.delta_region for r in self.routes]
        return None if any(r is None for r in regions) else regions  # type: ignore[return-value]

    def mark_delta(self) -> None:
        """A delta wrote every tensor into its `delta_regions`: the audit digests those regions, a part of a
        tensor recorded with the part's shape."""
        regions = self.delta_regions()
        assert regions is not None
        self._written.update(range(len(self.routes)))
        self._delta = [(TensorSpec(r.spec.name, r.spec.dtype, sl.shape(r.spec.shape)) if sl is not None else r.spec,
                        region) for r, (region, sl) in zip(self.routes, regions)]
        self.audited_parts = any(sl is not None for _, sl in regions)

    def full_records(self, digests: Sequence[str]) -> list[TensorRecord]:
        """The full tensors' records with `digests`, the sender's of them (one per manifest tensor)."""
        assert len(digests) == len(self.routes), (len(digests), len(self.routes))
        return [TensorRecord(r.spec.name, r.spec.dtype, r.spec.shape, d) for r, d in zip(self.routes, digests)]

    def put(self, items: Sequence[tuple[int, torch.Tensor]]) -> None:
        """Load completed tensors; digests of anything not held whole are taken before returning.

        A tensor with a direct destination is copied straight into it (batched: the region is exactly
        what its weight_loader would write); the rest go through the loader and are digested here.
        """
        same_device, to_digest, to_install, to_place = [], [], [], []
        with torch.no_grad():
            for index, tensor in items:
                route = self.routes[index]
                assert index not in self._written, f"{route.spec.name} received twice"
                dst = self._destinations[index]
                if route.part is not None and dst is None:  # an FP8 payload this rank holds a slice of
                    to_place.append((route.spec, route.param, route.shard_id, route.part, tensor))
                    to_digest.append((route.spec.name, tensor))
                elif route.part is None and self.installed is not None and self.installed.covers(route.param):
                    to_install.append((route.spec, route.param, route.shard_id, tensor))
                    to_digest.append((route.spec.name, tensor))
                elif dst is not None and dst.device == tensor.device:
                    same_device.append((dst, tensor))
                elif dst is not None:
                    dst.copy_(tensor)  # host bytes to the device: blocking, so the buffer is free after
                else:
                    if route.sink is not None:
                        route.sink.load(tensor)
                    elif route.param is not None:
                        load_hf_tensor(self._params, self.config, route.spec.name, tensor)
                    to_digest.append((route.spec.name, tensor))
                self._written.add(index)
            copy_pairs(same_device)
        if to_install:
            self.installed.put(to_install)  # type: ignore[union-attr]
        if to_place:
            self.installed.place(to_place)  # type: ignore[union-attr]
        for record in digest_tensors(to_digest, algorithm=self.algorithm):
            self._records[record.name] = record

    def held_items(self) -> list[tuple[str, torch.Tensor]] | None:
        """(name, held region) of every tensor whose digest is taken from the model, or None while
        some tensor has not arrived."""
        held = self.held_parts()
        return None if held is None else [(spec.name, region) for spec, region in held]

    def held_parts(self) -> list[tuple[TensorSpec, torch.Tensor]] | None:
        """(the spec its record names, held region) of every tensor whose digest is taken from the model
        (after a delta: every tensor, TP parts with their part's shape), or None likewise."""
        if len(self._written) != len(self.routes):
            return None
        if self._delta is not None:
            return list(self._delta)
        records = self._records
        held = [r for r in self.routes if r.spec.name not in records] if records else list(self.routes)
        assert all(r.held is not None for r in held)
        return [(r.spec, r.held) for r in held]  # type: ignore[misc]

    def audit_specs(self) -> list[TensorSpec]:
        """Per manifest tensor, what its record must name (dtype, shape): the tensor, or after a delta into
        TP parts the part this rank holds (the sender's digests for this rank are of the same parts)."""
        return [spec for spec, _ in self._delta] if self._delta is not None else [r.spec for r in self.routes]

    def landed(self) -> None:
        """The backend wrote every byte of the sync (queued on the current stream) and is about to
        report success in the status step: `on_landed` (the updater's overlapped digest) runs now, once
        (a backend may call it as soon as its last write is queued; the status step's call is then a no-op)."""
        on_landed, self.on_landed = self.on_landed, None
        if on_landed is not None:
            on_landed()

    def received_manifest(self, version: int, held: Sequence[TensorRecord] | None = None) -> Manifest:
        """Digests of every tensor received (trainer names). Raises if any tensor never arrived.
        `held`: the digests of `held_items()` if already taken, else they are taken now."""
        return self.manifest_of(version, self.received_records(held))

    def manifest_of(self, version: int, records: Sequence[TensorRecord]) -> Manifest:
        """The Manifest of `received_records()` at `version`."""
        return Manifest(self.which, version, self.rank, tuple(records), self.algorithm)

    def received_records(self, held: Sequence[TensorRecord] | None = None) -> list[TensorRecord]:
        """The record of every tensor received, in route (manifest) order; see received_manifest."""
        items = self.held_items()
        if items is None:
            unwritten = [r.spec.name for i, r in enumerate(self.routes) if i not in self._written]
            raise RuntimeError(f"rank {self.rank}: {len(unwritten)} tensor(s) of the session never arrived, "
                               f"first {unwritten[0]}")
        held = digest_tensors(items, algorithm=self.algorithm) if held is None else held
        assert [r.name for r in held] == [name for name, _ in items]
        if not self._records:  # every tensor digested where it is held: `held` is in route order already
            return list(held)
        records = {**self._records, **{r.name: r for r in held}}
        return [records[r.spec.name] for r in self.routes]

    def installed_report(self) -> Report:
        """The FP8 weights as held against the bytes installed into them: the rule's output on what was
        received, or this rank's share of a payload quantized on send (empty without FP8)."""
        return self.installed.report() if self.installed is not None else Report.build((), [self.rank], 0)

    def installed_records(self, received: Sequence[TensorRecord]) -> list[TensorRecord]:
        """The digests of every FP8 tensor this session installed (`name:fp8`, `name:scale`), as held on
        this rank, once installed_report ran: the ones it quantized or sliced, and the payload tensors
        copied whole into their regions (their received digests were taken there). Empty without FP8."""
        if self.installed is None:
            return []
        direct = {r.spec.name for r in self.routes if r.part is not None and r.held is not None}
        return [*self.installed.held, *(r for r in received if r.name in direct)]

    def tied_report(self, received: Manifest) -> Report:
        """A tied lm_head that was sent must carry the embedding's bytes (it is the same tensor)."""
        got = received.by_name()
        mismatches = []
        if LM_HEAD in got and EMBED in got and is_skipped(LM_HEAD, self.config) \
                and got[LM_HEAD].digest != got[EMBED].digest:
            mismatches.append(Mismatch("digest", self.rank, self.which, LM_HEAD, got[EMBED].digest,
                                       got[LM_HEAD].digest))
        return Report.build(mismatches, [self.rank], 0)
