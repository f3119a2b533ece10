"""OpenAI's response and stream-chunk JSON for completions and chat completions.

Plain dicts, built from `engine.server.async_engine.ChoiceDelta`s, so that streaming adds no
model validation cost per token. Chunks go out as server-sent events (`sse`), the stream ends with
`data: [DONE]`.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Optional

from engine.server.async_engine import ChoiceDelta

DONE = b"data: [DONE]\n\n"

TokenText = Callable[[int], str]


def sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event carrying `payload` as compact JSON."""
    return b"data: " + _dumps(payload).encode() + b"\n\n"


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


class ChunkEncoder:
    """The server-sent events of one stream's chunks. Every chunk of a stream repeats the same
    leading fields (id, object, created, model); they are encoded once, so a chunk costs one
    `json.dumps` of its `choices`. The bytes equal `sse({**fixed, "choices": choices,
    **extra})` for the `fixed` and `extra` (trailing fields, such as `"usage": None`) given."""

    def __init__(self, fixed: dict[str, Any], extra: Optional[dict[str, Any]] = None) -> None:
        self._head = b"data: " + _dumps({**fixed, "choices": None})[:-len("null}")].encode()
        self._tail = (b"," + _dumps(extra)[1:].encode() if extra else b"}") + b"\n\n"

    def event(self, choices: list[dict[str, Any]]) -> bytes:
        """One chunk carrying `choices`."""
        return self._head + _dumps(choices).encode() + self._tail


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


# ----------------------------------------------------------------------------- logprobs
def _top(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    """The `k` most likely tokens of one position, best first."""
    ranked = sorted(entry.items(), key=lambda kv: -kv[1])
    return ranked[:k]


class CompletionLogprobs:
    """Accumulates the legacy completions `logprobs` object (tokens, token_logprobs,
    top_logprobs, text_offset) of one choice."""

    def __init__(self, token_text: TokenText, k: int, text_offset: int = 0) -> None:
        self.token_text = token_text
        self.k = k
        self.offset = text_offset

    def chunk(self, token_ids: list[int], entries: list[dict[int, float]]) -> dict[str, Any]:
        """The logprobs object of `token_ids` (their entries from the engine)."""
        tokens, lps, tops, offsets = [], [], [], []
        for tid, entry in zip(token_ids, entries):
            text = self.token_text(tid)
            tokens.append(text)
            lps.append(entry.get(tid))
            tops.append({self.token_text(t): lp for t, lp in _top(entry, self.k)}
                        if self.k else None)
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops,
                "text_offset": offsets}

    @staticmethod
    def merge(parts: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
        if not parts:
            return None
        return {key: [x for p in parts for x in p[key]] for key in parts[0]}


def chat_logprobs(token_text: TokenText, k: int, token_ids: list[int],
                  entries: list[dict[int, float]]) -> list[dict[str, Any]]:
    """The chat `logprobs.content` items of `token_ids`."""

    def item(tid: int, lp: Optional[float]) -> dict[str, Any]:
        text = token_text(tid)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    content = []
    for tid, entry in zip(token_ids, entries):
        one = item(tid, entry.get(tid))
        one["top_logprobs"] = [item(t, lp) for t, lp in _top(entry, k)]
        content.append(one)
    return content


# --------------------------------------------------------------------------- completions
def completion_choice(index: int, text: str, logprobs: Optional[dict[str, Any]],
                      finish_reason: Optional[str], stop_reason: Any) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason}


def completion_body(request_id: str, created: int, model: str, choices: list[dict[str, Any]],
                    usage_: Optional[dict[str, int]], chunk: bool = False) -> dict[str, Any]:
    """A completion (or, with `chunk`, one stream chunk; `usage_` None leaves it out)."""
    body: dict[str, Any] = {"id": request_id, "object": "text_completion", "created": created,
                            "model": model, "choices": choices}
    if usage_ is not None or not chunk:
        body["usage"] = usage_
    return body


# ---------------------------------------------------------------------------------- chat
def chat_choice(index: int, content: Optional[str], logprobs: Optional[list[dict[str, Any]]],
                finish_reason: Optional[str], stop_reason: Any,
                tool_calls: Optional[list[dict[str, Any]]] = None) -> dict[str, Any]:
    """One chat choice; `tool_calls` (OpenAI's entries) added to the message when given."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message,
            "logprobs": None if logprobs is None else {"content": logprobs},
            "finish_reason": finish_reason, "stop_reason": stop_reason}


def chat_chunk_choice(index: int, delta: dict[str, Any],
                      logprobs: Optional[list[dict[str, Any]]],
                      finish_reason: Optional[str], stop_reason: Any = None) -> dict[str, Any]:
    return {"index": index, "delta": delta,
            "logprobs": None if logprobs is None else {"content": logprobs},
            "finish_reason": finish_reason, "stop_reason": stop_reason}


def chat_body(request_id: str, created: int, model: str, choices: list[dict[str, Any]],
              usage_: Optional[dict[str, int]], chunk: bool = False) -> dict[str, Any]:
    """A chat completion (or, with `chunk`, one stream chunk; `usage_` None leaves it out)."""
    body: dict[str, Any] = {"id": request_id,
                            "object": "chat.completion.chunk" if chunk else "chat.completion",
                            "created": created, "model": model, "choices": choices}
    if usage_ is not None or not chunk:
        body["usage"] = usage_
    return body


def new_tokens(delta: ChoiceDelta) -> tuple[list[int], list[dict[int, float]]]:
    """The delta's token ids and their logprob entries (empty entries without logprobs)."""
    entries = delta.logprobs if delta.logprobs is not None else [{} for _ in delta.token_ids]
    return delta.token_ids, entries
