"""Write docs/http-api.md, the HTTP API reference, from the app's own OpenAPI schema.

The app is built as `sidecar launch` builds it (sidecar/api/app.py create_app), over a driver that is never
called and a placeholder startup plan: the schema depends only on the routes and their body models, so no
rank, model or port is needed. The page lists every route (method, path, summary, body fields, answers),
every metric family of /metrics, and then every schema. tests/test_http_api_doc.py fails when the
checked-in page differs from what this writes, so a changed route or body model comes with its regenerated
page.

    python3 -m scripts.tools.http_api_doc            # rewrite docs/http-api.md
    python3 -m scripts.tools.http_api_doc --check    # exit 1 if docs/http-api.md is stale
"""

from __future__ import annotations

import argparse
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a file from a checkout too

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "http-api.md"
COMMAND = "python3 -m scripts.tools.http_api_doc"
METHODS = ("get", "post", "put", "patch", "delete")
OPEN_PATHS = {"/health", "/metrics"}  # sidecar/api/app.py: no key needed


class _NoDriver:
    """Stands where the rank driver would; building the schema never reaches it. As the metrics' source it
    reads as a fresh sidecar (zeros, no model held), so a scrape lists every metric family."""

    tokens_total, failure, paused = 0, None, False

    def __init__(self) -> None:
        from sidecar.ranks.driver import ENGINE_COUNTERS

        self.engine_counters = dict.fromkeys(ENGINE_COUNTERS, 0)

    def tokens_per_second(self) -> float:
        return 0.0

    def queue_depth(self) -> int:
        return 0

    def queued_sequences(self) -> int:
        return 0

    def held_weights(self) -> dict[str, dict[str, Any]]:
        return {}

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"the schema build reached the driver ({name}); it must not need ranks")


def _app() -> tuple[Any, Any]:
    """The app `sidecar launch` serves and its metrics, built without ranks."""
    from sidecar.api.app import ServerState, create_app
    from sidecar.api.metrics import Metrics
    from sidecar.config import LaunchConfig
    from sidecar.ranks.commands import RankPlan

    plan = RankPlan(rank="dp0:pp0:tp0", pid=0, device="cpu", weights_bytes={}, kv_blocks=1, kv_bytes=1,
                    vocab_size=1, max_model_len=1, model="model", draft_model=None, models=["target"],
                    dtype="float32", block_size=16, has_tokenizer=False, num_threads=1)
    driver = _NoDriver()
    state = ServerState(driver, LaunchConfig(), [plan], Metrics(driver))  # type: ignore[arg-type]
    return create_app(state), state.metrics  # the text pool's threads start on first use: none here


def openapi_schema() -> dict[str, Any]:
    """The schema `sidecar launch` serves at /openapi.json, built without ranks."""
    with warnings.catch_warnings():  # GET and HEAD /health share a function, so FastAPI warns of its operation id
        warnings.filterwarnings("ignore", message="Duplicate Operation ID", category=UserWarning)
        return _app()[0].openapi()


def metric_families() -> list[tuple[str, str, str]]:
    """(name as scraped, type, help) of every metric family GET /metrics serves, in scrape order."""
    _, metrics = _app()
    out = []
    for family in metrics.registry.collect():
        name = family.name + ("_total" if family.type == "counter" else "")
        out.append((name, family.type, family.documentation))
    return out


def _type(s: dict[str, Any]) -> str:
    """A schema's type in one short phrase: `int`, `list[str]`, `GenerateRequest`, `str | null`."""
    if "$ref" in s:
        return s["$ref"].rsplit("/", 1)[-1]
    for key in ("anyOf", "oneOf"):
        if key in s:
            return " | ".join(_type(x) for x in s[key])
    if "allOf" in s and len(s["allOf"]) == 1:
        return _type(s["allOf"][0])
    if "const" in s:
        return repr(s["const"])
    if "enum" in s:
        return " | ".join(repr(v) for v in s["enum"])
    kind = s.get("type")
    if kind == "array":
        return f"list[{_type(s.get('items', {}))}]"
    if kind == "object":
        extra = s.get("additionalProperties")
        return f"dict[str, {_type(extra)}]" if isinstance(extra, dict) and extra else "object"
    names = {"integer": "int", "number": "float", "string": "str", "boolean": "bool", "null": "null"}
    return names.get(str(kind), str(kind) if kind else "any")


def _cell(text: Any) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _limits(s: dict[str, Any]) -> str:
    parts = [f"{label} {s[key]}" for key, label in (("minimum", ">="), ("exclusiveMinimum", ">"),
                                                    ("maximum", "<="), ("exclusiveMaximum", "<"),
                                                    ("minLength", "length >="), ("maxLength", "length <="),
                                                    ("minItems", "items >="), ("maxItems", "items <="))
             if key in s]
    return ", ".join(parts)


def _fields(model: dict[str, Any]) -> list[str]:
    props = model.get("properties", {})
    if not props:
        return []
    required = set(model.get("required", []))
    rows = ["| field | type | required | default | description |", "| --- | --- | --- | --- | --- |"]
    for name, s in props.items():
        default = f"`{s['default']!r}`" if "default" in s else ""
        desc = "; ".join(x for x in (s.get("description", ""), _limits(s)) if x)
        rows.append(f"| `{name}` | `{_cell(_type(s))}` | {'yes' if name in required else ''} | {_cell(default)} "
                    f"| {_cell(desc)} |")
    return rows


def _body(op: dict[str, Any]) -> str | None:
    content = op.get("requestBody", {}).get("content", {})
    for mime, media in content.items():
        return f"`{_type(media.get('schema', {}))}` ({mime})"
    return None


def _answers(op: dict[str, Any]) -> list[str]:
    out = []
    for status, r in op.get("responses", {}).items():
        kinds = [f"`{_type(m.get('schema', {}))}`" for m in r.get("content", {}).values() if m.get("schema")]
        out.append(f"- {status}: {_cell(r.get('description', ''))}" + (f" ({', '.join(kinds)})" if kinds else ""))
    return out


def _route(path: str, method: str, op: dict[str, Any]) -> list[str]:
    lines = [f"### {method.upper()} {path}", ""]
    if op.get("summary"):
        lines += [_cell(op["summary"]) + ".", ""]
    if op.get("description"):
        lines += [op["description"].strip(), ""]
    params = op.get("parameters", [])
    if params:
        lines += ["Parameters: " + ", ".join(f"`{p['name']}` ({p.get('in')}, `{_type(p.get('schema', {}))}`"
                                             f"{', required' if p.get('required') else ''})" for p in params), ""]
    body = _body(op)
    if body:
        lines += [f"Body: {body}.", ""]
    lines += ["Answers:", *_answers(op), ""]
    return lines


def render(schema: dict[str, Any], metrics: list[tuple[str, str, str]]) -> str:
    """The whole page, deterministic for one schema and one list of metric families."""
    info = schema.get("info", {})
    intro = [
        f"Generated from the OpenAPI schema of `sidecar launch` ({info.get('title')} {info.get('version')}) by "
        f"`{COMMAND}`; do not edit by hand. A running sidecar serves the same schema at `/openapi.json` and "
        "an interactive page at `/docs`.",
        "Every endpoint needs `Authorization: Bearer KEY` when the sidecar has an API key (`--api-key` or "
        "SIDECAR_API_KEY), except " + " and ".join(f"`GET {p}`" for p in sorted(OPEN_PATHS)) + ". Every error "
        'is `{"error": {"type", "message", "field", "rank", "param", "code"}}` (`ErrorResponse`): 400 a bad '
        "value, 401 a missing or wrong key, 404 an unknown route or model, 409 a state conflict (asleep, torn), "
        "413 a body too large, 422 a wrong type or unknown field, 429 too many queued sequences, 502 the weight "
        "wire failed, 503 a rank is dead or hung, 507 not enough device memory to wake. The OpenAI-compatible "
        "routes are described for clients in docs/openai.md, the limits in docs/limits.md.",
    ]
    lines = ["# HTTP API", ""]
    for paragraph in intro:
        lines += [*textwrap.wrap(paragraph, 110, break_on_hyphens=False), ""]
    lines += ["## Routes", ""]
    for path, item in schema.get("paths", {}).items():
        for method in METHODS:
            if method in item:
                lines += _route(path, method, item[method])
    about = ("What `GET /metrics` serves (Prometheus text; counters carry `_total`, histograms `_bucket`, `_sum` "
             "and `_count`; per-model and per-phase families carry labels):")
    lines += ["## Metrics", "", *textwrap.wrap(about, 110, break_on_hyphens=False), "",
              "| metric | type | meaning |", "| --- | --- | --- |"]
    lines += [f"| `{name}` | {kind} | {_cell(doc)} |" for name, kind, doc in metrics] + [""]
    lines += ["## Schemas", ""]
    for name, model in sorted(schema.get("components", {}).get("schemas", {}).items()):
        lines += [f"### {name}", ""]
        if model.get("description"):
            lines += [model["description"].strip(), ""]
        rows = _fields(model)
        lines += [*(rows or [f"`{_cell(_type(model))}`"]), ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 when the page differs from the schema")
    ap.add_argument("--out", type=Path, default=PAGE, help="where the page goes (default: docs/http-api.md)")
    args = ap.parse_args(argv)
    page = render(openapi_schema(), metric_families())
    if args.check:
        current = args.out.read_text() if args.out.exists() else ""
        if current != page:
            print(f"{args.out} is stale: run `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    args.out.write_text(page)
    print(f"wrote {args.out} ({len(page.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
