"""Structured outputs, `logit_bias` and `best_of` through the server: one real
`python -m engine.serve` for the module, driven by the official `openai` client and raw HTTP.

Every constrained answer is parsed and validated (`jsonschema`, Python's `re`): chat and
completions, `response_format` and vLLM's `structured_outputs`, `n > 1`, streaming, stop
strings, concurrent constrained and unconstrained requests; `chat.completions.parse` with a
pydantic model; each bad field a 400 naming it.
"""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel
from serve_process import ServerProcess

SCHEMA = {"type": "object",
          "properties": {"city": {"type": "string", "maxLength": 10},
                         "rank": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["city", "rank"], "additionalProperties": False}
CHAT = [{"role": "user", "content": "Give a city and its rank as JSON."}]
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}


class City(BaseModel):
    city: str
    rank: int


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess("--max-model-len", "256", "--max-num-seqs", "16", "--num-threads", "1",
                         "--num-kv-blocks", "128")
    proc.start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0,
                         timeout=300)


@pytest.fixture(scope="module")
def model(server) -> str:
    return httpx.get(f"{server.base_url}/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=300) as c:
        yield c


def error_of(response: httpx.Response) -> dict:
    assert response.status_code == 400, response.text
    return response.json()["error"]


def test_chat_json_schema_n_streaming_and_stop_strings_validate(client, model):
    r = client.chat.completions.create(model=model, messages=CHAT, n=2, temperature=1.0, seed=1,
                                       max_tokens=40, response_format=RESPONSE_FORMAT,
                                       stop=['"'])
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    stream = client.chat.completions.create(model=model, messages=CHAT, max_tokens=40,
                                            temperature=0.0, response_format=RESPONSE_FORMAT,
                                            stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_parse_with_a_pydantic_model_returns_the_object(client, model):
    r = client.chat.completions.parse(model=model, messages=CHAT, response_format=City,
                                      max_tokens=40, temperature=0.0)
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, City) and parsed.city


def test_completions_regex_choice_json_mode_and_a_mixed_batch(server, client, model):
    pattern = r"[0-9]{3}-[0-9]{4}"
    r = client.completions.create(model=model, prompt="Call me at", max_tokens=20,
                                  extra_body={"structured_outputs": {"regex": pattern}})
    assert re.fullmatch(pattern, r.choices[0].text), r.choices[0].text
    r = client.completions.create(model=model, prompt="Yes or no?", max_tokens=5, n=2,
                                  temperature=1.0,
                                  extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert {c.text for c in r.choices} <= {"yes", "no"}

    async def mixed() -> list:
        aclient = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused",
                                     max_retries=0, timeout=300)
        constrained = [aclient.completions.create(
            model=model, prompt=f"Object {i}:", max_tokens=30, temperature=1.0, seed=i,
            extra_body={"response_format": {"type": "json_object"}}) for i in range(4)]
        free = [aclient.completions.create(model=model, prompt=f"Story {i}:", max_tokens=20)
                for i in range(2)]
        return await asyncio.gather(*constrained, *free)

    results = asyncio.run(mixed())
    assert any(r.choices[0].finish_reason == "stop" for r in results[:4])
    for r in results[:4]:
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(r.choices[0].text), dict)
        else:  # a JSON object the model did not finish in 30 tokens
            assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 30
    assert all(r.usage.completion_tokens == 20 for r in results[4:])


def test_logit_bias_forces_and_bans_tokens(client, http, model):
    base = client.completions.create(model=model, prompt="The capital of France is",
                                     max_tokens=3, temperature=0.0, logprobs=0)
    first = base.choices[0].logprobs.tokens[0]
    tok = client.completions.create(model=model, prompt="x", max_tokens=1, temperature=0.0,
                                    logprobs=0, logit_bias={"28": 100})
    assert tok.choices[0].logprobs.tokens == [tok.choices[0].text]
    forced = client.completions.create(model=model, prompt="The capital of France is",
                                       max_tokens=3, temperature=0.0, logit_bias={"28": 100})
    assert forced.choices[0].text == tok.choices[0].text * 3
    ids = http.post("/tokenize", json={"prompt": first, "add_special_tokens": False}
                    ).json()["tokens"]
    banned = client.completions.create(model=model, prompt="The capital of France is",
                                       max_tokens=1, temperature=0.0, logprobs=0,
                                       logit_bias={str(ids[0]): -100})
    assert banned.choices[0].logprobs.tokens[0] != first


def test_best_of_returns_the_n_most_likely_of_its_candidates(client, model):
    kw = dict(model=model, prompt="Once upon a time", max_tokens=6, temperature=1.0, seed=5)
    every = client.completions.create(n=4, logprobs=0, **kw)
    score = {c.text: sum(c.logprobs.token_logprobs) for c in every.choices}
    best = client.completions.create(n=2, best_of=4, **kw)
    expected = sorted(score, key=lambda t: -score[t])[:2]
    assert [c.text for c in best.choices] == expected
    assert [c.index for c in best.choices] == [0, 1]


@pytest.mark.parametrize("path, body, param, says", [
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format", "expected a JSON schema that compiles"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"regex": "a(b"}},
     "structured_outputs", "expected a regular expression that compiles"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"grammar": "root ::= x"}},
     "structured_outputs", "expected an EBNF grammar that compiles"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"regex": "a", "choice": ["b"]}},
     "structured_outputs", "expected exactly one of"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"choice": ["a"]},
                         "response_format": {"type": "json_object"}},
     "structured_outputs", "got both"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema"}},
     "response_format.json_schema", "expected an object with a schema"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"abc": 1}}, "logit_bias",
     "expected token ids in [0, "),
    ("/v1/chat/completions", {"messages": CHAT, "logit_bias": {"5": 101}}, "logit_bias",
     "expected biases in [-100, 100], got 101"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"99999999": 1}}, "logit_bias",
     "got '99999999'"),
    ("/v1/completions", {"prompt": "hi", "n": 3, "best_of": 2}, "best_of",
     "expected None or an integer in [n=3, 64], got 2"),
    ("/v1/completions", {"prompt": "hi", "best_of": 2, "stream": True}, "best_of",
     "when streaming"),
])
def test_bad_fields_are_400_naming_them(http, path, body, param, says):
    err = error_of(http.post(path, json=body))
    assert err["param"] == param and says in err["message"], err


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def check_call(call, tools=(WEATHER, TIME)) -> None:
    spec = next(t["function"] for t in tools if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), spec["parameters"])
    assert call.id.startswith("call_") and call.type == "function"


def test_named_and_required_tool_choice_give_valid_calls_and_a_round_trip(client, model):
    r = client.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER, TIME], max_tokens=40, temperature=0.0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    check_call(call)
    r = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER, TIME],
                                       tool_choice="required", max_tokens=60, temperature=1.0,
                                       seed=2, n=2)
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and c.message.tool_calls
        for each in c.message.tool_calls:
            check_call(each)
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}]
    final = client.chat.completions.create(model=model, messages=history, tools=[WEATHER],
                                           tool_choice="none", max_tokens=12)
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls


def test_streamed_tool_calls_have_the_openai_shape(client, model):
    stream = client.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=40,
        temperature=0.0, stream=True)
    chunks = [c for c in stream if c.choices]
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert calls and calls[0].index == 0 and calls[0].id.startswith("call_")
    assert calls[0].function.name == "get_weather"
    assert [tc.index for tc in calls if tc.id] == [0]  # announced once
    pieces = [tc.function.arguments for tc in calls if tc.function.arguments]
    assert len(pieces) > 1  # the arguments stream as the model writes them
    jsonschema.validate(json.loads("".join(pieces)), WEATHER["function"]["parameters"])


def test_auto_reads_hermes_tool_calls_and_leaves_other_text():
    from engine.server.tools import ToolCalls

    auto = ToolCalls({"f": {"type": "object"}}, "auto")
    text = 'Let me check.<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    content, calls = auto.parse(text + '<tool_call>not json</tool_call>')
    assert content == "Let me check.<tool_call>not json</tool_call>"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] \
        == [("f", {"x": 1})]
    assert auto.parse("Just text.") == ("Just text.", [])


@pytest.mark.parametrize("body, param, says", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "expected the name of one of the tools ['get_weather'], got 'nope'"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "with response_format"),
])
def test_bad_tool_choices_are_400(http, body, param, says):
    err = error_of(http.post("/v1/chat/completions",
                             json={"messages": ASK, "tools": [WEATHER], **body}))
    assert err["param"] == param and says in err["message"], err


def test_tool_choice_without_tools_is_400(http):
    err = error_of(http.post("/v1/chat/completions",
                             json={"messages": ASK, "tool_choice": "required"}))
    assert err["param"] == "tool_choice" and "without tools" in err["message"], err
