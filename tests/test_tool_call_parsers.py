"""The tool-call parsers of "auto" replies (`--tool-call-parser`): each reads its model
family's form into OpenAI's `tool_calls` and leaves any other reply as plain content."""

from __future__ import annotations

import json

import pytest

from engine.server.tools import TOOL_CALL_PARSERS, ToolCalls


def calls_of(parsed):
    content, calls = parsed
    return content, [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                     for c in calls]


@pytest.mark.parametrize("parser, text, want", [
    ("hermes", 'Sure.\n<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>',
     ("Sure.", [("f", {"x": 1})])),
    ("hermes", '<tool_call>not json</tool_call>', ("<tool_call>not json</tool_call>", [])),
    ("llama3_json", '{"name": "f", "parameters": {"x": 1}}', (None, [("f", {"x": 1})])),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", '
                    '"arguments": {"y": [2]}}', (None, [("f", {}), ("g", {"y": [2]})])),
    ("llama3_json", 'The answer is {"name": "f"}', ('The answer is {"name": "f"}', [])),
    ("llama3_json", '{"city": "Paris"}', ('{"city": "Paris"}', [])),
    ("mistral", 'Let me look.[TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}, '
                '{"name": "g", "arguments": {}}]', ("Let me look.", [("f", {"x": 1}),
                                                                     ("g", {})])),
    ("mistral", '[TOOL_CALLS]{"name": "f", "arguments": {"x": 1}}', (None, [("f", {"x": 1})])),
    ("mistral", '[TOOL_CALLS] oops', ("[TOOL_CALLS] oops", [])),
    ("mistral", "no calls here", ("no calls here", [])),
])
def test_each_parser_reads_its_form(parser, text, want):
    assert calls_of(TOOL_CALL_PARSERS[parser](text)) == want


def test_auto_replies_use_the_chosen_parser_and_ids_are_openai_shaped():
    tools = ToolCalls({"f": {"type": "object"}}, "auto", parser="llama3_json")
    content, calls = tools.parse('{"name": "f", "parameters": {"x": 1}}')
    assert content is None and calls[0]["id"].startswith("call_")
    assert calls[0]["type"] == "function"
    hermes = ToolCalls({"f": {"type": "object"}}, "auto")
    assert hermes.parse('{"name": "f", "parameters": {"x": 1}}')[1] == []
