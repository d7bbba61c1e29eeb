"""The one table of tensor dtypes: torch dtype <-> name <-> bytes per element.

A name is torch's without "torch." ("bfloat16"), the spelling manifests, the weight wire and configs
use. Every package imports this table (checksum is the leaf everyone may import); none keeps its own.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

_NAMES = ("float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2",
          "int64", "int32", "int16", "int8", "uint8", "bool")
# Name -> dtype of every dtype a weight may travel or be held in (the float8 ones where this torch has them).
DTYPES: Mapping[str, torch.dtype] = {name: getattr(torch, name) for name in _NAMES if hasattr(torch, name)}
ITEMSIZE: Mapping[str, int] = {name: dtype.itemsize for name, dtype in DTYPES.items()}


class UnknownDtypeError(ValueError):
    """A dtype name outside DTYPES; `name` is what was given."""

    def __init__(self, name: object) -> None:
        super().__init__(f"unsupported dtype {name!r}; known: {sorted(DTYPES)}")
        self.name = name


def dtype_name(dtype: torch.dtype) -> str:
    """"bfloat16" for torch.bfloat16: the spelling manifests use."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """The dtype called `name` (a "torch." prefix is accepted); UnknownDtypeError otherwise."""
    dtype = DTYPES.get(name.removeprefix("torch.")) if isinstance(name, str) else None
    if dtype is None:
        raise UnknownDtypeError(name)
    return dtype
