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


def alias_of(name: object) -> str | None:
    """The DTYPES name that `name` spells another way, torch's alias or with "torch.": "float32" for
    "float" or "torch.float32"; None for a DTYPES name itself or one that names no dtype of DTYPES."""
    if not isinstance(name, str):
        return None
    dtype = getattr(torch, name.removeprefix("torch."), None)
    canonical = dtype_name(dtype) if isinstance(dtype, torch.dtype) else None
    return canonical if canonical in DTYPES and canonical != name else None


def dtype_from_name(name: str) -> torch.dtype:
    """The dtype called `name` (a "torch." prefix is accepted); UnknownDtypeError otherwise."""
    dtype = DTYPES.get(name.removeprefix("torch.")) if isinstance(name, str) else None
    if dtype is None:
        raise UnknownDtypeError(name)
    return dtype
