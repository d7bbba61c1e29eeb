"""checksum.dtypes is the one dtype table: names round-trip, sizes are torch's, an unknown name is refused."""

from __future__ import annotations

import pytest
import torch

from checksum import DTYPES, ITEMSIZE, UnknownDtypeError, dtype_from_name, dtype_name


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_names_round_trip_and_sizes_are_torch_sizes(name: str) -> None:
    dtype = dtype_from_name(name)
    assert dtype_name(dtype) == name and dtype_from_name(f"torch.{name}") is dtype
    assert ITEMSIZE[name] == torch.empty(2, dtype=dtype).element_size()


def test_the_wire_dtypes_are_all_there() -> None:
    assert {"float32", "bfloat16", "float16", "float64", "int64", "uint8", "bool"} <= set(DTYPES)


@pytest.mark.parametrize("bad", ["half", "bf16", "complex64", "", None])
def test_an_unknown_name_is_refused_naming_it(bad: object) -> None:
    with pytest.raises(UnknownDtypeError) as err:
        dtype_from_name(bad)  # type: ignore[arg-type]
    assert err.value.name == bad and repr(bad) in str(err.value) and "bfloat16" in str(err.value)
