"""engine/server/openapi.py without a server: the served schema documents what the server
answers (the served schema itself is checked over HTTP in tests/test_serve.py)."""

from __future__ import annotations


def test_openapi_rewrite_documents_the_errors_the_server_sends():
    """FastAPI's 422 validation responses become the 400 OpenAI-shaped errors the server sends,
    every operation documents that body for its other errors, and /metrics is Prometheus text."""
    from engine.server import openapi
    from engine.server.metrics import CONTENT_TYPE

    schema = {"paths": {
        "/v1/completions": {"post": {"responses": {"200": {}, "422": {"description": "x"}}}},
        "/metrics": {"get": {"responses": {"200": {"content": {"application/json": {}}}}}}},
        "components": {"schemas": {"HTTPValidationError": {}, "ValidationError": {}}}}
    out = openapi.rewrite(schema)
    post = out["paths"]["/v1/completions"]["post"]["responses"]
    assert "422" not in post and set(post) == {"200", "400", "default"}
    assert post["400"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/Error"}
    assert out["components"]["schemas"] == {"Error": openapi.ERROR_SCHEMA}
    assert list(out["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == [CONTENT_TYPE]
