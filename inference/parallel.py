"""Where one rank runs: its device and its tensor-parallel identity, passed into the model (never
read from globals).

`resolve_device` owns the rule for a device named "auto" (cuda when torch sees a GPU, else cpu):
the engine and the CLI both ask it. A model built with the default TPInfo() needs no
torch.distributed at all, which is how it builds on CPU in tests. With size > 1, `group` is the
process group of the TP ranks (gloo on CPU, NCCL on GPU), created by the worker, not by the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


def resolve_device(name: str) -> torch.device:
    """The device `name` means: "auto" is cuda when torch sees a GPU, else cpu."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


@dataclass(frozen=True)
class TPInfo:
    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed.ProcessGroup when size > 1

    def __post_init__(self) -> None:
        assert 0 <= self.rank < self.size, (self.rank, self.size)
        assert self.size == 1 or self.group is not None, "TP size > 1 needs a process group"

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_reduce_ordered(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of x, added in rank order on every rank (a new tensor). The batch-invariant
        mode's all-reduce: a collective picks its algorithm, and so its order of additions, by message
        size, which follows the batch; gathering the parts and adding them here fixes the order for a
        given TP size, at TP times the bytes of the all-reduce."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        return total

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's x along the last dimension, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def shard(self, n: int, what: str = "dimension") -> int:
        """The size of this rank's shard of n, which must divide evenly."""
        if n % self.size:
            raise ValueError(f"{what} of size {n} does not divide by tensor-parallel size {self.size}")
        return n // self.size
