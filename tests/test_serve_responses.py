"""engine/server/responses.py without a server: stream chunks encoded with their fixed fields
encoded once are the events of the whole chunk."""

from __future__ import annotations

import json

import pytest

from engine.server import responses as R


@pytest.mark.parametrize("extra", [None, {"usage": None}])
def test_chunk_encoder_events_are_the_whole_chunk(extra):
    fixed = {"id": 'cmpl-"é\\', "object": "text_completion", "created": 7, "model": "m/ü"}
    encoder = R.ChunkEncoder({**fixed, "choices": []}, extra)
    for choices in ([], [R.completion_choice(0, 'a "quoted"\nline é', None, None, None)],
                    [R.completion_choice(1, "", {"tokens": ["x"]}, "stop", "\n\n")]):
        event = encoder.event(choices)
        assert event.startswith(b"data: ") and event.endswith(b"\n\n")
        body = json.loads(event[len(b"data: "):-2].decode("utf-8"))
        assert body == {**fixed, "choices": choices, **(extra or {})}
        assert list(body) == [*fixed, "choices", *(extra or {})]  # the order OpenAI sends
        assert event == R.sse({**fixed, "choices": choices, **(extra or {})})


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
