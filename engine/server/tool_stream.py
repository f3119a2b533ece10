"""Streaming a chat reply's tool calls as OpenAI streams them: a call's first chunk carries its
`index`, `id`, `type` and `function.name` (arguments ""), the following ones `function.arguments`
pieces as the model writes them; content outside the calls streams as content.

`ToolCallStream.feed` takes the reply's new text and returns the chunk bodies (`delta`s) it
allows: the text seen so far is re-read at every feed, which is cheap at reply sizes. A call is
announced once its name is complete; its arguments stream from the `{` that opens them, and
while that object is open every character belongs to it, so nothing sent is ever taken back.
Content that might still turn out to be the start of a call's tag is held back until it
cannot. Per `engine.server.tools`' forms:
- a named function: the whole reply is the arguments;
- `"required"`: the reply is `[{"name": ..., "parameters": {...}}, ...]`;
- `"auto"` with `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` tags;
  with `mistral`: content, then `[TOOL_CALLS]` and a list of `{"name", "arguments"}`;
  with `llama3_json`: the whole reply decides whether it is a call, so nothing streams until it
  has finished.
`finish` flushes what was held and, where the finished reply reads differently than the stream
suggested (a form the parser rejects at the end), sends what the final reading adds.
"""

from __future__ import annotations

import json
import re
from typing import Any, Optional

from engine.server.tools import MISTRAL_TAG, ToolCalls, call_id

__all__ = ["ToolCallStream"]

_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_NAME = r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"%s"\s*:\s*'
_HERMES_HEAD = re.compile(_NAME % "arguments")
_REQUIRED_HEAD = re.compile(r'\s*[\[,]' + _NAME % "parameters")
_MISTRAL_HEAD = re.compile(r'\s*[\[,]' + _NAME % "arguments")

#: (name, arguments text so far) of each call found in a reply so far.
Found = list[tuple[str, str]]


def json_value_end(text: str, start: int) -> Optional[int]:
    """The index just past the JSON object or array that opens at `text[start]`, or None while
    it is still open (strings and escapes respected)."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            escaped, in_string = (False, True) if escaped else (c == "\\", c != '"')
            continue
        if c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _arguments(text: str, start: int) -> str:
    end = json_value_end(text, start)
    return text[start:] if end is None else text[start:end]


def _named(text: str, name: str) -> Found:
    start = len(text) - len(text.lstrip())
    return [(name, _arguments(text, start))] if text[start:start + 1] == "{" else []


def _listed(text: str, head: re.Pattern) -> Found:
    """Calls of a JSON list `[{"name": ..., "<arguments>": {...}}, ...]` starting at `text[0]`."""
    found, pos = [], 0
    while (match := head.match(text, pos)) is not None:
        start = match.end()
        args = _arguments(text, start)
        found.append((json.loads(f'"{match.group(1)}"'), args))
        end = json_value_end(text, start)
        if end is None:
            break
        close = text.find("}", end)
        if close < 0:
            break
        pos = close + 1
    return found


def _hermes(text: str) -> tuple[str, Found]:
    """(content so far, calls so far) of a reply in hermes tags."""
    content, found, pos = [], [], 0
    while True:
        open_at = text.find(_HERMES_OPEN, pos)
        if open_at < 0:
            content.append(_hold_prefix(text[pos:], _HERMES_OPEN))
            return "".join(content), found
        content.append(text[pos:open_at])
        body = open_at + len(_HERMES_OPEN)
        match = _HERMES_HEAD.match(text, body)
        if match is None or match.end() >= len(text) or text[match.end()] != "{":
            return "".join(content), found  # the call's head is still being written
        found.append((json.loads(f'"{match.group(1)}"'), _arguments(text, match.end())))
        close = text.find(_HERMES_CLOSE, match.end())
        if close < 0:
            return "".join(content), found
        pos = close + len(_HERMES_CLOSE)


def _hold_prefix(text: str, tag: str) -> str:
    """`text` without a trailing piece that could be the start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return text[:-n]
    return text


def _mistral(text: str) -> tuple[str, Found]:
    head, tag, rest = text.partition(MISTRAL_TAG)
    if not tag:
        return _hold_prefix(head, MISTRAL_TAG), []
    if rest.lstrip().startswith("{"):
        rest = "[" + rest.lstrip()
    return head, _listed(rest, _MISTRAL_HEAD)


class ToolCallStream:
    """One streamed choice's content and tool-call deltas (module docstring)."""

    def __init__(self, tools: ToolCalls) -> None:
        self.tools = tools
        self.text = ""
        self.sent_content = 0
        self.calls: list[dict[str, Any]] = []  # {"id", "name", "sent"}
        #: the reply's form: "named", "required" or the parser's name
        self.form = ("named" if tools.named else "required" if tools.choice == "required"
                     else tools.parser_name)

    def feed(self, new_text: str) -> list[dict[str, Any]]:
        """The chunk `delta` bodies `new_text` allows."""
        self.text += new_text
        content, found = self._read()
        return self._deltas(content, found)

    def finish(self) -> tuple[list[dict[str, Any]], bool]:
        """The last deltas and whether the reply made tool calls: what the stream still allows,
        then, by the finished reply's own reading (`ToolCalls.parse`), the content that was
        held (no calls) or the calls the stream did not announce (whole)."""
        out = self.feed("")
        content, calls = self.tools.parse(self.text)
        if not calls and not self.calls:
            rest = self.text[self.sent_content:]
            return out + ([{"content": rest}] if rest else []), False
        if content and not self.sent_content and not self.calls:
            out.append({"content": content})
        for k, call in enumerate(calls[len(self.calls):], start=len(self.calls)):
            out.append({"tool_calls": [dict(call, index=k)]})
        return out, True

    def _read(self) -> tuple[str, Found]:
        if self.form == "named":
            return "", _named(self.text, self.tools.choice)
        if self.form == "required":
            return "", _listed(self.text, _REQUIRED_HEAD)
        if self.form == "hermes":
            return _hermes(self.text)
        if self.form == "mistral":
            return _mistral(self.text)
        return "", []  # llama3_json: read when finished

    def _deltas(self, content: str, found: Found) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if len(content) > self.sent_content:
            out.append({"content": content[self.sent_content:]})
            self.sent_content = len(content)
        for k, (name, args) in enumerate(found):
            if k == len(self.calls):
                self.calls.append({"id": call_id(), "name": name, "sent": 0})
                out.append({"tool_calls": [{"index": k, "id": self.calls[k]["id"],
                                            "type": "function",
                                            "function": {"name": name, "arguments": ""}}]})
            call = self.calls[k]
            if len(args) > call["sent"]:
                out.append({"tool_calls": [{"index": k, "function": {
                    "arguments": args[call["sent"]:]}}]})
                call["sent"] = len(args)
        return out
