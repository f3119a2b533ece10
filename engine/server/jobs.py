"""The deltas of one request's engine requests -> OpenAI's response body or its stream chunks.

A job is made per request once its engine requests are added. `collect` consumes the merged
deltas (`streaming.merge`) and returns the whole response; `stream` yields the server-sent
events, ending with `data: [DONE]`.
"""

from __future__ import annotations

import time
from typing import Any, AsyncIterator, Optional, Protocol

from engine.server import responses as R
from engine.server.async_engine import RequestDelta
from engine.server.protocol import ChatCompletionRequest, CompletionRequest
from engine.server.tool_stream import ToolCallStream
from engine.server.tools import ToolCalls


class OpenAIServer(Protocol):
    """What a job reads of the server that made it (`routes.OpenAIServer`)."""

    model_name: str
    tokenizer: Any

    def token_text(self, token_id: int) -> str:
        """The text of one token, as logprobs report it."""


Deltas = AsyncIterator[tuple[int, RequestDelta]]


class CompletionJob:
    """Turns the deltas of one completions request (one engine request per prompt, `n`
    choices each) into OpenAI's response or stream chunks. Choice `index` is
    `prompt index * n + choice`; with `echo` the prompt leads each choice's text."""

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
                    index, R.CompletionLogprobs(self.server.token_text, self.req.logprobs))
                lp = acc.chunk(*R.new_tokens(ch))
            out.append(R.completion_choice(index, text, lp, ch.finish_reason, ch.stop_reason))
        return out

    def _usage(self) -> dict[str, int]:
        return R.usage(self.num_prompt_tokens, sum(self.num_output.values()))

    async def collect(self, deltas: Deltas) -> dict[str, Any]:
        """The completion body: each choice's text and logprobs joined, its last finish."""
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

    async def stream(self, deltas: Deltas) -> AsyncIterator[bytes]:
        """One chunk per delta with choices, the usage chunk if asked for, then `[DONE]`."""
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


class ChatJob:
    """Turns the deltas of one chat request into OpenAI's chat response or stream chunks.

    With tools in use (`tools.active`) each reply is read as tool calls once it has finished
    (`ToolCalls.parse`); streamed, a choice sends its content and its calls' names and
    argument pieces as they are written (`ToolCallStream`), with finish_reason "tool_calls"
    when it made any."""

    def __init__(self, server: OpenAIServer, req: ChatCompletionRequest, request_id: str,
                 num_prompt_tokens: int, num_logprobs: Optional[int],
                 tools: Optional[ToolCalls] = None) -> None:
        self.server, self.req, self.request_id = server, req, request_id
        self.created = int(time.time())
        self.num_prompt_tokens = num_prompt_tokens
        self.num_logprobs = num_logprobs
        self.num_output = 0
        self.tools = tools if tools is not None and tools.active else None

    def _logprobs(self, ch: Any) -> Optional[list[dict[str, Any]]]:
        if self.num_logprobs is None:
            return None
        return R.chat_logprobs(self.server.token_text, self.num_logprobs, *R.new_tokens(ch))

    def _usage(self) -> dict[str, int]:
        return R.usage(self.num_prompt_tokens, self.num_output)

    async def collect(self, deltas: Deltas) -> dict[str, Any]:
        """The chat completion body: each choice's content and logprobs joined."""
        texts: dict[int, list[str]] = {}
        lps: dict[int, list[dict[str, Any]]] = {}
        ends: dict[int, tuple[Optional[str], Any]] = {}
        async for _, delta in deltas:
            self.num_output = delta.num_output_tokens
            for ch in delta.choices:
                texts.setdefault(ch.index, []).append(ch.text)
                lps.setdefault(ch.index, []).extend(self._logprobs(ch) or [])
                ends[ch.index] = (ch.finish_reason, ch.stop_reason)
        choices = [self._choice(i, "".join(texts[i]),
                                lps[i] if self.num_logprobs is not None else None, *ends[i])
                   for i in sorted(texts)]
        return R.chat_body(self.request_id, self.created, self.server.model_name, choices,
                           self._usage())

    def _choice(self, index: int, text: str, logprobs: Optional[list[dict[str, Any]]],
                finish_reason: Optional[str], stop_reason: Any) -> dict[str, Any]:
        if self.tools is None:
            return R.chat_choice(index, text, logprobs, finish_reason, stop_reason)
        content, calls = self.tools.parse(text)
        return R.chat_choice(index, content, logprobs,
                             "tool_calls" if calls else finish_reason, stop_reason, calls)

    def _tool_choices(self, delta: RequestDelta, streams: dict[int, ToolCallStream]
                      ) -> list[dict[str, Any]]:
        """Tool mode: each choice's content and tool-call deltas as its text arrives
        (engine/server/tool_stream.py), one chunk choice per delta body; at its end the
        finish reason ("tool_calls" when it made calls)."""
        out = []
        for ch in delta.choices:
            stream = streams.setdefault(ch.index, ToolCallStream(self.tools))
            bodies = stream.feed(ch.text)
            logprobs = self._logprobs(ch)
            finish = ch.finish_reason
            if finish is not None:
                last, called = stream.finish()
                bodies += last
                finish = "tool_calls" if called else finish
            bodies = bodies or ([{}] if finish is not None or logprobs else [])
            for k, body in enumerate(bodies):
                final = k == len(bodies) - 1
                out.append(R.chat_chunk_choice(ch.index, body, logprobs if final else None,
                                               finish if final else None,
                                               ch.stop_reason if final else None))
        return out

    async def stream(self, deltas: Deltas) -> AsyncIterator[bytes]:
        """A first chunk with each choice's assistant role, one chunk per delta with choices,
        the usage chunk if asked for, then `[DONE]`."""
        name = self.server.model_name
        encoder = R.ChunkEncoder(R.chat_body(self.request_id, self.created, name, [], None,
                                             chunk=True),
                                 {"usage": None} if self.req.include_usage else None)
        chunk = encoder.event
        yield chunk([R.chat_chunk_choice(i, {"role": "assistant", "content": ""}, None, None)
                     for i in range(self.req.n)])
        tool_streams: dict[int, ToolCallStream] = {}
        async for _, delta in deltas:
            self.num_output = delta.num_output_tokens
            if self.tools is not None:
                choices = self._tool_choices(delta, tool_streams)
            else:
                choices = [R.chat_chunk_choice(ch.index, {"content": ch.text} if ch.text
                                               else {}, self._logprobs(ch), ch.finish_reason,
                                               ch.stop_reason)
                           for ch in delta.choices]
            if choices:
                yield chunk(choices)
        if self.req.include_usage:
            yield R.sse(R.chat_body(self.request_id, self.created, name, [], self._usage(),
                                    chunk=True))
        yield R.DONE
