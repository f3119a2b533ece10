"""Graceful shutdown on SIGTERM or SIGINT: drain, then end what is left, then exit 0.

1. The signal starts a drain (`Drain.begin`): from then on the ASGI guard answers every new
   request, `/health` included, with OpenAI's 503, `Retry-After` and `Connection: close`, so
   load balancers and clients go elsewhere; the listening socket stays open until step 3.
2. Requests in flight run on, up to `--shutdown-timeout` seconds (vLLM's flag name) or a second
   signal.
3. Then the engine is closed (`AsyncEngine.close`): every request still in flight ends with a
   503, a non-streamed one as OpenAI's error JSON, a stream with a last `data: {"error": ...}`
   event and `data: [DONE]`; their engine requests are aborted, freeing their KV blocks. Once
   their responses are written, uvicorn's own shutdown closes the connections and the app's
   lifespan stops the engine thread.

uvicorn's `Server` would stop at once (cutting streams mid-body, cancelling non-streamed
requests into plain-text 500s) and re-raise the signal at exit; `GracefulServer` takes the
signal itself, never re-raises it, and so the process exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
from types import FrameType
from typing import Any, Iterator, Optional

import uvicorn

from engine.server.errors import APIError

logger = logging.getLogger("engine.serve")

#: Default seconds requests in flight may run on after the signal (vLLM's default, 0, aborts
#: them at once).
DEFAULT_SHUTDOWN_TIMEOUT = 30.0
#: Seconds the ended requests get to write their last bytes before connections are closed.
_CUT_GRACE_S = 5.0
#: The message of the 503 that ends a request cut by the shutdown.
CUT_MESSAGE = ("the server is shutting down and ended this request before it finished "
               "(--shutdown-timeout); retry it")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`--shutdown-timeout`."""
    parser.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT,
                        help="on SIGTERM/SIGINT, seconds requests in flight may run on before "
                             "they are ended with a 503 (new requests get 503 at once; default "
                             f"{DEFAULT_SHUTDOWN_TIMEOUT:g}, 0 ends them at once)")


class Drain:
    """The HTTP requests in flight, counted by the ASGI guard (`track`), and whether the server
    is draining. Event-loop side only."""

    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def begin(self) -> None:
        """From now on the guard refuses new requests."""
        self.draining = True

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        """Counts one request in flight for the duration of the block."""
        self.in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    async def wait_idle(self, timeout: float, cut: Optional[asyncio.Event] = None) -> bool:
        """Waits until no request is in flight (True), or `timeout` s pass or `cut` is set
        (False unless idle by then)."""
        waits = {asyncio.ensure_future(self._idle.wait())}
        if cut is not None:
            waits.add(asyncio.ensure_future(cut.wait()))
        try:
            await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        return self._idle.is_set()


class GracefulServer(uvicorn.Server):
    """uvicorn's server with the drain of the module docstring. `engine`: the `AsyncEngine`
    to close; `shutdown_timeout`: seconds of step 2."""

    def __init__(self, config: uvicorn.Config, drain: Drain, engine: Any,
                 shutdown_timeout: float) -> None:
        super().__init__(config)
        self.drain = drain
        self.engine = engine
        self.shutdown_timeout = shutdown_timeout
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._cut: Optional[asyncio.Event] = None
        self._draining_task: Optional[asyncio.Task] = None

    async def startup(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._cut = asyncio.Event()
        await super().startup(sockets=sockets)

    def handle_exit(self, sig: int, frame: Optional[FrameType]) -> None:
        """The signal handler (main thread). Not recorded in uvicorn's captured signals, so
        that the process exits 0 instead of re-raising it."""
        name = signal.Signals(sig).name
        if self._loop is None or self._cut is None:  # not serving yet: stop at once
            self.should_exit = True
            return
        if self._draining_task is None:
            logger.info("%s: draining (new requests get 503; %d in flight may run on up to "
                        "%g s)", name, self.drain.in_flight, self.shutdown_timeout)
            self._loop.call_soon_threadsafe(self._start_drain)
        else:
            logger.info("%s again: ending the requests in flight now", name)
            self._loop.call_soon_threadsafe(self._cut.set)

    def _start_drain(self) -> None:
        if self._draining_task is None:
            self._draining_task = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        assert self._cut is not None
        self.drain.begin()
        if not await self.drain.wait_idle(self.shutdown_timeout, self._cut):
            logger.warning("shutdown: ending %d requests still in flight", self.drain.in_flight)
        self.engine.close(APIError(503, CUT_MESSAGE))
        if not await self.drain.wait_idle(_CUT_GRACE_S):
            logger.error("shutdown: %d requests did not end", self.drain.in_flight)
        await self._log_engine_state()
        self.should_exit = True

    async def _log_engine_state(self) -> None:
        """Logs the KV pool after the drain (all blocks free when every request ended)."""
        def state(engine: Any) -> Any:
            engine.check_integrity()
            return engine.stats()

        try:
            stats = await asyncio.wait_for(self.engine.call_in_engine_thread(state), 5.0)
        except (APIError, AssertionError, asyncio.TimeoutError) as exc:
            logger.warning("shutdown: engine state not checked: %s", exc)
            return
        logger.info("shutdown: engine idle, %d of %d KV blocks free",
                    stats.num_free_blocks, stats.num_total_blocks)
