"""docs/http-api.md is the HTTP API as the app's OpenAPI schema declares it: a route or body model that
changes without its page regenerated (`python3 -m scripts.tools.http_api_doc`) fails here."""

from __future__ import annotations

from scripts.tools.http_api_doc import COMMAND, PAGE, openapi_schema, render


def test_the_checked_in_http_api_page_is_the_schema_s() -> None:
    schema = openapi_schema()
    assert PAGE.read_text() == render(schema), f"{PAGE} is stale: run `{COMMAND}` and commit it"


def test_the_page_lists_every_route_and_its_body() -> None:
    schema = openapi_schema()
    page = render(schema)
    for path, item in schema["paths"].items():
        for method in ("get", "post", "delete"):
            if method in item:
                assert f"### {method.upper()} {path}\n" in page, (method, path)
    assert "### POST /weights/update\n" in page and "Body: `WeightsUpdateRequest`" in page
    assert "| `prompt` |" in page and "### ErrorResponse\n" in page
