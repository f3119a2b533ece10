"""The plumbing between the engine's per-request streams and one HTTP response: adding a
request's engine requests, merging their deltas, sending them as server-sent events, and aborting
the engine work when the client goes away.

A streaming client that disconnects ends its response (`sse_response` watches for it), which
closes the delta streams and so aborts their engine requests; a non-streaming request is awaited
by `until_disconnect`, which polls for the disconnect and cancels the work.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator, Awaitable

from fastapi import Request
from fastapi.responses import StreamingResponse

from engine.server import responses as R
from engine.server.async_engine import AsyncEngine, RequestDelta
from engine.server.errors import APIError, error_body, logger

#: How often a non-streaming request checks whether its client is still there.
_DISCONNECT_POLL_S = 0.25


async def add_all(engine: AsyncEngine, base_id: str, prompts: list[list[int]],
                  params: list[Any]) -> list[AsyncIterator[RequestDelta]]:
    """One engine request per prompt (ids `base_id-i`), their delta streams in prompt order;
    all or none are added (an error aborts those already added, then propagates)."""
    streams: list[AsyncIterator[RequestDelta]] = []
    try:
        for i, (ids, p) in enumerate(zip(prompts, params)):
            streams.append(await engine.add(f"{base_id}-{i}", ids, p))
    except BaseException:
        for i in range(len(streams)):
            engine.abort(f"{base_id}-{i}")
        raise
    return streams


async def merge(streams: list[AsyncIterator[RequestDelta]]
                ) -> AsyncIterator[tuple[int, RequestDelta]]:
    """The deltas of several engine requests as `(prompt index, delta)`, in arrival order.
    Leaving early closes (and so aborts) every stream still open."""
    if len(streams) == 1:
        try:
            async for delta in streams[0]:
                yield 0, delta
        finally:
            await streams[0].aclose()  # type: ignore[attr-defined]
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[RequestDelta]) -> None:
        try:
            async for delta in stream:
                await queue.put((i, delta, None))
            await queue.put((i, None, None))
        except Exception as exc:  # handed to the consumer
            await queue.put((i, None, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        open_streams = len(streams)
        while open_streams:
            i, delta, exc = await queue.get()
            if exc is not None:
                raise exc
            if delta is None:
                open_streams -= 1
                continue
            yield i, delta
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class _EventStreamResponse(StreamingResponse):
    """A StreamingResponse that watches for the client's disconnect itself (whatever ASGI spec
    version the server speaks) and always closes its body iterator, so that the request's
    engine work is aborted as soon as the client is gone."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        stream = asyncio.ensure_future(self.stream_response(send))
        watcher = asyncio.ensure_future(watch())
        try:
            await asyncio.wait({stream, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (stream, watcher):
                task.cancel()
            await asyncio.gather(stream, watcher, return_exceptions=True)
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


def sse_response(chunks: AsyncIterator[bytes]) -> StreamingResponse:
    """A `text/event-stream` response sending `chunks` (unbuffered by proxies); an error raised
    by `chunks` becomes an error event, and the client leaving closes `chunks`."""
    return _EventStreamResponse(_guard_stream(chunks), media_type="text/event-stream",
                                headers={"Cache-Control": "no-cache",
                                         "X-Accel-Buffering": "no"})


async def _guard_stream(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Once the stream has begun its status is sent: an error becomes an OpenAI error event
    followed by `[DONE]` (never a traceback)."""
    try:
        async for chunk in chunks:
            yield chunk
    except APIError as exc:
        yield R.sse(error_body(exc.status, exc.message, exc.param))
        yield R.DONE
    except Exception:  # logged; the client gets a generic error event
        logger.exception("error while streaming")
        yield R.sse(error_body(500, "internal server error; see the server log"))
        yield R.DONE
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]


async def until_disconnect(raw: Request, work: Awaitable[dict[str, Any]]) -> dict[str, Any]:
    """Awaits `work`; cancels it (which aborts its engine requests) and raises a 499 APIError
    if the client leaves first."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await raw.is_disconnected():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
                raise APIError(499, "client disconnected")
    finally:
        if not task.done():
            task.cancel()
