"""Every malformed manifest field is a ManifestError naming that field, never a TypeError or KeyError
(a list as a dtype raised TypeError: a 500 over HTTP and a traceback in `sidecar audit`)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from checksum import Manifest, ManifestError, TensorRecord, load_manifests

GOOD: dict[str, Any] = {
    "format": "sidecar-checksum-manifest", "format_version": 1, "algorithm": "xxh3_128_seg64m",
    "model": "target", "weight_version": 3, "rank": "dp0:pp0:tp0",
    "tensors": [{"name": "a", "dtype": "bfloat16", "shape": [2, 3], "digest": "0" * 32},
                {"name": "b", "dtype": "float32", "shape": [], "digest": "1" * 32}],
}
# JSON values of every type, and strings that look almost right
BAD_VALUES = [None, True, 1.5, -1, 2**70, "", "x", [], ["bfloat16"], [[1]], {}, {"a": 1}, "__class__", "float"]
HEADER = ["format", "format_version", "algorithm", "model", "weight_version", "rank", "tensors"]
RECORD = ["name", "dtype", "shape", "digest"]


def test_the_good_manifest_loads() -> None:
    assert [r.name for r in Manifest.from_dict(GOOD).records] == ["a", "b"]


def _valid_for(field: str, value: Any) -> bool:
    """The few values in BAD_VALUES that are fine for a field."""
    fine = [("shape", []), ("shape", ()), ("tensors", []), ("weight_version", 2**70), ("name", "x"),
            ("name", "__class__"), ("name", "float")]
    return any(field == f and type(value) is type(v) and value == v for f, v in fine)


@pytest.mark.parametrize("field", HEADER)
def test_every_bad_header_value_is_a_manifest_error_naming_the_field(field: str) -> None:
    for value in BAD_VALUES:
        if _valid_for(field, value):
            continue
        data = {**GOOD, field: value}
        with pytest.raises(ManifestError) as e:
            Manifest.from_dict(data, "src")
        # a list of the wrong things names the first bad item: tensors[0]
        assert e.value.field.split("[")[0] == field and str(e.value).startswith(f"src: {e.value.field}: "), \
            (value, str(e.value))


@pytest.mark.parametrize("field", RECORD)
def test_every_bad_record_value_is_a_manifest_error_naming_the_field(field: str) -> None:
    for value in BAD_VALUES:
        if _valid_for(field, value):
            continue
        data = copy.deepcopy(GOOD)
        data["tensors"][1][field] = value
        with pytest.raises(ManifestError) as e:
            Manifest.from_dict(data, "src")
        assert e.value.field == f"tensors[1].{field}", (value, str(e.value))


@pytest.mark.parametrize("field", RECORD)
def test_records_built_in_code_are_checked_the_same_way(field: str) -> None:
    for value in BAD_VALUES:
        if _valid_for(field, value):
            continue
        good = {"name": "b", "dtype": "float32", "shape": (), "digest": "1" * 32}
        record = TensorRecord(**{**good, field: value})
        with pytest.raises(ManifestError) as e:
            Manifest("target", 1, "dp0:pp0:tp0", (record,))
        assert e.value.field == f"records[0].{field}", (value, str(e.value))


def test_records_that_are_not_a_sequence_name_records() -> None:
    for value in (None, 5, 1.5):
        with pytest.raises(ManifestError) as e:
            Manifest("target", 1, "dp0:pp0:tp0", value)  # type: ignore[arg-type]
        assert e.value.field == "records"


def test_a_list_dtype_in_a_file_names_file_and_field(tmp_path: Path) -> None:
    """Issue 20 item 9's file: `sidecar audit` reads it through load_manifests."""
    data = copy.deepcopy(GOOD)
    data["tensors"][0]["dtype"] = ["bfloat16"]
    path = tmp_path / "list_dtype.json"
    path.write_text(json.dumps([GOOD, data]))
    with pytest.raises(ManifestError) as e:
        load_manifests(path)
    assert str(e.value).startswith(f"{path}[1]: tensors[0].dtype: unknown dtype ['bfloat16']")
