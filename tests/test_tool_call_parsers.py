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


# ---------------------------------------------------------------------------- streaming
def streamed(tools, text, piece):
    """Feeds `text` in pieces of `piece` characters; returns (content, calls as (id, name,
    arguments text)), whether it made calls, and the delta bodies."""
    from engine.server.tool_stream import ToolCallStream

    stream = ToolCallStream(tools)
    bodies = []
    for i in range(0, len(text), piece):
        bodies += stream.feed(text[i:i + piece])
    last, called = stream.finish()
    bodies += last
    content, calls = "", {}
    for body in bodies:
        content += body.get("content", "")
        for call in body.get("tool_calls", []):
            if "id" in call:
                assert call["index"] not in calls and call["type"] == "function"
                calls[call["index"]] = [call["id"], call["function"]["name"],
                                        call["function"].get("arguments", "")]
            else:
                calls[call["index"]][2] += call["function"]["arguments"]
    return content, [tuple(calls[k]) for k in sorted(calls)], called, bodies


FUNCS = {"f": {"type": "object"}, "g": {"type": "object"}}
STREAM_CASES = [
    (ToolCalls(FUNCS, "auto"), 'Sure.\n<tool_call>{"name": "f", "arguments": {"x": "}{"}}'
     '</tool_call>\n<tool_call>{"name": "g", "arguments": {"y": [1, {"z": 2}]}}</tool_call>',
     "Sure.\n\n", [("f", {"x": "}{"}), ("g", {"y": [1, {"z": 2}]})]),
    (ToolCalls(FUNCS, "auto"), "no <tool_ call here < tool", "no <tool_ call here < tool", []),
    (ToolCalls(FUNCS, "auto"), "<tool_call>not json</tool_call>",
     "<tool_call>not json</tool_call>", []),
    (ToolCalls(FUNCS, "f", named=True), '{"x": 1, "s": "a\\"b"}', "", [("f", {"x": 1,
                                                                            "s": 'a"b'})]),
    (ToolCalls(FUNCS, "required"), '[{"name": "f", "parameters": {"x": 1}}, '
     '{"name": "g", "parameters": {}}]', "", [("f", {"x": 1}), ("g", {})]),
    (ToolCalls(FUNCS, "auto", parser="mistral"), 'Ok.[TOOL_CALLS][{"name": "f", "arguments": '
     '{"x": 1}}]', "Ok.", [("f", {"x": 1})]),
    (ToolCalls(FUNCS, "auto", parser="llama3_json"), '{"name": "f", "parameters": {"x": 1}}',
     "", [("f", {"x": 1})]),
]


@pytest.mark.parametrize("piece", [1, 3, 1000])
@pytest.mark.parametrize("case", range(len(STREAM_CASES)))
def test_streamed_calls_add_up_to_the_finished_reading(case, piece):
    """Whatever the pieces, the deltas add up to the content and calls of the finished reply
    (arguments as the model wrote them), each call announced once with its id and name."""
    tools, text, want_content, want_calls = STREAM_CASES[case]
    content, calls, called, _ = streamed(tools, text, piece)
    assert called == bool(want_calls)
    assert [(name, json.loads(args)) for _, name, args in calls] == want_calls
    assert all(cid.startswith("call_") for cid, _, _ in calls)
    assert content == want_content


def test_arguments_stream_while_the_model_writes_them():
    """Named function: argument pieces go out before the reply ends; hermes: the call's name
    goes out as soon as it is complete, content before the tag at once."""
    from engine.server.tool_stream import ToolCallStream

    named = ToolCallStream(ToolCalls(FUNCS, "f", named=True))
    first = named.feed('{"x": 1')
    assert first[0]["tool_calls"][0]["function"] == {"name": "f", "arguments": ""}
    assert first[1]["tool_calls"][0]["function"]["arguments"] == '{"x": 1'
    hermes = ToolCallStream(ToolCalls(FUNCS, "auto"))
    assert hermes.feed("Hi <tool") == [{"content": "Hi "}]
    assert hermes.feed('_call>{"name": "g", "arg') == []
    announced = hermes.feed('uments": {"a"')
    assert announced[0]["tool_calls"][0]["function"]["name"] == "g"
    assert announced[1]["tool_calls"][0]["function"]["arguments"] == '{"a"'
