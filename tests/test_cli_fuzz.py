"""The CLI's file inputs fuzzed (hypothesis): launch's config file (JSON and TOML) and API key file, and the
audit's manifest files (arbitrary bytes, arbitrary JSON, a valid manifest with one field replaced). Each
is either accepted or refused the way the command's exit 2 is built (InvalidRequestError for launch,
exit status 2 and one line for the audit), never another exception: no traceback. In-process (a process
per example would take minutes); tests/test_hardening_errors.py runs the same refusals as processes."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from checksum import manifest_from_tensors, manifests_to_json
from inference.core import InvalidRequestError
from sidecar.cli.common import one_line
from sidecar.cli.main import main
from sidecar.config import LaunchConfig, build_config

EXAMPLES = 150
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12)
OPTION_NAMES = ["port", "tp", "device", "api_key", "api_key_file", "max_body_mb", "max_stops", "host", "model",
                "header_timeout_s", "max-connections", "unknown_option"]
configs = st.one_of(
    st.binary(max_size=300),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.dictionaries(st.sampled_from(OPTION_NAMES), json_values, max_size=4).map(lambda d: json.dumps(d).encode()),
    st.integers(1, 5000).map(lambda depth: (b"[" * depth + b"]" * depth)),
    st.integers(1, 5000).map(lambda depth: (b"a = " + b"[" * depth + b"]" * depth)),  # TOML
    st.text(max_size=100).map(lambda t: t.encode("utf-8", "surrogatepass")),
)
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cli-fuzz")


def test_launch_config_files_are_accepted_or_refused_naming_the_field(files: Path) -> None:
    @given(content=configs, suffix=st.sampled_from([".json", ".toml"]))
    @SETTINGS
    def run(content: bytes, suffix: str) -> None:
        path = files / f"config{suffix}"
        path.write_bytes(content)
        try:
            build_config({}, env={}, config_file=path)
        except InvalidRequestError as e:
            assert e.field and e.message
            assert "\n" not in one_line(e)  # launch prints one line
            one_line(e).encode("utf-8", "backslashreplace")

    run()


def test_api_key_files_are_accepted_or_refused_naming_the_field(files: Path) -> None:
    @given(content=st.one_of(st.binary(max_size=200), st.text(max_size=60).map(
        lambda t: t.encode("utf-8", "surrogatepass"))))
    @SETTINGS
    def run(content: bytes) -> None:
        path = files / "key"
        path.write_bytes(content)
        try:
            cfg = LaunchConfig(api_key_file=str(path))
        except InvalidRequestError as e:
            assert e.field == "api_key_file" and e.message
            str(e).encode("utf-8")
            return
        assert cfg.api_key and cfg.api_key.isascii() and cfg.api_key.isprintable()
        f"Bearer {cfg.api_key}".encode("latin-1")  # a header can carry it

    run()


def _manifest_json() -> Any:
    m = manifest_from_tensors({"w": torch.ones(3), "b": torch.zeros(2, 2)}, model="target", weight_version=3,
                              rank="dp0:pp0:tp0")
    return json.loads(manifests_to_json([m]))


def _mutated(path: list[Any], value: Any) -> bytes:
    data = _manifest_json()
    target = data
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return json.dumps(data).encode()


FIELD_PATHS = [[0, "format_version"], [0, "algorithm"], [0, "model"], [0, "weight_version"], [0, "rank"],
               [0, "tensors"], [0, "tensors", 0], [0, "tensors", 0, "name"], [0, "tensors", 0, "dtype"],
               [0, "tensors", 0, "shape"], [0, "tensors", 0, "digest"], [0, "tensors", 1, "name"]]
manifests = st.one_of(
    st.binary(max_size=300),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.tuples(st.sampled_from(FIELD_PATHS), json_values | st.text(max_size=8).map(lambda t: t + "\ud800")).map(
        lambda pv: _mutated(*pv)),
    st.integers(1, 5000).map(lambda depth: (b"[" * depth + b"]" * depth)),
)


def test_audit_files_exit_0_1_or_2_with_one_line_never_a_traceback(files: Path) -> None:
    good = files / "good.json"
    good.write_text(json.dumps(_manifest_json()))

    @given(content=manifests, first=st.booleans())
    @SETTINGS
    def run(content: bytes, first: bool) -> None:
        path = files / "fuzzed.json"
        path.write_bytes(content)
        args = [str(path), str(good)] if first else [str(good), str(path)]
        out, err = io.TextIOWrapper(io.BytesIO(), encoding="utf-8"), io.TextIOWrapper(io.BytesIO(), encoding="utf-8")
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["audit", *args])
            out.flush()
            err.flush()
        assert code in (0, 1, 2)
        if code == 2:
            message = err.buffer.getvalue().decode()  # type: ignore[attr-defined]
            assert message.startswith("sidecar audit: error: ") and message.count("\n") == 1, message

    run()
