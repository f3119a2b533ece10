"""Tool calls on chat completions (OpenAI's `tools` and `tool_choice`).

- `"none"` (or no tools): a plain reply.
- A named function or `"required"`: the reply is constrained (structured outputs, as vLLM
  does) to that function's arguments, or to a JSON list of `{"name", "parameters"}` calls of
  the given functions, so the arguments always validate against the tools' schemas.
- `"auto"` (the default with tools): the model chooses; its reply is read in the common
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` form (Hermes', Qwen's), the text
  outside the tags being the content. A tag whose body is not such a JSON object stays in the
  content.

`ToolCalls.parse` turns a finished reply into OpenAI's message fields: `content` and
`tool_calls` (each with an id `call_...`, the arguments as a JSON string).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Optional

from engine.sampling_params import StructuredOutputsParams
from engine.server.errors import APIError

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


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
                 named: bool = False) -> None:
        self.functions, self.choice, self.named = functions, choice, named
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

    def parse(self, text: str) -> tuple[Optional[str], list[dict[str, Any]]]:
        """(content, tool_calls) of a finished reply. Under a named or required choice a
        reply the constraint did not let finish (max_tokens) gives no calls and its text as
        the content."""
        if self.named or self.choice == "required":
            try:
                value = json.loads(text)
            except ValueError:
                return text, []
            if self.named:
                return None, [tool_call(self.choice, value)]
            return None, [tool_call(c["name"], c["parameters"]) for c in value]
        calls, kept, last = [], [], 0
        for match in _TOOL_CALL.finditer(text):
            call = _hermes_call(match.group(1))
            if call is None:
                continue
            kept.append(text[last:match.start()])
            last = match.end()
            calls.append(call)
        kept.append(text[last:])
        content = "".join(kept).strip() if calls else text
        return (content or None), calls


def _hermes_call(body: str) -> Optional[dict[str, Any]]:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not (isinstance(value, dict) and isinstance(value.get("name"), str)):
        return None
    return tool_call(value["name"], value.get("arguments", {}))
