"""ASGI guards in front of every route, in this order: the Host header allow list (400), the
drain at shutdown (503), the API key (401), the request-body size limit (413) and the body's
read deadline (408).

They run before FastAPI parses anything, so a request without the key or with an oversized body
costs no JSON parsing. `/health` is open without a key (load balancers probe it). Every request
that passes is counted in flight (`shutdown.Drain`) until its response ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
from typing import Any, Awaitable, Callable, Optional

from engine.server import access
from engine.server.errors import RETRY_AFTER_S, error_body
from engine.server.shutdown import Drain

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


async def send_error(send: Send, status: int, message: str,
                     extra_headers: Optional[list[tuple[bytes, bytes]]] = None) -> None:
    """Sends OpenAI's error JSON for `status` as a whole response; a 429 or 503 carries
    `Retry-After` (errors.RETRY_AFTER_S), as `errors.error_response` does."""
    body = json.dumps(error_body(status, message)).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode()), *(extra_headers or [])]
    if status in RETRY_AFTER_S:
        headers.append((b"retry-after", str(RETRY_AFTER_S[status]).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _header(scope: Scope, name: bytes) -> Optional[bytes]:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value
    return None


class GuardMiddleware:
    """400 for a `Host` not in `allowed_hosts` (None: any), 503 while `drain` is draining, 401
    without `Authorization: Bearer <api_key>` (when a key is set), 413 for a body over
    `max_body_bytes`, 408 for a body not all read within `body_timeout` seconds (None: no
    limit); other requests pass through with their body replayed. `drain` counts every request
    that passed the first three checks until its response ends."""

    def __init__(self, app: ASGIApp, api_key: Optional[str], max_body_bytes: int,
                 allowed_hosts: Optional[frozenset[str]] = None, drain: Optional[Drain] = None,
                 body_timeout: Optional[float] = None) -> None:
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.allowed_hosts = allowed_hosts
        self.drain = drain
        self.body_timeout = body_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._refusal(scope)
        if refusal is not None:
            await send_error(send, *refusal)
            return
        with self.drain.track() if self.drain is not None else contextlib.nullcontext():
            await self._pass(scope, receive, send)

    async def _pass(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The body checks, then the app with the body replayed."""
        deadline = None if self.body_timeout is None else time.monotonic() + self.body_timeout
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await self._too_large(send, int(declared), await self._drain(receive, deadline))
            return
        try:
            body, size, more = await self._read_body(receive, deadline)
        except asyncio.TimeoutError:
            await send_error(send, 408, f"request body not received within "
                             f"{self.body_timeout:g} s (--timeout-body-read)",
                             [(b"connection", b"close")])
            return
        if body is None:
            drained = await self._drain(receive, deadline) if more else True
            await self._too_large(send, size, drained)
            return
        await self.app(scope, _replay(body, receive), send)

    def _refusal(self, scope: Scope) -> Optional[tuple[Any, ...]]:
        """(status, message, headers) of the error that refuses the request, or None."""
        host = _header(scope, b"host")
        host_text = host.decode("latin-1") if host is not None else None
        if not access.host_allowed(self.allowed_hosts, host_text):
            shown = host_text if len(host_text or "") <= 100 else host_text[:97] + "..."
            return (400, f"Host header: {shown!r} is not an allowed host name of this server "
                         "(--allowed-hosts)", [(b"connection", b"close")])
        if self.drain is not None and self.drain.draining:
            return (503, "the server is shutting down; retry on another server or later",
                    [(b"connection", b"close")])
        if not self._authorized(scope):
            return (401, "missing or wrong API key: send the header "
                         "'Authorization: Bearer <key>'", [(b"www-authenticate", b"Bearer")])
        return None

    def _authorized(self, scope: Scope) -> bool:
        if self.api_key is None or scope.get("path") in OPEN_PATHS:
            return True
        value = (_header(scope, b"authorization") or b"").decode("latin-1")
        scheme, _, token = value.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(),
                                                                  self.api_key.encode())

    async def _read_body(self, receive: Receive, deadline: Optional[float]
                         ) -> tuple[Optional[bytes], int, bool]:
        """(body, bytes read, more): body is None when it exceeds the limit, and `more` says
        whether part of it is still unread. asyncio.TimeoutError once `deadline` (monotonic
        time; None: none) passes."""
        chunks, size = [], 0
        while True:
            message = await _receive_by(receive, deadline)
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
    async def _drain(receive: Receive, deadline: Optional[float]) -> bool:
        """Reads and drops the rest of a body (up to _DRAIN_LIMIT bytes, until `deadline`);
        whether it was all read."""
        size = 0
        try:
            while size < _DRAIN_LIMIT:
                message = await _receive_by(receive, deadline)
                if message["type"] != "http.request":
                    return False
                size += len(message.get("body", b""))
                if not message.get("more_body", False):
                    return True
        except asyncio.TimeoutError:
            pass
        return False

    async def _too_large(self, send: Send, size: int, drained: bool) -> None:
        """The 413; the connection is closed unless the whole body was read."""
        await send_error(send, 413, f"request body too large: at most {self.max_body_bytes} "
                         f"bytes are accepted (--max-request-bytes), got {size}",
                         None if drained else [(b"connection", b"close")])


async def _receive_by(receive: Receive, deadline: Optional[float]) -> Message:
    """`receive()`, or asyncio.TimeoutError once `deadline` (monotonic time) has passed."""
    if deadline is None:
        return await receive()
    return await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.001))


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
