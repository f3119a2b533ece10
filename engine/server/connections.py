"""Connection limits, set by `engine.serve` flags: how long a client may take to send a request,
how long an idle connection stays open, and how many connections and requests the server takes.

uvicorn closes a connection that stays idle `--timeout-keep-alive` seconds after a response,
but has no deadline for a request's head: a connection that opens and never sends a complete
request line and headers (slowloris), or sends nothing at all, stays open forever and counts
against `--limit-concurrency`. `GuardedHttpToolsProtocol` (uvicorn's httptools protocol, which
it would pick itself) adds that deadline: from the moment a connection waits for a request's
head, it has `--timeout-header-read` seconds to complete it, else it is closed (with a 408 if
part of a head came). The body's deadline, `--timeout-body-read`, is kept by the ASGI guard
(middleware.py), which reads every body.

`--limit-concurrency N`: a request that arrives while more than N connections are open or N
requests are in flight gets OpenAI's 503 with `Retry-After` and `Connection: close` (uvicorn's
own limit answers plain text without `Retry-After`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from engine.server.errors import error_body
from engine.server.middleware import send_error

#: Defaults, in seconds.
DEFAULT_TIMEOUT_KEEP_ALIVE = 5.0
DEFAULT_TIMEOUT_HEADER_READ = 10.0
DEFAULT_TIMEOUT_BODY_READ = 60.0


@dataclass(frozen=True)
class ConnectionSettings:
    """`limit_concurrency`: most connections open and requests in flight (None: no limit);
    the timeouts in seconds (see the module docstring)."""

    limit_concurrency: Optional[int] = None
    timeout_keep_alive: float = DEFAULT_TIMEOUT_KEEP_ALIVE
    timeout_header_read: float = DEFAULT_TIMEOUT_HEADER_READ
    timeout_body_read: float = DEFAULT_TIMEOUT_BODY_READ

    def __post_init__(self) -> None:
        if self.limit_concurrency is not None and self.limit_concurrency < 1:
            raise ValueError(f"limit_concurrency: expected an integer >= 1, got "
                             f"{self.limit_concurrency}")
        for name in ("timeout_keep_alive", "timeout_header_read", "timeout_body_read"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: expected seconds > 0, got {getattr(self, name)}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `engine.serve` flags of `ConnectionSettings`."""
    parser.add_argument("--limit-concurrency", type=int, default=None,
                        help="503 (with Retry-After) for a request that arrives while more "
                             "connections are open or this many requests are in flight")
    parser.add_argument("--timeout-keep-alive", type=float, default=DEFAULT_TIMEOUT_KEEP_ALIVE,
                        help="close a connection idle this many seconds after a response "
                             f"(default {DEFAULT_TIMEOUT_KEEP_ALIVE:g})")
    parser.add_argument("--timeout-header-read", type=float,
                        default=DEFAULT_TIMEOUT_HEADER_READ,
                        help="close a connection that has not sent a request's complete line "
                             "and headers this many seconds after it began waiting for one "
                             f"(408 if part came; default {DEFAULT_TIMEOUT_HEADER_READ:g})")
    parser.add_argument("--timeout-body-read", type=float, default=DEFAULT_TIMEOUT_BODY_READ,
                        help="408 and close for a request whose body has not all arrived this "
                             "many seconds after its headers "
                             f"(default {DEFAULT_TIMEOUT_BODY_READ:g})")


def from_args(args: argparse.Namespace) -> ConnectionSettings:
    """The settings the parsed flags give; ValueError naming the field when one is out of
    range."""
    return ConnectionSettings(args.limit_concurrency, args.timeout_keep_alive,
                              args.timeout_header_read, args.timeout_body_read)


def protocol_class(settings: ConnectionSettings) -> type[asyncio.Protocol]:
    """The uvicorn protocol class (`uvicorn.Config(http=...)`) that keeps `settings`."""
    return type("GuardedHttpToolsProtocol", (GuardedHttpToolsProtocol,),
                {"settings": settings})


def _timeout_response(seconds: float) -> bytes:
    body = json.dumps(error_body(408, f"request head not received within {seconds:g} s "
                                      "(--timeout-header-read)")).encode()
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n"
            + body)


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline for each request's head and the
    concurrency limit answered in OpenAI's shape. Made per server by `protocol_class`."""

    settings: ClassVar[ConnectionSettings] = ConnectionSettings()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._app = self.app
        self.limit_concurrency = None  # uvicorn's own check stays off; ours is below
        self._head_timer: Optional[asyncio.TimerHandle] = None
        self._head_bytes = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._head_bytes += len(data)
        super().data_received(data)

    def on_headers_complete(self) -> None:
        self._cancel_head_timer()
        self.app = self._overloaded if self._over_limit() else self._app
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.timeout_keep_alive_task is not None:  # idle: waiting for the next head
            self._arm_head_timer()

    def _over_limit(self) -> bool:
        limit = self.settings.limit_concurrency
        return limit is not None and (len(self.connections) > limit or len(self.tasks) >= limit)

    async def _overloaded(self, scope: Any, receive: Any, send: Any) -> None:
        limit = self.settings.limit_concurrency
        await send_error(send, 503, f"the server is at its concurrency limit "
                         f"(--limit-concurrency {limit}); retry later",
                         [(b"connection", b"close")])

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_bytes = 0
        self._head_timer = self.loop.call_later(self.settings.timeout_header_read,
                                                self._on_head_timeout)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _on_head_timeout(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if self._head_bytes:
            self.transport.write(_timeout_response(self.settings.timeout_header_read))
        self.transport.close()
