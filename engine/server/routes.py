"""The handlers of the routes `app.create_app` registers: OpenAI's completions and chat
completions (streaming and not), models, tokenize and detokenize, and the engine's stats, on top
of one `AsyncEngine`.

Request handling: check the model name, readiness and the cheap bounds (`ServerLimits`) on the
event loop; then, in one of the server's worker threads, turn the prompt into token ids (text
that cannot fit `max_model_len` by its length is refused before tokenising), check its length
against `max_model_len` and build `SamplingParams` with their stop-string matcher (their
ValueErrors become 400s; all in `inputs`); then add one engine request per prompt and either
stream server-sent events or wait for the end (`streaming`), the deltas made into OpenAI's JSON
by a job (`jobs`).

The worker threads are a small pool of this server's own (`NUM_INPUT_WORKERS`), not asyncio's
default executor: tokenising releases the GIL (`Tokenizer.encode`), so a few threads keep the
cores busy, while a burst of large prompts queues there instead of taking every thread the
process has.
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, is_dataclass
from typing import Any, Callable, Optional, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from engine.server import inputs
from engine.server import responses as R
from engine.server.async_engine import AsyncEngine
from engine.server.beam_search import beam_search
from engine.server.errors import APIError
from engine.server.jobs import ChatJob, CompletionJob
from engine.server.limits import ServerLimits
from engine.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from engine.server.streaming import add_all, merge, sse_response, until_disconnect

#: Threads that tokenise prompts, render chat templates and build sampling parameters.
NUM_INPUT_WORKERS = 4

T = TypeVar("T")


class OpenAIServer:
    """The endpoints' logic for one served model. `model_names`: the names a request may use
    (the first is the one reported); `limits`: the per-request bounds (`engine.server.limits`);
    `tool_call_parser`: how "auto" tool-call replies are read (`engine.server.tools`)."""

    def __init__(self, engine: AsyncEngine, model_names: list[str],
                 limits: Optional[ServerLimits] = None, tool_call_parser: str = "hermes"
                 ) -> None:
        assert model_names, "at least one served model name"
        self.engine = engine
        self.model_names = model_names
        self.limits = limits or ServerLimits()
        self.tool_call_parser = tool_call_parser
        self.created = int(time.time())
        self._workers = ThreadPoolExecutor(NUM_INPUT_WORKERS, thread_name_prefix="inputs")

    async def in_worker(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` in one of the server's worker threads (the event loop goes on)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._workers, functools.partial(fn, *args))

    def close(self) -> None:
        """Ends the worker threads (work queued but not started is dropped); for app
        shutdown."""
        self._workers.shutdown(wait=False, cancel_futures=True)

    @property
    def model_name(self) -> str:
        """The name reported in responses."""
        return self.model_names[0]

    @property
    def tokenizer(self) -> Any:
        """The loaded engine's tokenizer."""
        return self.engine.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        """Most tokens per sequence, prompt and output together."""
        return int(self.engine.engine.max_model_len)

    def check_model(self, name: Optional[str]) -> None:
        """404 unless `name` is None or one of the served names."""
        if name is not None and name not in self.model_names:
            raise APIError(404, f"model: the model '{name}' does not exist; this server serves "
                           f"{self.model_name!r}", "model")

    def token_text(self, token_id: int) -> str:
        """One token's text, special tokens included (for logprobs)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def check_cheap_bounds(self, req: Any) -> None:
        """The model name, a loaded model and `limits`: checks that cost nothing, made on the
        event loop before any heavy work. A loop being restarted is only a 503 when the
        request is added (a bad request is a 400 whatever the loop's state)."""
        self.check_model(req.model)
        self.engine.check_loaded()
        inputs.check_stop(req.stop, self.limits)

    async def completions(self, req: CompletionRequest, raw: Request) -> Response:
        """POST /v1/completions: one engine request per prompt."""
        self.check_cheap_bounds(req)
        req.check_best_of()
        req.check_beam_search()
        if req.echo and req.logprobs is not None:
            raise APIError(400, "echo: prompt logprobs are not supported; use echo without "
                           "logprobs", "echo")
        prompts, params = await self.in_worker(self._completion_inputs, req)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        if req.use_beam_search:
            work = self._beam_body(req, request_id, prompts, params, chat=False)
            return JSONResponse(await until_disconnect(raw, work))
        streams = await add_all(self.engine, request_id, prompts, params)
        job = CompletionJob(self, req, request_id, prompts)
        if req.stream:
            return sse_response(job.stream(merge(streams)))
        return JSONResponse(await until_disconnect(raw, job.collect(merge(streams))))

    def _completion_inputs(self, req: CompletionRequest) -> tuple[list[list[int]], list[Any]]:
        """(prompt ids, SamplingParams) per prompt of a completions request (worker thread)."""
        inputs.check_stop_token_ids(req.stop_token_ids, self.tokenizer.vocab_size)
        controls = inputs.output_controls(self.engine.engine, req)
        prompts, params = [], []
        for p in req.prompts():
            ids = inputs.prompt_ids(self.tokenizer, p, req.add_special_tokens,
                                    self.max_model_len, req.max_tokens)
            kwargs = req.base_sampling_kwargs()
            kwargs["max_tokens"] = inputs.max_tokens(self.max_model_len, len(ids),
                                                     req.max_tokens)
            kwargs["logprobs"] = req.logprobs
            kwargs["best_of"] = req.best_of
            kwargs.update(controls)
            prompts.append(ids)
            params.append(inputs.sampling_params(kwargs))
        return prompts, params

    def _chat_inputs(self, req: ChatCompletionRequest, num_logprobs: Optional[int]
                     ) -> tuple[list[int], Any]:
        """(prompt ids, SamplingParams) of a chat request (worker thread)."""
        inputs.check_stop_token_ids(req.stop_token_ids, self.tokenizer.vocab_size)
        ids = inputs.chat_prompt_ids(self.tokenizer, req, self.max_model_len)
        kwargs = req.base_sampling_kwargs()
        kwargs["max_tokens"] = inputs.max_tokens(self.max_model_len, len(ids),
                                                 req.requested_max_tokens)
        kwargs["logprobs"] = num_logprobs
        kwargs.update(inputs.output_controls(self.engine.engine, req))
        return ids, inputs.sampling_params(kwargs)

    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Response:
        """POST /v1/chat/completions: the messages rendered by the chat template."""
        self.check_cheap_bounds(req)
        req.check_beam_search()
        num_logprobs = req.num_logprobs
        tools = req.tool_calls(self.tool_call_parser)
        ids, params = await self.in_worker(self._chat_inputs, req, num_logprobs)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        if req.use_beam_search:
            work = self._beam_body(req, request_id, [ids], [params], chat=True)
            return JSONResponse(await until_disconnect(raw, work))
        streams = await add_all(self.engine, request_id, [ids], [params])
        job = ChatJob(self, req, request_id, len(ids), num_logprobs, tools)
        if req.stream:
            return sse_response(job.stream(merge(streams)))
        return JSONResponse(await until_disconnect(raw, job.collect(merge(streams))))

    async def _beam_body(self, req: Any, request_id: str, prompts: list[list[int]],
                         params: list[Any], chat: bool) -> dict[str, Any]:
        """The response to a `use_beam_search` request: each prompt's `n` best hypotheses
        (engine/server/beam_search.py), best first, as its choices."""
        eos = set(self.engine.engine.eos_token_ids)
        choices, generated = [], 0
        for i, (ids, p) in enumerate(zip(prompts, params)):
            found = await beam_search(self.engine, f"{request_id}-{i}", ids, req.n,
                                      p.max_tokens, eos, req.ignore_eos, req.length_penalty)
            for k, hyp in enumerate(found):
                text = await self.in_worker(self.tokenizer.decode, hyp.token_ids,
                                            req.skip_special_tokens)
                generated += len(hyp.token_ids)
                choices.append(R.chat_choice(k, text, None, hyp.finish_reason, None) if chat
                               else R.completion_choice(i * req.n + k, text, None,
                                                        hyp.finish_reason, None))
        usage = R.usage(sum(map(len, prompts)), generated)
        body = R.chat_body if chat else R.completion_body
        return body(request_id, self.created, self.model_name, choices, usage)

    def models(self) -> dict[str, Any]:
        """GET /v1/models: the one served model."""
        self.engine.check_loaded()
        return {"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": self.created,
             "owned_by": "paged-kernels", "root": self.model_name,
             "max_model_len": self.max_model_len}]}

    async def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        """POST /tokenize: the ids of exactly one of a prompt or chat messages; a text that
        cannot fit `max_model_len` by its length alone is refused (400) uncounted."""
        self.check_model(req.model)
        self.engine.check_loaded()
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "tokenize: expected exactly one of 'prompt' and 'messages'")
        ids = await self.in_worker(self._tokenize_ids, req)
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}

    def _tokenize_ids(self, req: TokenizeRequest) -> list[int]:
        if req.messages is not None:
            chat = ChatCompletionRequest(messages=req.messages,
                                         add_generation_prompt=req.add_generation_prompt,
                                         add_special_tokens=bool(req.add_special_tokens))
            return inputs.chat_prompt_ids(self.tokenizer, chat, self.max_model_len)
        add = True if req.add_special_tokens is None else req.add_special_tokens
        assert req.prompt is not None
        return inputs.prompt_ids(self.tokenizer, req.prompt, add, self.max_model_len)

    async def detokenize(self, req: DetokenizeRequest) -> dict[str, Any]:
        """POST /detokenize: the text of token ids, special tokens kept."""
        self.check_model(req.model)
        self.engine.check_loaded()
        ids = inputs.prompt_ids(self.tokenizer, req.tokens, False)
        return {"prompt": await self.in_worker(
            functools.partial(self.tokenizer.decode, skip_special_tokens=False), ids)}

    def engine_stats(self) -> dict[str, Any]:
        """GET /internal/stats: the engine's last stats snapshot as a dict."""
        self.engine.check_ready()
        stats = self.engine.last_stats
        if is_dataclass(stats):
            return asdict(stats)  # type: ignore[arg-type]
        return dict(stats or {})
