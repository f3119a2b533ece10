"""Errors as OpenAI's API returns them, and the handlers that make every failure one of them.

Every error the server sends has OpenAI's shape::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "top_p", "code": 400}}

with the matching HTTP status. Unexpected exceptions are logged with their traceback on the server
and reach the client only as a generic 500 message: no traceback ever leaves the process.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("engine.serve")

#: Seconds a client is told to wait (`Retry-After`) before retrying after a 429 (the queue is
#: full) or a 503 (loading, draining); sent unless the error names its own.
RETRY_AFTER_S = {429: 1, 503: 5}

#: HTTP status -> OpenAI's error `type`.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error the client caused or must be told about: `status` (HTTP), `message` (what was
    expected and what was given), and `param`, the request field at fault (None if none)."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 headers: Optional[dict[str, str]] = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers


def error_body(status: int, message: str, param: Optional[str] = None) -> dict[str, Any]:
    """OpenAI's error JSON for `status`."""
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": status}}


def error_response(status: int, message: str, param: Optional[str] = None,
                   headers: Optional[dict[str, str]] = None) -> JSONResponse:
    """A JSONResponse carrying `error_body(status, message, param)`; a 429 or 503 carries
    `Retry-After` (RETRY_AFTER_S) unless `headers` gives one."""
    headers = dict(headers or {})
    if status in RETRY_AFTER_S and not any(k.lower() == "retry-after" for k in headers):
        headers["Retry-After"] = str(RETRY_AFTER_S[status])
    return JSONResponse(error_body(status, message, param), status_code=status,
                        headers=headers or None)


def _describe_validation(exc: RequestValidationError) -> tuple[str, Optional[str]]:
    """One readable line per pydantic error (field path, problem, the value given) and the first
    field at fault. Only the value is echoed, never anything from the server's internals."""
    parts, param = [], None
    for err in exc.errors()[:5]:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        field = ".".join(loc)
        if err.get("type") == "json_invalid":
            ctx = err.get("ctx") or {}
            parts.append(f"malformed JSON body: {ctx.get('error', 'could not be parsed')}")
            continue
        if param is None and loc:
            param = loc[0]
        given = err.get("input")
        shown = repr(given)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        where = f"{field}: " if field else ""
        if err.get("type") == "missing":
            parts.append(f"{where}field required")
        else:
            parts.append(f"{where}{err.get('msg', 'invalid value')} (got {shown})")
    return "; ".join(parts) or "invalid request", param


async def _on_api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    headers = dict(exc.headers or {})
    if exc.status == 401:
        headers.setdefault("WWW-Authenticate", "Bearer")
    return error_response(exc.status, exc.message, exc.param, headers)


async def _on_validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    message, param = _describe_validation(exc)
    return error_response(400, message, param)


async def _on_http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    detail = exc.detail if isinstance(exc.detail, str) else "request failed"
    if exc.status_code == 404:
        detail = f"no route {request.method} {request.url.path}"
    # Starlette's headers go out too: a 405 must say which methods the path takes (`Allow`,
    # RFC 9110).
    return error_response(exc.status_code, detail, headers=getattr(exc, "headers", None))


async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error in %s %s", request.method, request.url.path)
    return error_response(500, "internal server error; see the server log")


def install_error_handlers(app: FastAPI) -> None:
    """Routes every exception the app can raise to an OpenAI-shaped error response."""
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected)
