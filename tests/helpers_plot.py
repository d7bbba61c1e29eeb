"""Read back what `sidecar demo --plot` drew: {series: [(step, value)]} from its SVG circles or PNG text chunk."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def plotted_points(path: Path) -> dict[str, list[tuple[int, float]]]:
    """The points of every series in the picture (the audit verdicts are not points)."""
    data = path.read_bytes()
    if path.suffix == ".svg":
        root = ET.fromstring(data)
        points: dict[str, list[tuple[int, float]]] = {}
        for c in root.iter("{http://www.w3.org/2000/svg}circle"):
            points.setdefault(c.attrib["data-series"], []).append((int(c.attrib["data-step"]),
                                                                   float(c.attrib["data-value"])))
        return points
    assert data.startswith(PNG_SIGNATURE), data[:8]
    drawn = json.loads(_png_text(data)["sidecar-demo"])
    return {k: [(int(s), float(v)) for s, v in pts] for k, pts in drawn.items() if k != "audit"}


def _png_text(data: bytes) -> dict[str, str]:
    """The tEXt chunks of a PNG (keyword -> text), read by the format's rules: no imaging library needed."""
    out, pos = {}, len(PNG_SIGNATURE)
    while pos < len(data):
        length = int.from_bytes(data[pos:pos + 4], "big")
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        if kind == b"tEXt":
            key, _, text = body.partition(b"\0")
            out[key.decode("latin-1")] = text.decode("latin-1")
        pos += 12 + length  # length, type, data, crc
    return out
