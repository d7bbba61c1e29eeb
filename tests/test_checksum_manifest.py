"""Manifests (canonical, exact JSON round trip, clear errors) and comparison reports."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from checksum import (
    ChecksumMismatch,
    Manifest,
    ManifestError,
    TensorRecord,
    audit,
    compare,
    compare_ranks,
    load_manifests,
    manifest_from_tensors,
    parse_rank_key,
    rank_key,
    save_manifests,
)

DIGEST = "0123456789abcdef0123456789abcdef"


def state_dict() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.layers.0.mlp.up_proj.weight": torch.randn(16, 8, generator=g).to(torch.bfloat16),
        "model.embed_tokens.weight": torch.randn(32, 8, generator=g).to(torch.bfloat16),
        "model.norm.weight": torch.ones(8),
        "model.layers.0.self_attn.qkv_proj.weight": torch.randn(24, 8, generator=g).to(torch.bfloat16),
    }


def manifest(sd: dict[str, torch.Tensor] | None = None, rank: str = "dp0:pp0:tp0", version: int = 3,
             model: str = "target") -> Manifest:
    return manifest_from_tensors(sd if sd is not None else state_dict(), model=model, weight_version=version,
                                 rank=rank)


def flipped(sd: dict[str, torch.Tensor], name: str) -> dict[str, torch.Tensor]:
    out = {n: t.clone() for n, t in sd.items()}
    out[name].view(torch.uint8).view(-1)[3] ^= 0x80
    return out


# -- rank keys ------------------------------------------------------------------------------------


def test_rank_key_round_trips() -> None:
    assert rank_key(1, 0, 3) == "dp1:pp0:tp3"
    assert parse_rank_key("dp12:pp1:tp7") == (12, 1, 7)
    for bad in ("dp0:tp0", "dp0:pp0:tp-1", "DP0:PP0:TP0", " dp0:pp0:tp0"):
        with pytest.raises(ValueError):
            parse_rank_key(bad)
    with pytest.raises(ValueError, match="tp"):
        rank_key(0, 0, -1)


# -- manifests ------------------------------------------------------------------------------------


def test_manifest_from_state_dict_is_sorted_and_carries_dtype_and_shape() -> None:
    m = manifest()
    assert [r.name for r in m.records] == sorted(state_dict())
    emb = m.by_name()["model.embed_tokens.weight"]
    assert (emb.dtype, emb.shape) == ("bfloat16", (32, 8))
    assert (m.algorithm, m.model, m.weight_version, m.rank, m.format_version) == (
        "xxh3_128_seg64m", "target", 3, "dp0:pp0:tp0", 1)
    # A module's state dict works too, and the order of the input does not matter.
    reversed_input = dict(reversed(list(state_dict().items())))
    assert manifest(reversed_input) == m


def test_save_load_round_trips_exactly(tmp_path: Path) -> None:
    m = manifest(model="draft", version=17, rank=rank_key(2, 1, 3))
    path = tmp_path / "m.json"
    m.save(path)
    loaded = Manifest.load(path)
    assert loaded == m
    assert loaded.to_json() == path.read_text()
    assert json.loads(path.read_text())["tensors"][0]["name"] == m.records[0].name


def test_multi_rank_file_round_trips(tmp_path: Path) -> None:
    ms = [manifest(rank=rank_key(0, 0, tp)) for tp in range(3)]
    save_manifests(tmp_path / "ranks.json", ms)
    assert load_manifests(tmp_path / "ranks.json") == ms
    with pytest.raises(ManifestError, match="list of 3 manifests"):
        Manifest.load(tmp_path / "ranks.json")
    ms[0].save(tmp_path / "one.json")
    assert load_manifests(tmp_path / "one.json") == ms[:1]


def test_empty_manifest_round_trips() -> None:
    m = Manifest("target", 0, "dp0:pp0:tp0", ())
    assert Manifest.from_json(m.to_json()) == m


def valid_dict() -> dict[str, Any]:
    return manifest().to_dict()


def set_path(data: dict[str, Any], path: tuple[Any, ...], value: Any) -> None:
    for key in path[:-1]:
        data = data[key]
    data[path[-1]] = value


MALFORMED = {
    "missing weight_version": (lambda d: d.pop("weight_version"), "weight_version"),
    "string weight_version": (lambda d: set_path(d, ("weight_version",), "3"), "weight_version"),
    "bool weight_version": (lambda d: set_path(d, ("weight_version",), True), "weight_version"),
    "negative weight_version": (lambda d: set_path(d, ("weight_version",), -1), "weight_version"),
    "unknown algorithm": (lambda d: set_path(d, ("algorithm",), "sha256"), "algorithm"),
    "retired algorithm": (lambda d: set_path(d, ("algorithm",), "xxh3_128"), "algorithm"),
    "unknown model": (lambda d: set_path(d, ("model",), "critic"), "model"),
    "bad rank": (lambda d: set_path(d, ("rank",), "tp0"), "rank"),
    "future format_version": (lambda d: set_path(d, ("format_version",), 2), "format_version"),
    "wrong format": (lambda d: set_path(d, ("format",), "safetensors"), "format"),
    "misspelled key": (lambda d: d.update(weight_verison=3), "weight_verison"),
    "tensors not a list": (lambda d: set_path(d, ("tensors",), {}), "tensors"),
    "tensor not an object": (lambda d: set_path(d, ("tensors", 2), "x"), "tensors[2]"),
    "missing digest": (lambda d: d["tensors"][1].pop("digest"), "tensors[1].digest"),
    "short digest": (lambda d: set_path(d, ("tensors", 0, "digest"), "abc"), "tensors[0].digest"),
    "uppercase digest": (lambda d: set_path(d, ("tensors", 0, "digest"), DIGEST.upper()),
                         "tensors[0].digest"),
    "shape of strings": (lambda d: set_path(d, ("tensors", 0, "shape"), ["8"]), "tensors[0].shape"),
    "negative dim": (lambda d: set_path(d, ("tensors", 3, "shape"), [-1, 8]), "tensors[3].shape"),
    "unknown dtype": (lambda d: set_path(d, ("tensors", 0, "dtype"), "bfloat17"), "tensors[0].dtype"),
    "dtype alias": (lambda d: set_path(d, ("tensors", 0, "dtype"), "float"), "tensors[0].dtype"),
    "empty name": (lambda d: set_path(d, ("tensors", 0, "name"), ""), "tensors[0].name"),
    "duplicate name": (lambda d: set_path(d, ("tensors", 1, "name"), d["tensors"][0]["name"]),
                       "tensors[1].name"),
    "unknown tensor field": (lambda d: set_path(d, ("tensors", 1, "sha"), DIGEST), "tensors[1].sha"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_manifest_names_file_and_field(case: str, tmp_path: Path) -> None:
    mutate, field = MALFORMED[case]
    data = valid_dict()
    mutate(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ManifestError) as info:
        Manifest.load(path)
    assert isinstance(info.value, ValueError)
    assert info.value.field == field
    assert str(path) in str(info.value) and field in str(info.value)


def test_manifest_of_the_retired_whole_stream_digest_is_refused_with_a_reason(tmp_path: Path) -> None:
    """Before per-segment hashing, "xxh3_128" digests of tensors over 64 MiB meant something else:
    such a file must never be compared, and the error says what to do."""
    data = valid_dict()
    data["algorithm"] = "xxh3_128"
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ManifestError, match="no longer supported") as info:
        load_manifests(path)
    assert info.value.field == "algorithm"
    assert "'xxh3_128_seg64m'" in str(info.value) and "Regenerate" in str(info.value)
    with pytest.raises(ManifestError, match="algorithm"):
        Manifest("target", 3, "dp0:pp0:tp0", (), algorithm="xxh3_128")


@pytest.mark.parametrize(("text", "field"), [('{"format": ', "<json>"), ("[1, 2", "<json>"), ("42", "<root>"),
                                             ("[]", "<root>"), ("null", "<root>")])
def test_not_a_manifest_at_all(text: str, field: str, tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ManifestError) as info:
        load_manifests(path)
    assert info.value.field == field and str(path) in str(info.value)


def test_missing_file_is_a_manifest_error(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="cannot read") as info:
        Manifest.load(tmp_path / "absent.json")
    assert info.value.field == "<file>"


def test_bad_manifest_in_a_list_names_its_index(tmp_path: Path) -> None:
    good, bad = valid_dict(), valid_dict()
    bad["rank"] = "dp0"
    (tmp_path / "ranks.json").write_text(json.dumps([good, bad]))
    with pytest.raises(ManifestError, match=r"ranks\.json\[1\]: rank"):
        load_manifests(tmp_path / "ranks.json")


def test_constructing_an_invalid_manifest_raises() -> None:
    rec = TensorRecord("w", "bfloat16", (2,), DIGEST)
    with pytest.raises(ManifestError, match="duplicate tensor name 'w'"):
        Manifest("target", 1, "dp0:pp0:tp0", (rec, rec))
    with pytest.raises(ManifestError, match="model"):
        Manifest("actor", 1, "dp0:pp0:tp0", (rec,))
    with pytest.raises(ManifestError, match="duplicate"):
        manifest_from_tensors([("w", torch.ones(2)), ("w", torch.zeros(2))], model="target",
                              weight_version=0, rank="dp0:pp0:tp0")


@pytest.mark.parametrize("field, bad", [
    ("digest", DIGEST[:31]), ("digest", DIGEST + "0"), ("digest", DIGEST.upper()), ("digest", None),
    ("shape", (2, True)), ("shape", (2, -1)), ("shape", [2]), ("dtype", "bf16"), ("name", ""),
])
def test_one_bad_record_among_hundreds_is_named(field: str, bad: Any) -> None:
    """Records are checked in bulk (hundreds a sync); a single bad one still fails, naming its field
    and tensor, wherever it sits. A 31- and a 33-digit digest side by side are still two bad ones."""
    fields = {"dtype": "bfloat16", "shape": (2, 3), "digest": DIGEST}
    records = [TensorRecord(f"layer{i}.w", **fields) for i in range(300)]
    culprit = dict(name="layer7.w", **fields) | {field: bad}
    records[7] = TensorRecord(**culprit)
    if field == "digest" and bad == DIGEST[:31]:
        records[8] = TensorRecord("layer8.w", "bfloat16", (2, 3), DIGEST + "0")
    with pytest.raises(ManifestError, match=rf"records\[7\]\.{field}"):
        Manifest("target", 1, "dp0:pp0:tp0", tuple(records))
    assert len(Manifest("target", 1, "dp0:pp0:tp0", tuple(records[9:])).records) == 291  # the rest pass


# -- comparison -----------------------------------------------------------------------------------


def test_identical_manifests_pass() -> None:
    report = compare(manifest(), manifest())
    assert report.ok and report.first is None and report.tensors_checked == 4
    report.check()
    assert report.table().startswith("OK")


def test_flipped_byte_names_tensor_and_rank() -> None:
    sd = state_dict()
    name = "model.layers.0.mlp.up_proj.weight"
    report = compare(manifest(sd), manifest(flipped(sd, name), rank="dp0:pp0:tp1"))
    assert not report.ok
    assert [(m.kind, m.tensor, m.rank) for m in report.mismatches] == [("digest", name, "dp0:pp0:tp1")]
    with pytest.raises(ChecksumMismatch) as info:
        report.check()
    assert isinstance(info.value, ValueError) and info.value.report is report
    assert name in str(info.value) and "dp0:pp0:tp1" in str(info.value)


def test_first_mismatch_is_first_in_canonical_order() -> None:
    sd = state_dict()
    bad = flipped(flipped(sd, "model.norm.weight"), "model.embed_tokens.weight")
    report = compare(manifest(sd), manifest(bad))
    assert [m.tensor for m in report.mismatches] == ["model.embed_tokens.weight", "model.norm.weight"]
    assert report.first is not None and report.first.tensor == "model.embed_tokens.weight"
    assert "model.embed_tokens.weight" in report.summary()


def test_same_bytes_with_other_shape_or_dtype_is_caught() -> None:
    sd = state_dict()
    name = "model.embed_tokens.weight"
    reshaped = {**sd, name: sd[name].reshape(16, 16)}
    retyped = {**sd, name: sd[name].view(torch.int16)}
    shape_report = compare(manifest(sd), manifest(reshaped))
    dtype_report = compare(manifest(sd), manifest(retyped))
    rows = [(m.kind, m.expected, m.actual) for m in shape_report.mismatches + dtype_report.mismatches]
    assert rows == [("shape", "[32, 8]", "[16, 16]"), ("dtype", "bfloat16", "int16")]


def test_missing_extra_and_version_mismatches() -> None:
    sd = state_dict()
    actual = {n: t for n, t in sd.items() if n != "model.norm.weight"}
    actual["lm_head.weight"] = torch.zeros(4, 8)
    report = compare(manifest(sd), manifest(actual, version=2))
    kinds = [(m.kind, m.tensor) for m in report.mismatches]
    assert kinds == [("weight_version", ""), ("extra", "lm_head.weight"), ("missing", "model.norm.weight")]
    # The message names the first mismatch and the first tensor too.
    assert "weight_version" in report.summary() and "lm_head.weight" in report.summary()


def test_compare_ranks_matches_by_rank_and_reports_missing_and_extra_ranks() -> None:
    sd = state_dict()
    expected = [manifest(sd, rank=rank_key(0, 0, tp)) for tp in (0, 2, 10)]
    actual = [
        manifest(sd, rank=rank_key(0, 0, 10)),
        manifest(flipped(sd, "model.norm.weight"), rank="dp0:pp0:tp2"),
        manifest(sd, rank=rank_key(1, 0, 0)),
    ]
    report = compare_ranks(expected, actual)
    assert [(m.kind, m.rank, m.tensor) for m in report.mismatches] == [
        ("missing_rank", "dp0:pp0:tp0", ""),
        ("digest", "dp0:pp0:tp2", "model.norm.weight"),  # tp2 before tp10: ranks sort numerically
        ("extra_rank", "dp1:pp0:tp0", ""),
    ]
    assert report.ranks == ("dp0:pp0:tp0", "dp0:pp0:tp2", "dp0:pp0:tp10", "dp1:pp0:tp0")


def test_target_and_draft_of_one_rank_are_separate() -> None:
    sd = state_dict()
    draft_sd = {"model.norm.weight": torch.ones(8)}
    expected = [manifest(sd), manifest(draft_sd, model="draft")]
    actual = [manifest(draft_sd, model="draft"), manifest(sd)]
    assert compare_ranks(expected, actual).ok
    with pytest.raises(ManifestError, match="second actual manifest"):
        compare_ranks(expected, [manifest(sd), manifest(sd)])


def test_one_expected_manifest_applies_to_every_rank() -> None:
    sd = state_dict()
    actual = [manifest(sd, rank=rank_key(dp, 0, 0)) for dp in range(3)]
    actual[2] = manifest(flipped(sd, "model.norm.weight"), rank=rank_key(2, 0, 0))
    report = audit([manifest(sd, rank=rank_key(0, 0, 0))], actual)
    assert [(m.rank, m.tensor) for m in report.mismatches] == [("dp2:pp0:tp0", "model.norm.weight")]
    assert report.tensors_checked == 12


def test_table_is_aligned_and_lists_every_mismatch() -> None:
    sd = state_dict()
    bad = flipped(flipped(sd, "model.norm.weight"), "model.embed_tokens.weight")
    report = compare(manifest(sd), manifest(bad, rank="dp3:pp0:tp1"))
    lines = report.table().splitlines()
    header, rows, summary = lines[0], lines[1:-1], lines[-1]
    assert header.split() == ["RANK", "MODEL", "KIND", "TENSOR", "EXPECTED", "ACTUAL"]
    assert len(rows) == 2
    for column, row in zip(("TENSOR", "EXPECTED"), ([m.tensor for m in report.mismatches],
                                                    [m.expected for m in report.mismatches])):
        for line, value in zip(rows, row):
            assert line.index(value) == header.index(column)
    assert summary == report.summary()
    truncated = report.table(max_rows=1).splitlines()
    assert len(truncated) == 4 and truncated[2] == "... and 1 more"
