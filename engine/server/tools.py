"""Tool calls on chat completions (OpenAI's `tools` and `tool_choice`).

- `"none"` (or no tools): a plain reply.
- A named function or `"required"`: the reply is constrained (structured outputs, as vLLM
  does) to that function's arguments, or to a JSON list of `{"name", "parameters"}` calls of
  the given functions, so the arguments always validate against the tools' schemas.
- `"auto"` (the default with tools): the model chooses; its reply is read by the server's
  tool-call parser (`--tool-call-parser`, vLLM's names, `TOOL_CALL_PARSERS`):
  - `hermes` (default; Hermes', Qwen's form): `<tool_call>{"name": ..., "arguments": {...}}
    </tool_call>` tags, the text outside them being the content; a tag whose body is not such
    a JSON object stays in the content;
  - `llama3_json` (Llama 3.x): the whole reply (after an optional `<|python_tag|>`) is one
    JSON object `{"name": ..., "parameters": {...}}` (or `"arguments"`), or several joined by
    `;`; any other reply is content;
  - `mistral`: the text after `[TOOL_CALLS]` is a JSON list of `{"name", "arguments"}`, the
    text before it the content.

`ToolCalls.parse` turns a finished reply into OpenAI's message fields: `content` and
`tool_calls` (each with an id `call_...`, the arguments as a JSON string).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Callable, Optional

from engine.sampling_params import StructuredOutputsParams
from engine.server.errors import APIError

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_PYTHON_TAG = "<|python_tag|>"
MISTRAL_TAG = "[TOOL_CALLS]"
#: (content, tool_calls) of a finished reply; content None when nothing is left of it.
Parsed = tuple[Optional[str], list[dict[str, Any]]]


def call_id() -> str:
    """A fresh tool-call id in OpenAI's style."""
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call(name: str, arguments: Any) -> dict[str, Any]:
    """One entry of `tool_calls`: `arguments` (a value, or its JSON text) as JSON text."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments,
                                                                   ensure_ascii=False)
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": text}}


class ToolCalls:
    """How one chat request's tools are used: `functions` (name -> parameters schema) and
    `choice` ("none", "auto", "required" or a function's name). 400 naming `tool_choice` for
    a named function that is not among the tools, or a choice other than "none" without
    tools."""

    def __init__(self, functions: dict[str, dict[str, Any]], choice: str,
                 named: bool = False, parser: str = "hermes") -> None:
        self.functions, self.choice, self.named = functions, choice, named
        self.parser_name = parser
        self.parser = TOOL_CALL_PARSERS[parser]
        if named and choice not in functions:
            raise APIError(400, f"tool_choice: expected the name of one of the tools "
                           f"{sorted(functions)}, got {choice!r}", "tool_choice")
        if not functions and choice != "none":
            raise APIError(400, f"tool_choice: expected 'none' or no tool_choice without "
                           f"tools, got {choice!r}", "tool_choice")

    @property
    def active(self) -> bool:
        """Whether replies are read as tool calls."""
        return self.choice != "none"

    def constraint(self) -> Optional[StructuredOutputsParams]:
        """The structured output that enforces a named or required choice; None otherwise."""
        if self.named:
            return StructuredOutputsParams(json=self.functions[self.choice])
        if self.choice == "required":
            calls = [{"type": "object", "properties": {"name": {"enum": [name]},
                                                       "parameters": schema},
                      "required": ["name", "parameters"]}
                     for name, schema in self.functions.items()]
            return StructuredOutputsParams(json={"type": "array", "minItems": 1,
                                                 "items": {"anyOf": calls}})
        return None

    def parse(self, text: str) -> Parsed:
        """(content, tool_calls) of a finished reply, by the parser under "auto". Under a named
        or required choice a reply the constraint did not let finish (max_tokens) gives no
        calls and its text as the content."""
        if self.named or self.choice == "required":
            try:
                value = json.loads(text)
            except ValueError:
                return text, []
            if self.named:
                return None, [tool_call(self.choice, value)]
            return None, [tool_call(c["name"], c["parameters"]) for c in value]
        return self.parser(text)


def _json_call(value: Any, arguments: str = "arguments") -> Optional[dict[str, Any]]:
    """A `tool_calls` entry from a decoded `{"name": ..., arguments: {...}}`; None for any
    other value."""
    if not (isinstance(value, dict) and isinstance(value.get("name"), str)):
        return None
    return tool_call(value["name"], value.get(arguments, value.get("arguments", {})))


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def parse_hermes(text: str) -> Parsed:
    """`<tool_call>{...}</tool_call>` tags (module docstring)."""
    calls, kept, last = [], [], 0
    for match in _TOOL_CALL.finditer(text):
        call = _json_call(_loads(match.group(1)))
        if call is None:
            continue
        kept.append(text[last:match.start()])
        last = match.end()
        calls.append(call)
    kept.append(text[last:])
    content = "".join(kept).strip() if calls else text
    return (content or None), calls


def parse_llama3_json(text: str) -> Parsed:
    """The whole reply as `{"name", "parameters"}` objects joined by `;` (module docstring)."""
    body = text.strip()
    body = body[len(_PYTHON_TAG):] if body.startswith(_PYTHON_TAG) else body
    calls = [_json_call(_loads(part), "parameters") for part in body.split(";")]
    if not body or None in calls:
        return (text or None), []
    return None, [c for c in calls if c is not None]


def parse_mistral(text: str) -> Parsed:
    """`[TOOL_CALLS]` then a JSON list of calls (module docstring)."""
    head, tag, body = text.partition(MISTRAL_TAG)
    value = _loads(body) if tag else None
    value = [value] if isinstance(value, dict) else value
    calls = [_json_call(v) for v in value] if isinstance(value, list) else [None]
    if not calls or None in calls:
        return (text or None), []
    return (head.strip() or None), [c for c in calls if c is not None]


#: `--tool-call-parser` names (vLLM's) -> the parser of "auto" replies.
TOOL_CALL_PARSERS: dict[str, Callable[[str], Parsed]] = {
    "hermes": parse_hermes,
    "llama3_json": parse_llama3_json,
    "mistral": parse_mistral,
}
