"""The FastAPI app: OpenAI's completions and chat completions (streaming and not), models,
health, metrics, tokenize and detokenize, on top of one `AsyncEngine`.

Request handling: check the model name and readiness, turn the prompt into token ids, check its
length against `max_model_len`, build `SamplingParams` (their ValueErrors become 400s), then add
one engine request per prompt and either stream server-sent events or wait for the end. A client
that goes away aborts its engine requests (streaming: the response task is cancelled; otherwise a
watcher polls for the disconnect).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import asdict, is_dataclass
from typing import Any, AsyncIterator, Awaitable, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from engine.server import openapi
from engine.server import responses as R
from engine.server.async_engine import AsyncEngine, RequestDelta
from engine.server.errors import APIError, error_body, install_error_handlers, logger
from engine.server.metrics import CONTENT_TYPE
from engine.server.middleware import GuardMiddleware
from engine.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

#: How often a non-streaming request checks whether its client is still there.
_DISCONNECT_POLL_S = 0.25


class OpenAIServer:
    """The endpoints' logic for one served model. `model_names`: the names a request may use
    (the first is the one reported)."""

    def __init__(self, engine: AsyncEngine, model_names: list[str]) -> None:
        assert model_names, "at least one served model name"
        self.engine = engine
        self.model_names = model_names
        self.created = int(time.time())

    # ------------------------------------------------------------------ helpers
    @property
    def model_name(self) -> str:
        return self.model_names[0]

    @property
    def tokenizer(self) -> Any:
        return self.engine.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return int(self.engine.engine.max_model_len)

    def check_model(self, name: Optional[str]) -> None:
        """404 unless `name` is None or one of the served names."""
        if name is not None and name not in self.model_names:
            raise APIError(404, f"model: the model '{name}' does not exist; this server serves "
                           f"{self.model_name!r}", "model")

    def _prompt_ids(self, prompt: Union[str, list[int]], add_special_tokens: bool) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        vocab = self.tokenizer.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"prompt: token ids must be in [0, {vocab}), got {bad[0]}",
                           "prompt")
        return list(prompt)

    def _max_tokens(self, prompt_len: int, requested: Optional[int]) -> int:
        """`requested`, or all the room left; 400 (with the lengths) when it does not fit."""
        limit = self.max_model_len
        if prompt_len >= limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens "
                           f"(--max-model-len), but the prompt has {prompt_len} tokens; reduce "
                           "the prompt", "messages" if requested is None else "prompt")
        if requested is None:
            return limit - prompt_len
        if prompt_len + requested > limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens "
                           f"(--max-model-len), but {prompt_len + requested} were requested "
                           f"({prompt_len} in the prompt, {requested} for the completion); "
                           "reduce the prompt or max_tokens", "max_tokens")
        return requested

    @staticmethod
    def _params(kwargs: dict[str, Any]) -> Any:
        from engine.sampling_params import SamplingParams  # engine is heavy

        try:
            return SamplingParams(**kwargs)
        except (ValueError, TypeError) as exc:
            param = str(exc).split(":", 1)[0] if ":" in str(exc) else None
            raise APIError(400, str(exc), param) from None

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    async def _add_all(self, base_id: str, prompts: list[list[int]],
                       params: list[Any]) -> list[AsyncIterator[RequestDelta]]:
        """One engine request per prompt (ids `base_id-i`); all or none are added."""
        streams: list[AsyncIterator[RequestDelta]] = []
        try:
            for i, (ids, p) in enumerate(zip(prompts, params)):
                streams.append(await self.engine.add(f"{base_id}-{i}", ids, p))
        except BaseException:
            for i in range(len(streams)):
                self.engine.abort(f"{base_id}-{i}")
            raise
        return streams

    # -------------------------------------------------------------- completions
    async def completions(self, req: CompletionRequest, raw: Request) -> Response:
        self.check_model(req.model)
        self.engine.check_ready()
        req.check_best_of()
        if req.echo and req.logprobs is not None:
            raise APIError(400, "echo: prompt logprobs are not supported; use echo without "
                           "logprobs", "echo")
        prompts = [self._prompt_ids(p, req.add_special_tokens) for p in req.prompts()]
        params = []
        for ids in prompts:
            kwargs = req.base_sampling_kwargs()
            kwargs["max_tokens"] = self._max_tokens(len(ids), req.max_tokens)
            kwargs["logprobs"] = req.logprobs
            params.append(self._params(kwargs))
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = await self._add_all(request_id, prompts, params)
        job = _CompletionJob(self, req, request_id, prompts)
        if req.stream:
            return _sse_response(job.stream(_merge(streams)))
        return JSONResponse(await _until_disconnect(raw, job.collect(_merge(streams))))

    # --------------------------------------------------------------------- chat
    def _chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        messages = [m.as_template_dict() for m in req.messages]
        try:
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=req.add_generation_prompt)
        except ValueError as exc:
            raise APIError(400, f"messages: {exc}", "messages") from None
        except Exception as exc:  # a template error is the request's fault
            raise APIError(400, f"messages: the chat template rejected them "
                           f"({type(exc).__name__})", "messages") from None
        return self.tokenizer.encode(text, add_special_tokens=req.add_special_tokens)

    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Response:
        self.check_model(req.model)
        self.engine.check_ready()
        num_logprobs = req.num_logprobs
        ids = self._chat_prompt(req)
        kwargs = req.base_sampling_kwargs()
        kwargs["max_tokens"] = self._max_tokens(len(ids), req.requested_max_tokens)
        kwargs["logprobs"] = num_logprobs
        params = self._params(kwargs)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await self._add_all(request_id, [ids], [params])
        job = _ChatJob(self, req, request_id, len(ids), num_logprobs)
        if req.stream:
            return _sse_response(job.stream(_merge(streams)))
        return JSONResponse(await _until_disconnect(raw, job.collect(_merge(streams))))

    # ------------------------------------------------------------ small routes
    def models(self) -> dict[str, Any]:
        self.engine.check_ready()
        return {"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": self.created,
             "owned_by": "paged-kernels", "root": self.model_name,
             "max_model_len": self.max_model_len}]}

    def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        self.check_model(req.model)
        self.engine.check_ready()
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "tokenize: expected exactly one of 'prompt' and 'messages'")
        if req.messages is not None:
            chat = ChatCompletionRequest(messages=req.messages,
                                         add_generation_prompt=req.add_generation_prompt,
                                         add_special_tokens=bool(req.add_special_tokens))
            ids = self._chat_prompt(chat)
        else:
            add = True if req.add_special_tokens is None else req.add_special_tokens
            ids = self.tokenizer.encode(req.prompt, add_special_tokens=add)
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}

    def detokenize(self, req: DetokenizeRequest) -> dict[str, Any]:
        self.check_model(req.model)
        self.engine.check_ready()
        return {"prompt": self.tokenizer.decode(self._prompt_ids(req.tokens, False),
                                                skip_special_tokens=False)}

    def engine_stats(self) -> dict[str, Any]:
        self.engine.check_ready()
        stats = self.engine.last_stats
        if is_dataclass(stats):
            return asdict(stats)  # type: ignore[arg-type]
        return dict(stats or {})


class _CompletionJob:
    """Turns the deltas of one completions request (one engine request per prompt, `n`
    choices each) into OpenAI's response or stream chunks."""

    def __init__(self, server: OpenAIServer, req: CompletionRequest, request_id: str,
                 prompts: list[list[int]]) -> None:
        self.server, self.req, self.request_id = server, req, request_id
        self.prompts = prompts
        self.created = int(time.time())
        self.num_prompt_tokens = sum(len(p) for p in prompts)
        self.num_output: dict[int, int] = {}
        self.logprobs: dict[int, R.CompletionLogprobs] = {}
        self.echoed: set[int] = set()

    def _choices(self, prompt_idx: int, delta: RequestDelta) -> list[dict[str, Any]]:
        out = []
        self.num_output[prompt_idx] = delta.num_output_tokens
        for ch in delta.choices:
            index = prompt_idx * self.req.n + ch.index
            text = ch.text
            if self.req.echo and index not in self.echoed:
                self.echoed.add(index)
                prompt = self.req.prompts()[prompt_idx]
                text = (prompt if isinstance(prompt, str)
                        else self.server.tokenizer.decode(prompt)) + text
            lp = None
            if self.req.logprobs is not None:
                acc = self.logprobs.setdefault(
                    index, R.CompletionLogprobs(self.server._token_text, self.req.logprobs))
                lp = acc.chunk(*R.new_tokens(ch))
            out.append(R.completion_choice(index, text, lp, ch.finish_reason, ch.stop_reason))
        return out

    def _usage(self) -> dict[str, int]:
        return R.usage(self.num_prompt_tokens, sum(self.num_output.values()))

    async def collect(self, deltas: AsyncIterator[tuple[int, RequestDelta]]) -> dict[str, Any]:
        parts: dict[int, list[dict[str, Any]]] = {}
        async for prompt_idx, delta in deltas:
            for choice in self._choices(prompt_idx, delta):
                parts.setdefault(choice["index"], []).append(choice)
        choices = []
        for index in sorted(parts):
            seq = parts[index]
            lps = [c["logprobs"] for c in seq if c["logprobs"] is not None]
            choices.append(R.completion_choice(
                index, "".join(c["text"] for c in seq), R.CompletionLogprobs.merge(lps)
                if self.req.logprobs is not None else None,
                seq[-1]["finish_reason"], seq[-1]["stop_reason"]))
        return R.completion_body(self.request_id, self.created, self.server.model_name, choices,
                                 self._usage())

    async def stream(self, deltas: AsyncIterator[tuple[int, RequestDelta]]
                     ) -> AsyncIterator[bytes]:
        name = self.server.model_name
        encoder = R.ChunkEncoder(R.completion_body(self.request_id, self.created, name, [],
                                                   None, chunk=True))
        async for prompt_idx, delta in deltas:
            choices = self._choices(prompt_idx, delta)
            if choices:
                yield encoder.event(choices)
        if self.req.include_usage:
            yield R.sse(R.completion_body(self.request_id, self.created, name, [],
                                          self._usage(), chunk=True))
        yield R.DONE


class _ChatJob:
    """Turns the deltas of one chat request into OpenAI's chat response or stream chunks."""

    def __init__(self, server: OpenAIServer, req: ChatCompletionRequest, request_id: str,
                 num_prompt_tokens: int, num_logprobs: Optional[int]) -> None:
        self.server, self.req, self.request_id = server, req, request_id
        self.created = int(time.time())
        self.num_prompt_tokens = num_prompt_tokens
        self.num_logprobs = num_logprobs
        self.num_output = 0

    def _logprobs(self, ch: Any) -> Optional[list[dict[str, Any]]]:
        if self.num_logprobs is None:
            return None
        return R.chat_logprobs(self.server._token_text, self.num_logprobs, *R.new_tokens(ch))

    def _usage(self) -> dict[str, int]:
        return R.usage(self.num_prompt_tokens, self.num_output)

    async def collect(self, deltas: AsyncIterator[tuple[int, RequestDelta]]) -> dict[str, Any]:
        texts: dict[int, list[str]] = {}
        lps: dict[int, list[dict[str, Any]]] = {}
        ends: dict[int, tuple[Optional[str], Any]] = {}
        async for _, delta in deltas:
            self.num_output = delta.num_output_tokens
            for ch in delta.choices:
                texts.setdefault(ch.index, []).append(ch.text)
                lps.setdefault(ch.index, []).extend(self._logprobs(ch) or [])
                ends[ch.index] = (ch.finish_reason, ch.stop_reason)
        choices = [R.chat_choice(i, "".join(texts[i]),
                                 lps[i] if self.num_logprobs is not None else None, *ends[i])
                   for i in sorted(texts)]
        return R.chat_body(self.request_id, self.created, self.server.model_name, choices,
                           self._usage())

    async def stream(self, deltas: AsyncIterator[tuple[int, RequestDelta]]
                     ) -> AsyncIterator[bytes]:
        name = self.server.model_name
        encoder = R.ChunkEncoder(R.chat_body(self.request_id, self.created, name, [], None,
                                             chunk=True),
                                 {"usage": None} if self.req.include_usage else None)
        chunk = encoder.event
        yield chunk([R.chat_chunk_choice(i, {"role": "assistant", "content": ""}, None, None)
                     for i in range(self.req.n)])
        async for _, delta in deltas:
            self.num_output = delta.num_output_tokens
            choices = [R.chat_chunk_choice(ch.index, {"content": ch.text} if ch.text else {},
                                           self._logprobs(ch), ch.finish_reason,
                                           ch.stop_reason)
                       for ch in delta.choices]
            if choices:
                yield chunk(choices)
        if self.req.include_usage:
            yield R.sse(R.chat_body(self.request_id, self.created, name, [], self._usage(),
                                    chunk=True))
        yield R.DONE


# ------------------------------------------------------------------------- plumbing
async def _merge(streams: list[AsyncIterator[RequestDelta]]
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


def _sse_response(chunks: AsyncIterator[bytes]) -> StreamingResponse:
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


async def _until_disconnect(raw: Request, work: Awaitable[dict[str, Any]]) -> dict[str, Any]:
    """Awaits `work`; cancels it (which aborts its engine requests) if the client leaves."""
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


def create_app(server: OpenAIServer, api_key: Optional[str] = None,
               max_request_bytes: int = 4 * 1024 * 1024) -> FastAPI:
    """The app for `server`; the engine thread starts with the app (lifespan) and stops with
    it."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server.engine.start(asyncio.get_running_loop())
        yield
        server.engine.shutdown()

    # The OpenAPI schema of the routes below, as vLLM serves it (clients and fuzzers read it); no
    # Swagger/ReDoc pages, which load their scripts from a CDN.
    app = FastAPI(title="paged-kernels engine", lifespan=lifespan, docs_url=None,
                  redoc_url=None, openapi_url="/openapi.json")
    install_error_handlers(app)
    openapi.install(app)
    app.add_middleware(GuardMiddleware, api_key=api_key, max_body_bytes=max_request_bytes)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        return await server.completions(req, raw)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, raw: Request) -> Response:
        return await server.chat(req, raw)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return server.models()

    @app.get("/health")
    async def health() -> Response:
        server.engine.check_ready()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.engine.metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        return server.tokenize(req)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict[str, Any]:
        return server.detokenize(req)

    @app.get("/internal/stats")
    async def engine_stats() -> dict[str, Any]:
        return server.engine_stats()

    return app
