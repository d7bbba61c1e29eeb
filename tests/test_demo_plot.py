"""`sidecar demo --plot PATH`: the picture holds one point per step of every series (reward from step 0;
sync, audit, sleep and wake from step 1), as a PNG through matplotlib or a hand-written SVG without it;
a bad PATH is refused before the sidecar starts. The demo run itself: tests/test_demo.py."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from sidecar.cli.main import main
from sidecar.demo import plot as demo_plot
from tests.helpers_plot import plotted_points

STEPS = 6
TIMED = ("sync_ms", "audit_ms", "sleep_ms", "wake_ms")


def rows(failed_step: int | None = None) -> list[dict[str, Any]]:
    """demo_loop's rows: step 0 (rollouts before training) has a reward only."""
    out: list[dict[str, Any]] = [{"step": 0, "reward": 0.125, "sync_ms": None, "audit": "-", "sleep_ms": None,
                                  "wake_ms": None, "version": 0, "audit_ms": None}]
    for s in range(1, STEPS + 1):
        out.append({"step": s, "reward": 0.125 + 0.05 * s, "sync_ms": 30.0 + s, "audit": "ok", "sleep_ms": 2.5 * s,
                    "wake_ms": 7.0, "version": s, "audit_ms": 11.0 + s / 4})
    if failed_step is not None:
        out[failed_step]["audit"] = "failed"
    return out


def expected_points() -> dict[str, list[tuple[int, float]]]:
    want = {"reward": [(r["step"], r["reward"]) for r in rows()]}
    want.update({k: [(r["step"], r[k]) for r in rows()[1:]] for k in TIMED})
    return want


def test_the_svg_holds_one_point_per_step_of_every_series(tmp_path: Path) -> None:
    written = demo_plot.plot_run(rows(), tmp_path / "run.svg")
    assert written == tmp_path / "run.svg"
    assert plotted_points(written) == expected_points()
    assert len(plotted_points(written)["reward"]) == STEPS + 1 and len(plotted_points(written)["sync_ms"]) == STEPS


def test_the_svg_is_self_contained_and_colours_a_failed_audit(tmp_path: Path) -> None:
    text = demo_plot.plot_run(rows(failed_step=3), tmp_path / "run.svg").read_text()
    root = ET.fromstring(text)  # well-formed XML, nothing fetched: no href, no script, no external font
    assert root.tag == "{http://www.w3.org/2000/svg}svg" and "href" not in text and "<script" not in text
    fills = {int(c.attrib["data-step"]): c.attrib["fill"] for c in root.iter("{http://www.w3.org/2000/svg}circle")
             if c.attrib["data-series"] == "reward"}
    assert fills[3] == demo_plot.FAILED and fills[2] == fills[4] == demo_plot.PASSED
    assert fills[0] not in (demo_plot.FAILED, demo_plot.PASSED)  # step 0 had no audit


def test_png_without_matplotlib_writes_the_svg_beside_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(demo_plot, "_has_matplotlib", lambda: False)
    written = demo_plot.plot_run(rows(), tmp_path / "run.png")
    assert written == tmp_path / "run.svg" and not (tmp_path / "run.png").exists()
    assert plotted_points(written) == expected_points()


def test_png_with_matplotlib_holds_one_point_per_step(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")  # the `plot` extra; dev installs it, so CI runs this
    written = demo_plot.plot_run(rows(), tmp_path / "run.png")
    assert written == tmp_path / "run.png" and written.read_bytes()[:4] == b"\x89PNG"
    assert plotted_points(written) == expected_points()


@pytest.mark.parametrize(("plot", "message"), [("run.jpg", "a .png or an .svg"),
                                                ("missing/run.png", "does not exist")])
def test_a_bad_plot_path_is_refused_before_launching(plot: str, message: str, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--device", "cpu", "--plot", str(tmp_path / plot)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sidecar demo: error: plot: --plot") and message in err


def test_a_plot_path_without_extension_gets_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # --help promises PATH.png (or PATH.svg without matplotlib) for a PATH given without extension
    monkeypatch.setattr(demo_plot, "_has_matplotlib", lambda: False)
    assert demo_plot.plot_run(rows(), tmp_path / "run") == tmp_path / "run.svg"
    assert plotted_points(tmp_path / "run.svg") == expected_points()


def test_a_plot_path_without_extension_is_accepted_before_launching(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    # the check passes PATH and the next one (the model) refuses: nothing is launched either way
    missing = tmp_path / "no-model"
    assert main(["demo", "--device", "cpu", "--plot", str(tmp_path / "run"), "--model", str(missing)]) == 2
    err = capsys.readouterr().err
    assert "plot" not in err.split("error:", 1)[1].split(":", 1)[0] and "no-model" in err
