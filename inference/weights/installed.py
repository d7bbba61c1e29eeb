"""The second audit of an FP8 rank: the weights it computes with, as installed, against the rule.

A synced tensor bound for an FP8 linear (inference/layers/linear.py, `fp8`) arrives in the sender's dtype
(bf16 as trainers hold it), and its received digest is audited as every tensor's is. `InstalledAudit.put`
quantizes it on the parameter's device as it lands (the layer's `install`: the rule of
inference/quant/fp8.py over each FULL row, this rank's slice written; one host read per call checks
every tensor's scales are finite, and names a tensor that was not) and digests what the rule gave
(`name:fp8`, `name:scale`: inference/quant/installed.py). At finish, `report` digests the regions the
parameters hold and names every tensor and the rank where they differ: a byte flipped or torn between
the install and the audit fails the sync, as a flipped received byte does. The expected bytes are the
rule's output on the audited received bytes, so they are the bytes the trainer computes from its own
copy (`installed_records`; the rule is bit-exact across devices); the check costs one quantization and
two digests of the FP8 bytes (half of bf16's) per sync.
"""

from __future__ import annotations

from collections.abc import Sequence

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


class InstalledAudit:
    """One session's FP8 installs: what the rule gave per tensor, and the check of what is held at finish."""

    def __init__(self, layers: dict[str, nn.Module], which: str, rank: str, algorithm: str) -> None:
        self.layers, self.which, self.rank, self.algorithm = layers, which, rank, algorithm
        self._expected: dict[str, TensorRecord] = {}
        self._regions: list[tuple[str, tuple[torch.Tensor, torch.Tensor]]] = []

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
                self._regions.append((spec.name, layer.installed_region(shard_id)))
            if finite and not bool(torch.stack(finite).all()):  # a non-finite row has a non-finite scale
                for (spec, _, _, tensor), ok in zip(items, finite):
                    if not ok:
                        try:
                            check_finite(tensor, spec.name)
                        except InvalidRequestError as e:
                            raise InvalidRequestError(spec.name, f"rank {self.rank}: {e.message}") from e
        for record in digest_tensors(produced, algorithm=self.algorithm):
            self._expected[record.name] = record

    def records(self) -> list[TensorRecord]:
        """The digests of what the parameters hold now, for every tensor installed in this session."""
        items = [item for name, (q, scale) in self._regions for item in installed_items(name, q, scale)]
        return digest_tensors(items, algorithm=self.algorithm)

    def report(self) -> Report:
        """Every installed region against the rule's bytes of the received tensor, naming tensor and rank."""
        held = self.records()
        mismatches = [Mismatch("digest", self.rank, self.which, r.name, self._expected[r.name].digest, r.digest)
                      for r in held if r.digest != self._expected[r.name].digest]
        return Report.build(mismatches, [self.rank], len(held))
