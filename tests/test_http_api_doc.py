"""docs/http-api.md is the HTTP API as the app's OpenAPI schema declares it: a route or body model that
changes without its page regenerated (`python3 -m scripts.tools.http_api_doc`) fails here."""

from __future__ import annotations

from scripts.tools.http_api_doc import COMMAND, PAGE, metric_families, openapi_schema, render


def test_the_checked_in_http_api_page_is_the_schema_s() -> None:
    schema = openapi_schema()
    assert PAGE.read_text() == render(schema, metric_families()), f"{PAGE} is stale: run `{COMMAND}` and commit it"


def test_the_page_lists_every_route_and_its_body() -> None:
    schema = openapi_schema()
    page = render(schema, metric_families())
    for path, item in schema["paths"].items():
        for method in ("get", "post", "delete"):
            if method in item:
                assert f"### {method.upper()} {path}\n" in page, (method, path)
    assert "### POST /weights/update\n" in page and "Body: `WeightsUpdateRequest`" in page
    assert "| `prompt` |" in page and "### ErrorResponse\n" in page


def test_the_page_lists_every_metric_family() -> None:
    names = [name for name, _, _ in metric_families()]
    page = render(openapi_schema(), metric_families())
    for name in names:
        assert f"| `{name}` |" in page, name
    assert {"sidecar_generated_tokens_total", "sidecar_draft_tokens_accepted_total", "sidecar_preemptions_total",
            "sidecar_weight_sync_seconds", "sidecar_rollout_pool_sequences"} <= set(names)
