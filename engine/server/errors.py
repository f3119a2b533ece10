"""Errors as OpenAI's API returns them, and the handlers that make every failure one of them.

Every error the server sends has OpenAI's shape::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "top_p", "code": 400}}

with the matching HTTP status. Unexpected exceptions are logged with their traceback on the server
and reach the client only as a generic 500 message with `Connection: close` (the server ends the
connection after it): no traceback ever leaves the process. A request-validation error reads
"<field>: expected <what>, got <value>"; text that cannot be encoded (a lone surrogate) is sent
escaped, so an error body always serialises.
"""

from __future__ import annotations

import logging
import reprlib
from typing import Any, Callable, Optional

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


#: The pydantic error type of text that is not valid Unicode (`protocol.check_unicode`); its
#: context names the field.
INVALID_UNICODE = "invalid_unicode"


def encodable(text: str) -> str:
    """`text` with every character UTF-8 cannot encode (lone surrogates) written as a
    backslash escape, so that it can always be sent."""
    if text.isascii():
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(status: int, message: str, param: Optional[str] = None) -> dict[str, Any]:
    """OpenAI's error JSON for `status`; `message` and `param` made `encodable`."""
    return {"error": {"message": encodable(str(message)),
                      "type": _TYPES.get(status, "invalid_request_error"),
                      "param": None if param is None else encodable(str(param)),
                      "code": status}}


def error_response(status: int, message: str, param: Optional[str] = None,
                   headers: Optional[dict[str, str]] = None) -> JSONResponse:
    """A JSONResponse carrying `error_body(status, message, param)`; a 429 or 503 carries
    `Retry-After` (RETRY_AFTER_S) unless `headers` gives one."""
    headers = dict(headers or {})
    if status in RETRY_AFTER_S and not any(k.lower() == "retry-after" for k in headers):
        headers["Retry-After"] = str(RETRY_AFTER_S[status])
    return JSONResponse(error_body(status, message, param), status_code=status,
                        headers=headers or None)


_SHOW = reprlib.Repr()
_SHOW.maxstring, _SHOW.maxother, _SHOW.maxlist, _SHOW.maxdict, _SHOW.maxlevel = 60, 60, 6, 4, 2

#: pydantic error type -> what the field expects, in the API's words (from the error context).
_EXPECTED: dict[str, Callable[[dict[str, Any]], str]] = {
    "greater_than_equal": lambda c: f"a value >= {c['ge']}",
    "greater_than": lambda c: f"a value > {c['gt']}",
    "less_than_equal": lambda c: f"a value <= {c['le']}",
    "less_than": lambda c: f"a value < {c['lt']}",
    "int_type": lambda c: "an integer",
    "float_type": lambda c: "a number",
    "string_type": lambda c: "a string",
    "bool_type": lambda c: "true or false",
    "list_type": lambda c: "a list",
    "dict_type": lambda c: "an object",
    "model_type": lambda c: "an object",
    "model_attributes_type": lambda c: "an object",
    "literal_error": lambda c: f"one of {c['expected']}",
    "too_short": lambda c: f"at least {c['min_length']} item(s)",
    "too_long": lambda c: f"at most {c['max_length']} item(s)",
}


def _field(loc: tuple[Any, ...]) -> str:
    """The dotted field path of a pydantic `loc` ("messages.0.content"), without the "body"
    root and the union-member tags pydantic inserts ("str", "list[int]")."""
    parts = [str(x) for x in loc if x != "body"
             and not (isinstance(x, str) and (x in ("str", "int", "float", "bool") or "[" in x
                                              or x[:1].isupper()))]
    return encodable(".".join(parts))


def _describe_validation(exc: RequestValidationError) -> tuple[str, Optional[str]]:
    """One clause per field at fault ("<field>: expected <what>, got <value>"; the
    expectations of a union's members joined by "or") and the first field at fault as `param`.
    Only the value is echoed, shortened and escaped, never anything of the server's."""
    expected: dict[str, list[str]] = {}
    given: dict[str, str] = {}
    notes: list[str] = []
    for err in exc.errors():
        ctx = err.get("ctx") or {}
        kind = err.get("type", "")
        if kind == INVALID_UNICODE:
            return encodable(err.get("msg", "")), str(ctx.get("field"))
        if kind == "json_invalid":
            notes.append(f"malformed JSON body: {ctx.get('error', 'could not be parsed')}")
            continue
        field = _field(tuple(err.get("loc", ())))
        what = "a value (the field is required)" if kind == "missing" else (
            _EXPECTED[kind](ctx) if kind in _EXPECTED else err.get("msg", "a valid value"))
        if what not in expected.setdefault(field, []):
            expected[field].append(what)
        given.setdefault(field, "nothing" if kind == "missing"
                         else _SHOW.repr(err.get("input")))
    clauses = [f"{f + ': ' if f else ''}expected {' or '.join(w)}, got {given[f]}"
               for f, w in list(expected.items())[:5]]
    param = next(iter(expected), None)
    return "; ".join(notes + clauses) or "invalid request", (param or None)


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
    # Starlette re-raises the exception after this response and the server then drops the
    # connection: saying so lets a keep-alive client open a new one instead of failing.
    return error_response(500, "internal server error; see the server log",
                          headers={"Connection": "close"})


def install_error_handlers(app: FastAPI) -> None:
    """Routes every exception the app can raise to an OpenAI-shaped error response."""
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected)
