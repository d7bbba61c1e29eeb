"""`sidecar demo --plot PATH`: one picture of the run, a point per step, for people who would rather look
than read: the reward (each point coloured by that step's audit: green passed, red failed) above the
sync, audit, sleep and wake times in milliseconds.

A PNG through matplotlib when it is installed (the optional extra: `pip install 'sidecar[plot]'`),
else an SVG written here by hand, so the demo needs nothing new. PATH ends in .png or .svg, or has no
extension (then .png is appended); .svg always gives the hand-written SVG, and .png without matplotlib
gives the SVG beside it (PATH with .svg), which `plot_run` returns and the demo prints. Either file
carries the numbers it shows: the SVG one <circle> per point with data-series, data-step and
data-value; the PNG a text chunk "sidecar-demo" holding them as JSON, so a script (or a test) reads
what was drawn without reading pixels.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape, quoteattr

REWARD = ("reward", "reward", "#1f77b4")
TIMINGS = (("sync_ms", "sync", "#ff7f0e"), ("audit_ms", "audit", "#9467bd"), ("sleep_ms", "sleep", "#8c564b"),
           ("wake_ms", "wake", "#17becf"))
PASSED, FAILED = "#2ca02c", "#d62728"
SUFFIXES = (".png", ".svg")
PNG_KEY = "sidecar-demo"

Points = list[tuple[int, float]]


def plot_run(rows: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Write the picture of `rows` (sidecar/demo/loop.py's per-step rows) and return the path written."""
    path = with_extension(Path(path))
    assert path.suffix.lower() in SUFFIXES, path  # sidecar/cli/demo.py refuses others before the run
    data = series(rows)
    if path.suffix.lower() == ".png" and _has_matplotlib():
        _write_png(data, path)
        return path
    out = path.with_suffix(".svg")
    out.write_text(render_svg(data), encoding="utf-8")
    return out


def with_extension(path: Path) -> Path:
    """PATH as given when it names its picture's type; PATH.png when it has no extension at all."""
    return path if path.suffix else path.with_name(path.name + ".png")


def series(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """{key: [(step, value)], "audit": [(step, verdict)]}: one point per step that has the value (step
    0, the rollouts before any training, has a reward only)."""
    out: dict[str, Any] = {}
    for key, _, _ in (REWARD, *TIMINGS):
        out[key] = [(int(r["step"]), float(r[key])) for r in rows if r.get(key) is not None]
    out["audit"] = [(int(r["step"]), r.get("audit")) for r in rows]
    return out


def _audit_colour(verdict: Any) -> str:
    """Green for a passed audit, red for any other verdict; step 0 (no sync, no audit: "-") keeps the line's."""
    if verdict is None or verdict == "-":
        return REWARD[2]
    return PASSED if verdict == "ok" else FAILED


def _has_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


# ---- PNG (matplotlib, no pyplot: no global figure state, no display) ---------------------------------
def _write_png(data: dict[str, Any], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 6), dpi=100)
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True)
    steps, values = zip(*data["reward"]) if data["reward"] else ((), ())
    verdicts = dict(data["audit"])
    top.plot(steps, values, color=REWARD[2], zorder=1)
    top.scatter(steps, values, c=[_audit_colour(verdicts.get(s)) for s in steps], zorder=2)
    top.set_ylabel("reward")
    top.set_title("sidecar demo: reward per step (green: audit passed, red: failed)")
    for key, label, colour in TIMINGS:
        if data[key]:
            xs, ys = zip(*data[key])
            bottom.plot(xs, ys, marker="o", color=colour, label=label)
    bottom.set_ylim(bottom=0)
    bottom.set_ylabel("ms")
    bottom.set_xlabel("step")
    bottom.legend(loc="best")
    fig.tight_layout()
    fig.savefig(path, format="png", metadata={PNG_KEY: json.dumps(data)})


# ---- SVG by hand ----------------------------------------------------------------------------------
WIDTH, HEIGHT, LEFT, RIGHT, PANEL, GAP, TOP = 720, 540, 60, 110, 190, 60, 50


def render_svg(data: dict[str, Any]) -> str:
    """A self-contained SVG: two panels (reward; timings in ms) sharing the step axis."""
    all_steps = [s for key in data if key != "audit" for s, _ in data[key]] or [0]
    x_range = (min(all_steps), max(max(all_steps), min(all_steps) + 1))
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
             f'viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">',
             f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
             f'<text x="{LEFT}" y="20" font-size="14">sidecar demo, per step</text>']
    verdicts = dict(data["audit"])
    reward_colours = [_audit_colour(verdicts.get(s)) for s, _ in data["reward"]]
    parts += _panel(TOP, "reward (dots: green audit passed, red failed)", x_range,
                    [(REWARD, data["reward"], reward_colours)])
    timings = [(spec, data[spec[0]], None) for spec in TIMINGS]
    parts += _panel(TOP + PANEL + GAP, "milliseconds", x_range, timings, zero=True)
    parts.append(f'<text x="{(LEFT + WIDTH - RIGHT) / 2:.0f}" y="{HEIGHT - 8}" text-anchor="middle">step</text>')
    parts.append("</svg>\n")
    return "\n".join(parts)


def _panel(y0: int, unit: str, x_range: tuple[int, int],
           lines: list[tuple[tuple[str, str, str], Points, list[str] | None]], zero: bool = False) -> list[str]:
    """Axes, ticks, one polyline and one circle per point for each series, and a legend on the right."""
    values = [v for _, pts, _ in lines for _, v in pts] or [0.0]
    lo, hi = (0.0 if zero else min(values)), max(values)
    if hi - lo < 1e-9:
        lo, hi = lo - 0.5, hi + 0.5
    x1 = WIDTH - RIGHT

    def x(step: float) -> float:
        return LEFT + (step - x_range[0]) / (x_range[1] - x_range[0]) * (x1 - LEFT)

    def y(value: float) -> float:
        return y0 + PANEL - (value - lo) / (hi - lo) * PANEL

    out = [f'<g class="panel" data-unit={quoteattr(unit)}>',
           f'<line x1="{LEFT}" y1="{y0 + PANEL}" x2="{x1}" y2="{y0 + PANEL}" stroke="black"/>',
           f'<line x1="{LEFT}" y1="{y0}" x2="{LEFT}" y2="{y0 + PANEL}" stroke="black"/>',
           f'<text x="{LEFT}" y="{y0 - 8}">{escape(unit)}</text>']
    for value in (lo, (lo + hi) / 2, hi):
        out.append(f'<text x="{LEFT - 6}" y="{y(value) + 4:.1f}" text-anchor="end">{value:.3g}</text>')
    stride = -(-(x_range[1] - x_range[0]) // 10)  # at most about 10 step labels
    for step in range(x_range[0], x_range[1] + 1, stride):
        out.append(f'<text x="{x(step):.1f}" y="{y0 + PANEL + 16}" text-anchor="middle">{step}</text>')
    for i, ((key, label, colour), points, colours) in enumerate(lines):
        if points:
            path = " ".join(f"{x(s):.1f},{y(v):.1f}" for s, v in points)
            out.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="1.5"/>')
        for j, (s, v) in enumerate(points):
            fill = colours[j] if colours is not None else colour
            out.append(f'<circle class="point" data-series="{key}" data-step="{s}" data-value="{v!r}" '
                       f'cx="{x(s):.1f}" cy="{y(v):.1f}" r="4" fill="{fill}"><title>{escape(label)} at step {s}: '
                       f'{v:.4g}</title></circle>')
        ly = y0 + 14 + 18 * i
        out.append(f'<line x1="{x1 + 12}" y1="{ly - 4}" x2="{x1 + 30}" y2="{ly - 4}" stroke="{colour}" '
                   'stroke-width="3"/>')
        out.append(f'<text x="{x1 + 36}" y="{ly}">{escape(label)}</text>')
    out.append("</g>")
    return out
