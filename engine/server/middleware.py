"""ASGI guards in front of every route: the API key and the request-body size limit.

They run before FastAPI parses anything, so a request without the key or with an oversized body
costs no JSON parsing. `/health` is open without a key (load balancers probe it).
"""

from __future__ import annotations

import hmac
import json
from typing import Any, Awaitable, Callable, Optional

from engine.server.errors import error_body

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: Paths that need no API key.
OPEN_PATHS = frozenset({"/health", "/openapi.json"})
#: An oversized body is read and dropped up to this many bytes (so the client sees the 413
#: instead of a reset connection); beyond it the connection is closed.
_DRAIN_LIMIT = 64 * 1024 * 1024


async def _send_error(send: Send, status: int, message: str,
                      extra_headers: Optional[list[tuple[bytes, bytes]]] = None) -> None:
    body = json.dumps(error_body(status, message)).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode()), *(extra_headers or [])]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _header(scope: Scope, name: bytes) -> Optional[bytes]:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value
    return None


class GuardMiddleware:
    """401 without `Authorization: Bearer <api_key>` (when a key is set), 413 for a body over
    `max_body_bytes`; other requests pass through with their body replayed."""

    def __init__(self, app: ASGIApp, api_key: Optional[str], max_body_bytes: int) -> None:
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if not self._authorized(scope):
            await _send_error(send, 401, "missing or wrong API key: send the header "
                              "'Authorization: Bearer <key>'",
                              [(b"www-authenticate", b"Bearer")])
            return
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await self._drain(receive)
            await self._too_large(send, int(declared))
            return
        body, size, more = await self._read_body(receive)
        if body is None:
            if more:
                await self._drain(receive)
            await self._too_large(send, size)
            return
        await self.app(scope, _replay(body, receive), send)

    def _authorized(self, scope: Scope) -> bool:
        if self.api_key is None or scope.get("path") in OPEN_PATHS:
            return True
        value = (_header(scope, b"authorization") or b"").decode("latin-1")
        scheme, _, token = value.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(),
                                                                  self.api_key.encode())

    async def _read_body(self, receive: Receive) -> tuple[Optional[bytes], int, bool]:
        """(body, bytes read, more): body is None when it exceeds the limit, and `more` says
        whether part of it is still unread."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"".join(chunks), size, False
            chunk = message.get("body", b"")
            more = message.get("more_body", False)
            size += len(chunk)
            if size > self.max_body_bytes:
                return None, size, more
            chunks.append(chunk)
            if not more:
                return b"".join(chunks), size, False

    @staticmethod
    async def _drain(receive: Receive) -> None:
        size = 0
        while size < _DRAIN_LIMIT:
            message = await receive()
            if message["type"] != "http.request":
                return
            size += len(message.get("body", b""))
            if not message.get("more_body", False):
                return

    async def _too_large(self, send: Send, size: int) -> None:
        await _send_error(send, 413, f"request body too large: at most {self.max_body_bytes} "
                          f"bytes are accepted (--max-request-bytes), got {size}")


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that first returns the already-read body, then defers to the real one (which
    then reports the client's disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
