"""The OpenAPI schema `/openapi.json` serves, made true to what the server answers.

FastAPI's generated schema documents a 422 with its own validation-error body for every route
that takes a body; this server answers bad requests with 400 and OpenAI's error shape
(errors.py), as OpenAI and vLLM do, and sends `/metrics` as Prometheus text. So the schema is
rewritten once: every 422 becomes a 400 with the error body, every operation documents that body
for its other errors (401 with an API key, 400 for a Host not allowed, 404, 405, 408, 413, 429,
500, 503), and `/metrics` is `text/plain`.
"""

from __future__ import annotations

from typing import Any, Callable

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from engine.server.metrics import CONTENT_TYPE

ERROR_SCHEMA = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": "integer"}}}},
}


def _error(description: str) -> dict[str, Any]:
    return {"description": description,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}


def rewrite(schema: dict[str, Any]) -> dict[str, Any]:
    """FastAPI's schema -> the served one (see the module docstring); changes `schema`."""
    schema.setdefault("components", {}).setdefault("schemas", {})["Error"] = ERROR_SCHEMA
    for path, methods in schema.get("paths", {}).items():
        for op in methods.values():
            responses = op.setdefault("responses", {})
            if responses.pop("422", None) is not None:
                responses["400"] = _error("The request is malformed or a field is invalid")
            responses["default"] = _error("Any other error, in OpenAI's shape")
            if path == "/metrics":
                responses["200"]["content"] = {CONTENT_TYPE: {"schema": {"type": "string"}}}
    schemas = schema["components"]["schemas"]
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    return schema


def install(app: FastAPI) -> Callable[[], dict[str, Any]]:
    """Makes `app` serve the rewritten schema (built once, on first request)."""
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = rewrite(get_openapi(title=app.title, version=app.version,
                                                     routes=app.routes))
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return openapi
