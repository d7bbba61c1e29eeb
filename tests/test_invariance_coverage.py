"""What the batch-invariant mode covers (docs/invariance.md, "What the mode covers"), kept true.

The table there has a row for every engine option (EngineConfig and its cache and scheduler sections), every
SamplingParams field and the per-request sync options: a new one fails here until the table says what the
mode promises with it. Each row's verdict is one of VERDICTS, and a "bitwise" row names the tests that
hold it, each of which must exist. Every way to build an engine takes the mode's default from
EngineConfig, so turning the mode on by default is one line there (plus the rows of the docs that state
the default, which this file reads too).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import re
from functools import cache
from pathlib import Path

import pytest

from inference.config import EngineConfig, build_engine_config, engine_option_names
from inference.core import InvalidRequestError, SamplingParams
from inference.engine.llm import LLM
from inference.layers.attention import get_attention_backend
from inference.layers.attention_invariant import batch_invariant_backend
from sidecar.cli.launch import add_arguments
from sidecar.config import FIELD_TYPES, build_config, engine_config

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "invariance.md"
VERDICTS = ("bitwise", "no effect", "not promised")
PER_REQUEST = ("on_sync", "max_staleness")  # LLM.add_request's sync options (on_sync is an engine option too)
DEFAULT = next(f.default for f in dataclasses.fields(EngineConfig) if f.name == "batch_invariant")


@cache
def rows() -> list[tuple[list[str], str, list[tuple[str, str]]]]:
    """(option names, verdict, (test file, test function) references) per row of the table."""
    section = DOC.read_text().split("## What the mode covers", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("| ")]
    assert lines[0].startswith("| option |"), lines[0]
    out = []
    for line in lines[2:]:  # past the header and its rule
        option, verdict, held_by = (cell.strip() for cell in line.strip().strip("|").split("|"))
        out.append((re.findall(r"`(\w+)`", option), verdict,
                    re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", held_by)))
    return out


def test_the_table_has_a_row_for_every_option_and_sampling_field() -> None:
    named = [n for names, _, _ in rows() for n in names]
    engine, sampling = set(engine_option_names()), {f.name for f in dataclasses.fields(SamplingParams)}
    twice = {n for n in named if named.count(n) > 1}
    assert twice <= engine & sampling, f"{twice - (engine & sampling)}: two rows (only a name both an engine "
    "option and a sampling field, such as seed, has one of each)"
    wanted = engine | sampling | set(PER_REQUEST)
    assert set(named) - wanted == set(), "rows for options that do not exist"
    assert wanted - set(named) == set(), "options the table does not say the mode's promise of"
    assert set(PER_REQUEST) <= set(inspect.signature(LLM.add_request).parameters)


def test_every_row_gives_a_verdict_and_a_bitwise_row_names_tests_that_exist() -> None:
    for names, verdict, refs in rows():
        assert verdict.startswith(VERDICTS), (names, verdict)
        assert not verdict.startswith("bitwise") or refs, f"{names}: bitwise, held by no test"
        for path, test in refs:
            assert test in _test_names(path), f"{names}: {path}::{test} does not exist"


@cache
def _test_names(path: str) -> frozenset[str]:
    tree = ast.parse((ROOT / path).read_text())
    return frozenset(n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_"))


def test_every_attention_backend_has_a_mode_form() -> None:
    for name in ("reference", "triton"):
        backend = batch_invariant_backend(get_attention_backend(name))
        assert batch_invariant_backend(backend) is not None  # its mode form is a backend of the same kind

    class Plain:
        name = "plain"

    with pytest.raises(InvalidRequestError) as e:
        batch_invariant_backend(Plain())  # type: ignore[arg-type]
    assert e.value.field == "attention_backend"


def _launch(argv: list[str]) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(argv)
    return engine_config(build_config({n: getattr(args, n) for n in FIELD_TYPES}, env={}), "m", "cpu")


def test_every_engine_takes_the_default_mode_from_engine_config() -> None:
    """LLM(...), `sidecar launch` and a config built from options all leave the mode at EngineConfig's
    default unless told; --batch-invariant / --no-batch-invariant and the keyword set it either way; the
    docs state the default that EngineConfig holds."""
    assert build_engine_config("m").batch_invariant is DEFAULT
    assert _launch([]).batch_invariant is DEFAULT
    assert _launch(["--batch-invariant"]).batch_invariant is True
    assert _launch(["--no-batch-invariant"]).batch_invariant is False
    assert build_engine_config("m", batch_invariant=not DEFAULT).batch_invariant is (not DEFAULT)  # LLM's keyword
    assert f"**Default: {'on' if DEFAULT else 'off'}.**" in DOC.read_text()
    config_doc = (ROOT / "docs" / "configuration.md").read_text()
    said = str(DEFAULT).lower()
    assert re.search(rf"^\| `batch_invariant` \| EngineConfig \| bool \| {said}\b", config_doc, re.M)
    assert f"`SIDECAR_BATCH_INVARIANT` | bool | engine's: {said} |" in config_doc
