"""Sending one `Spec` and judging what came back, with the official `openai` client or raw
httpx, into a `Result` whose `outcome` is one of:

- `ok`: a complete answer: every choice has a `finish_reason` (a stream also ended with
  `[DONE]`);
- `error`: a clear error: OpenAI's error JSON (or, once a stream began, an error event);
- `refused`: a bad request answered with the expected 4xx, in OpenAI's shape, naming the field;
- `disconnected`: the client left on purpose before the end;

or a failure: `timeout` (no end within the per-request timeout), `truncated` (a stream or body
that ended without its end and without an error), `malformed` (an error that is not OpenAI's
shape, or an answer missing choices), `wrong_status` (a bad request answered otherwise), and
`transport` (the connection failed). The judge adds `mismatch` for a greedy answer that differs
from the clean run's.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import httpx
import openai

from bench.soak.workload import Spec

#: Outcomes that are not failures.
GOOD_OUTCOMES = ("ok", "error", "refused", "disconnected")

#: Body fields the openai client takes as arguments; the rest go in `extra_body`.
_OPENAI_ARGS = {"model", "prompt", "messages", "max_tokens", "temperature", "n", "stop", "seed",
                "stream", "stream_options", "top_p"}


@dataclass
class Result:
    """What one request got. `start`/`end`: Unix seconds; `texts`: the text per choice index;
    `status`: the HTTP status (or a stream error event's code)."""

    kind: str
    api: str
    client: str
    stream: bool
    start: float
    end: float = 0.0
    outcome: str = ""
    status: Optional[int] = None
    detail: str = ""
    texts: dict[int, str] = field(default_factory=dict)
    completion_tokens: int = 0
    reference: Optional[int] = None
    #: The field an error named (OpenAI's `param`).
    param: Optional[str] = None


def is_openai_error(body: Any) -> bool:
    """OpenAI's error shape: `{"error": {"message": str, "type": str, "code": ...}}`."""
    err = body.get("error") if isinstance(body, dict) else None
    return (isinstance(err, dict) and isinstance(err.get("message"), str)
            and isinstance(err.get("type"), str) and "code" in err)


async def send(spec: Spec, http: httpx.AsyncClient, oai: openai.AsyncOpenAI,
               timeout: float) -> Result:
    """Sends `spec` and judges the answer; never raises (but for cancellation)."""
    result = Result(spec.kind, spec.api, spec.client, spec.stream, time.time(),
                    reference=spec.reference)
    run = _send_openai if spec.client == "openai" else _send_httpx
    try:
        await asyncio.wait_for(run(spec, http, oai, result), timeout)
    except asyncio.TimeoutError:
        _set(result, "timeout", detail=f"no end within {timeout:.0f} s")
    except (httpx.TransportError, openai.APIConnectionError) as exc:
        outcome = "truncated" if result.texts or result.status == 200 else "transport"
        _set(result, outcome, detail=f"{type(exc).__name__}: {exc}")
    except Exception as exc:  # noqa: BLE001 - recorded as a failure, never hidden
        _set(result, "malformed", detail=f"{type(exc).__name__}: {exc}")
    result.end = time.time()
    if spec.expect_status is not None and result.outcome in ("ok", "error"):
        _judge_refusal(spec, result)
    return result


def _set(result: Result, outcome: str, status: Optional[int] = None, detail: str = "") -> None:
    if not result.outcome:
        result.outcome = outcome
        result.detail = detail[:300]
        if status is not None:
            result.status = status


def _judge_refusal(spec: Spec, result: Result) -> None:
    param = result.param
    if result.status == spec.expect_status and (spec.expect_param is None
                                                or param == spec.expect_param):
        result.outcome = "refused"
        return
    result.outcome = "wrong_status"
    result.detail = (f"expected {spec.expect_status} naming {spec.expect_param!r}, got "
                     f"{result.status} naming {param!r}")


def _error(result: Result, status: int, body: Any) -> None:
    """An error answer: `error` (detail: its message) if OpenAI-shaped, else `malformed`."""
    if is_openai_error(body):
        _set(result, "error", status, body["error"]["message"])
        result.status = status
        result.param = body["error"].get("param")
    else:
        _set(result, "malformed", status, f"error body not in OpenAI's shape: {body!r}")


def _finish(spec: Spec, result: Result, finished: set[int], done: bool = True) -> None:
    expected = set(range(spec.num_choices * _num_prompts(spec)))
    if not done:
        _set(result, "truncated", 200, "the stream ended without [DONE] or an error event")
    elif finished != expected:
        _set(result, "truncated", 200, f"choices finished {sorted(finished)}, expected "
                                       f"{sorted(expected)}")
    else:
        _set(result, "ok", 200)


def _num_prompts(spec: Spec) -> int:
    prompt = spec.body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return len(prompt)
    return 1


# ------------------------------------------------------------------------------- httpx
async def _send_httpx(spec: Spec, http: httpx.AsyncClient, oai: Any, result: Result) -> None:
    content = spec.raw_body if spec.raw_body is not None else json.dumps(spec.body).encode()
    kwargs: dict[str, Any] = {"headers": {"Content-Type": "application/json"}}
    if spec.method != "GET":
        kwargs["content"] = content
    if spec.stream:
        await _stream_httpx(spec, http, kwargs, result)
        return
    request = http.request(spec.method, spec.url_path, **kwargs)
    if spec.disconnect_after is not None:
        try:
            response = await asyncio.wait_for(request, spec.disconnect_after)
        except asyncio.TimeoutError:
            _set(result, "disconnected", detail=f"left after {spec.disconnect_after:.2f} s")
            return
    else:
        response = await request
    _judge_body(spec, result, response.status_code, parse_json(response.content))


def parse_json(data: bytes) -> Any:
    """`data` as JSON, or `{"unparsed": its start}`."""
    try:
        return json.loads(data)
    except ValueError:
        return {"unparsed": data[:200].decode("utf-8", "replace")}


def _judge_body(spec: Spec, result: Result, status: int, body: Any) -> None:
    if status != 200:
        _error(result, status, body)
        return
    if not isinstance(body, dict) or not isinstance(body.get("choices"), list):
        _set(result, "malformed", status, f"a 200 without choices: {str(body)[:200]}")
        return
    finished = set()
    for choice in body["choices"]:
        index = choice.get("index", 0)
        text = choice.get("text") if spec.api == "completion" else \
            (choice.get("message") or {}).get("content")
        result.texts[index] = text or ""
        if choice.get("finish_reason") in ("stop", "length"):
            finished.add(index)
    result.completion_tokens = int((body.get("usage") or {}).get("completion_tokens", 0))
    _finish(spec, result, finished)


async def _stream_httpx(spec: Spec, http: httpx.AsyncClient, kwargs: dict[str, Any],
                        result: Result) -> None:
    async with http.stream(spec.method, spec.url_path, **kwargs) as response:
        if response.status_code != 200:
            _error(result, response.status_code, parse_json(await response.aread()))
            return
        result.status = 200
        if spec.disconnect_after == 0:
            _set(result, "disconnected", detail="left after the headers")
            return
        finished: set[int] = set()
        events = 0
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                _finish(spec, result, finished)
                return
            event = json.loads(data)
            if "error" in event:
                code = event["error"].get("code") if isinstance(event["error"], dict) else None
                _error(result, code if isinstance(code, int) else 500, event)
                continue
            _add_chunk(spec, result, event, finished)
            events += 1
            if spec.disconnect_after is not None and events >= spec.disconnect_after:
                _set(result, "disconnected", detail=f"left after {events} events")
                return
        _finish(spec, result, finished, done=False)


def _add_chunk(spec: Spec, result: Result, event: dict[str, Any], finished: set[int]) -> None:
    for choice in event.get("choices") or []:
        index = choice.get("index", 0)
        text = choice.get("text") if spec.api == "completion" else \
            (choice.get("delta") or {}).get("content")
        result.texts[index] = result.texts.get(index, "") + (text or "")
        if choice.get("finish_reason") in ("stop", "length"):
            finished.add(index)
    if event.get("usage"):
        result.completion_tokens = int(event["usage"].get("completion_tokens", 0))


# ------------------------------------------------------------------------------ openai
async def _send_openai(spec: Spec, http: Any, oai: openai.AsyncOpenAI, result: Result) -> None:
    args = {k: v for k, v in spec.body.items() if k in _OPENAI_ARGS}
    extra = {k: v for k, v in spec.body.items() if k not in _OPENAI_ARGS}
    create = oai.completions.create if spec.api == "completion" \
        else oai.chat.completions.create
    try:
        answer = await create(**args, extra_body=extra or None)
        if not spec.stream:
            _judge_body(spec, result, 200, answer.model_dump())
            return
        result.status = 200
        finished: set[int] = set()
        async for chunk in answer:
            _add_chunk(spec, result, chunk.model_dump(), finished)
        # the client stops at [DONE] and also when the body just ends: a missing finish_reason
        # is what shows a cut stream
        _finish(spec, result, finished)
    except openai.APIStatusError as exc:
        _error(result, exc.status_code, parse_json(exc.response.content))
    except openai.APIConnectionError:
        raise
    except openai.APIError as exc:  # an error event in a stream
        body = {"error": exc.body} if isinstance(exc.body, dict) else exc.body
        code = exc.body.get("code") if isinstance(exc.body, dict) else None
        _error(result, code if isinstance(code, int) else 500, body)
