"""checksum.dtypes is the one dtype table: names round-trip, sizes are torch's, an unknown name is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from checksum import DTYPES, ITEMSIZE, UnknownDtypeError, dtype_from_name, dtype_name
from checksum.dtypes import alias_of


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


@pytest.mark.parametrize(("name", "canonical"), [("float", "float32"), ("half", "float16"), ("long", "int64"),
                                                 ("torch.bfloat16", "bfloat16"), ("bfloat16", None),
                                                 ("bf16", None), ("complex64", None), (None, None)])
def test_alias_of_names_the_table_spelling_of_an_alias(name: object, canonical: str | None) -> None:
    assert alias_of(name) == canonical


def test_no_other_module_keeps_a_dtype_table() -> None:
    # every package asks checksum.dtypes; a getattr(torch, name) elsewhere is a second table
    repo = Path(__file__).resolve().parents[1]
    found = sorted(str(p.relative_to(repo)) for pkg in ("checksum", "inference", "sidecar", "trainer_hooks")
                   for p in (repo / pkg).rglob("*.py") if "getattr(torch," in p.read_text())
    assert found == ["checksum/dtypes.py"]
