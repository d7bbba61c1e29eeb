"""The second audit of an FP8 rank: the weights it computes with, as installed, against what it was sent.

A synced tensor bound for an FP8 linear (inference/layers/linear.py, `fp8`) arrives in one of two forms.
In the sender's dtype (bf16 as trainers hold it): `InstalledAudit.put` quantizes it on the parameter's
device as it lands (the layer's `install`: the rule of inference/quant/fp8.py over each FULL row, this
rank's slice written; one host read per call checks every tensor's scales are finite, and names a tensor
that was not) and digests what the rule gave (`name:fp8`, `name:scale`: inference/quant/installed.py).
Or quantized on send (inference/transfer/fp8_payload.py): `name:fp8` and `name:scale` as the sender's
rule gave them; a TP=1 rank copies each straight into its region (its received digest is taken there),
and `place` writes this rank's slice of each on any other rank and digests that slice.
Either way the received digests are audited as every tensor's are, and at finish `report` digests the
regions the parameters hold and names every tensor and the rank where they differ from what was written:
a byte flipped or torn between the install and the audit fails the sync, as a flipped received byte does.
`held` keeps those digests, and `sender_report` compares them with the ones the sender expects this rank to
hold (the rule applied to its own copy, delivered in the sync: inference/transfer/installed_digests.py),
so a rank that installed other bytes than the rule gives fails its audit before it goes live. A held
manifest lists each FP8 weight with its row scales after it (`held_items`, `scale_name`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from checksum import Mismatch, Report, TensorRecord, digest_tensors
from inference.core import InvalidRequestError
from inference.quant.fp8 import check_finite
from inference.quant.installed import installed_items
from inference.transfer.plan import TensorSpec

ShardId = str | int | None


def fp8_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Weight parameter name -> its FP8 linear layer, for every FP8 linear of `model`."""
    return {f"{name}.weight": m for name, m in model.named_modules() if getattr(m, "fp8", False)}


def scale_name(weight: str) -> str:
    """The name of an FP8 weight's row scales (the layer's `weight_scale` buffer) in held manifests."""
    return weight.rpartition(".")[0] + ".weight_scale"


def held_items(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every tensor `model` computes with, by its engine name: each parameter, and right after each FP8
    weight its row scales (`scale_name`): what a held manifest digests."""
    layers = fp8_layers(model)
    items: list[tuple[str, torch.Tensor]] = []
    for name, p in model.named_parameters():
        items.append((name, p.detach()))
        if name in layers:
            items.append((scale_name(name), layers[name].weight_scale))
    return items


class InstalledAudit:
    """One session's FP8 installs: what was written per tensor, and the check of what is held at finish."""

    def __init__(self, layers: dict[str, nn.Module], which: str, rank: str, algorithm: str) -> None:
        self.layers, self.which, self.rank, self.algorithm = layers, which, rank, algorithm
        self._expected: dict[str, TensorRecord] = {}
        self._regions: list[tuple[str, torch.Tensor]] = []  # (record name, the region it is held in)
        self.held: list[TensorRecord] = []  # the digests `report` took of the regions

    def covers(self, param: str | None) -> bool:
        return param is not None and param in self.layers

    def put(self, items: Sequence[tuple[TensorSpec, str, ShardId, torch.Tensor]]) -> None:
        """Install each (spec, parameter, shard_id, full received tensor) and digest what the rule gave."""
        produced: list[tuple[str, torch.Tensor]] = []
        finite = []
        with torch.no_grad():
            for spec, param, shard_id, tensor in items:
                layer = self.layers[param]
                q, scale = layer.install(tensor, shard_id, check=False)  # one host read per call, below
                finite.append(torch.isfinite(scale).all())
                produced += installed_items(spec.name, q, scale)
                self._regions += installed_items(spec.name, *layer.installed_region(shard_id))
            if finite and not bool(torch.stack(finite).all()):  # a non-finite row has a non-finite scale
                for (spec, _, _, tensor), ok in zip(items, finite):
                    if not ok:
                        try:
                            check_finite(tensor, spec.name)
                        except InvalidRequestError as e:
                            raise InvalidRequestError(spec.name, f"rank {self.rank}: {e.message}") from e
        self._expect(produced)

    def place(self, items: Sequence[tuple[TensorSpec, str, ShardId, str, torch.Tensor]]) -> None:
        """Write this rank's slice of each (spec, parameter, shard_id, part, full payload tensor) quantized
        on send into its region, and digest the slice."""
        written: list[tuple[str, torch.Tensor]] = []
        with torch.no_grad():
            for spec, param, shard_id, part, tensor in items:
                layer = self.layers[param]
                piece = layer.shard_quantized(tensor, part, shard_id)
                region = layer.installed_region(shard_id)[0 if part == "fp8" else 1]
                region.copy_(piece)
                written.append((spec.name, piece))
                self._regions.append((spec.name, region))
        self._expect(written)

    def _expect(self, items: list[tuple[str, torch.Tensor]]) -> None:
        for record in digest_tensors(items, algorithm=self.algorithm):
            self._expected[record.name] = record

    def records(self) -> list[TensorRecord]:
        """The digests of what the parameters hold now, for every tensor installed in this session."""
        return digest_tensors(self._regions, algorithm=self.algorithm)

    def report(self) -> Report:
        """Every installed region against the bytes written into it, naming tensor and rank."""
        self.held = held = self.records()
        mismatches = [Mismatch("digest", self.rank, self.which, r.name, self._expected[r.name].digest, r.digest)
                      for r in held if r.digest != self._expected[r.name].digest]
        return Report.build(mismatches, [self.rank], len(held))


def sender_report(installed: Sequence[TensorRecord], expected: Mapping[str, str], which: str, rank: str) -> Report:
    """What this rank installed (`name:fp8`, `name:scale` records) against the digests the sender expects it
    to hold: each difference names the tensor and the rank; a tensor on one side only is missing or extra."""
    got = {r.name: r.digest for r in installed}
    mismatches = [Mismatch("missing", rank, which, name, "installed by the sender's rule", "-")
                  for name in expected if name not in got]
    mismatches += [Mismatch("digest", rank, which, name, digest, got[name])
                   for name, digest in expected.items() if name in got and got[name] != digest]
    mismatches += [Mismatch("extra", rank, which, name, "-", "installed, not expected by the sender")
                   for name in got if name not in expected]
    return Report.build(mismatches, [rank], len(expected))
