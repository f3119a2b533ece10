"""Requests that are not what they claim, against a real `python -m engine.serve` on loopback:
text that is not valid Unicode (lone surrogates from JSON `\\ud800` escapes) in any string field,
numbers out of range, stop lists beyond the server's limits. Each is a 400 in OpenAI's shape
naming the field, saying what was expected and what was given, and the connection stays usable.
An unexpected exception's 500 says `Connection: close`.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn
from fastapi import FastAPI
from serve_process import ServerProcess, free_port

from engine.server.errors import error_body, install_error_handlers

MAX_STOP, MAX_STOP_LEN = 6, 40
CHAT = [{"role": "user", "content": "Name a colour."}]
BAD = "\\ud800"  # a JSON escape that decodes to a lone surrogate


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess("--max-model-len", "96", "--num-threads", "1", "--num-kv-blocks", "64",
                         "--max-stop-strings", str(MAX_STOP),
                         "--max-stop-string-length", str(MAX_STOP_LEN))
    proc.start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def model(http) -> str:
    return http.get("/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0,
                         timeout=120)


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


# (path, JSON text with a lone surrogate somewhere, the field the 400 must name)
SURROGATES = [
    ("/v1/completions", f'{{"prompt": "a{BAD}b", "max_tokens": 2}}', "prompt"),
    ("/v1/completions", f'{{"prompt": ["ok", "x{BAD}"], "max_tokens": 2}}', "prompt.1"),
    ("/v1/completions", f'{{"model": "m{BAD}", "prompt": "hi"}}', "model"),
    ("/v1/completions", f'{{"prompt": "hi", "stop": ["a", "{BAD}"]}}', "stop.1"),
    ("/v1/completions", f'{{"prompt": "hi", "stop": "{BAD}"}}', "stop"),
    ("/v1/completions", f'{{"prompt": "hi", "user": "{BAD}"}}', "user"),
    ("/v1/completions", f'{{"prompt": "hi", "unknown_field": {{"k": "{BAD}"}}}}',
     "unknown_field.k"),
    ("/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": "{BAD}"}}]}}',
     "messages.0.content"),
    ("/v1/chat/completions",
     f'{{"messages": [{{"role": "user", "content": [{{"type": "text", "text": "ok"}}, '
     f'{{"type": "text", "text": "x{BAD}y"}}]}}]}}', "messages.0.content.1.text"),
    ("/v1/chat/completions",
     f'{{"messages": [{{"role": "user", "content": "hi", "name": "n{BAD}"}}]}}',
     "messages.0.name"),
    ("/v1/chat/completions", f'{{"messages": [{{"role": "user{BAD}", "content": "hi"}}]}}',
     "messages.0.role"),
    ("/tokenize", f'{{"prompt": "{BAD}"}}', "prompt"),
    ("/tokenize", f'{{"messages": [{{"role": "user", "content": "{BAD}"}}]}}',
     "messages.0.content"),
    ("/detokenize", f'{{"tokens": [1], "model": "{BAD}"}}', "model"),
]


@pytest.mark.parametrize("path, body, field", SURROGATES)
def test_text_that_is_not_unicode_is_400_naming_the_field(http, path, body, field):
    r = http.post(path, content=body.encode(), headers={"content-type": "application/json"})
    err = error_of(r, 400)
    assert err["param"] == field
    assert err["message"].startswith(f"{field}: expected valid Unicode text")
    assert "U+D800" in err["message"]
    r.content.decode("utf-8")  # the body is valid UTF-8 JSON


def test_the_connection_stays_usable_after_bad_text(server):
    """Raw keep-alive HTTP/1.1: a 400 for bad text, then a normal request on the same
    socket."""
    body = f'{{"prompt": "a{BAD}", "max_tokens": 1}}'.encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                     b"application/json\r\nContent-Length: " + str(len(body)).encode()
                     + b"\r\n\r\n" + body)
        head, rest = read_response(sock)
        assert head.startswith(b"HTTP/1.1 400") and b"connection: close" not in head.lower()
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        head, _ = read_response(sock)
        assert head.startswith(b"HTTP/1.1 200")


def read_response(sock: socket.socket) -> tuple[bytes, bytes]:
    """(head, body) of one Content-Length-delimited response."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed mid-response: {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk
        body += chunk
    return head, body


@pytest.mark.parametrize("seed", [2**64, 2**63, -(2**63) - 1, 10**30])
def test_seed_out_of_range_is_400_in_the_apis_words(client, seed):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="m", prompt="hi", max_tokens=1, seed=seed)
    err = info.value.body
    assert err["param"] == "seed"
    assert err["message"].startswith("seed: expected a value ")
    assert err["message"].endswith(f"got {seed}") and "Overflow" not in err["message"]


@pytest.mark.parametrize("payload, field, expected", [
    ({"max_tokens": 10**30}, "max_tokens", f"{10**30} for the completion"),
    ({"n": 10**30}, "n", "expected a value <= 64"),
    ({"logprobs": 10**30}, "logprobs", "expected a value <= 20"),
    ({"min_tokens": 10**30}, "min_tokens", "expected at most max_tokens=16"),
    ({"best_of": 10**30}, "best_of", "expected None or an integer in [n=1, 64]"),
    ({"stop_token_ids": [10**30]}, "stop_token_ids", "expected token ids in [0, "),
    ({"stop_token_ids": [-1]}, "stop_token_ids", "expected token ids in [0, "),
    ({"top_k": -2}, "top_k", "expected a value >= -1"),
    ({"temperature": "hot"}, "temperature", "expected a number"),
])
def test_numbers_out_of_range_say_field_expected_given(http, payload, field, expected):
    err = error_of(http.post("/v1/completions", json={"prompt": "hi", **payload}), 400)
    assert err["param"] == field and expected in err["message"], err
    given = payload[field][0] if isinstance(payload[field], list) else payload[field]
    assert str(given) in err["message"] and "Input should" not in err["message"]


def test_stop_lists_beyond_the_limits_are_400(client, http, model):
    too_many = [f"s{i}" for i in range(MAX_STOP + 1)]
    err = error_of(http.post("/v1/completions", json={"prompt": "hi", "stop": too_many}), 400)
    assert err["param"] == "stop"
    assert f"at most {MAX_STOP} strings" in err["message"] and f"got {MAX_STOP + 1}" \
        in err["message"]
    too_long = ["a", "z" * (MAX_STOP_LEN + 1)]
    err = error_of(http.post("/v1/chat/completions", json={"messages": CHAT, "stop": too_long}),
                   400)
    assert err["param"] == "stop" and f"at most {MAX_STOP_LEN} characters" in err["message"]
    assert f"got {MAX_STOP_LEN + 1} characters in stop.1" in err["message"]
    at_limit = ["\u2603" * MAX_STOP_LEN] * MAX_STOP
    r = client.completions.create(model=model, prompt="hi", max_tokens=2, stop=at_limit)
    assert r.choices[0].finish_reason == "length"


def test_a_prompt_too_long_by_its_length_is_refused_untokenised(http):
    err = error_of(http.post("/v1/completions", json={"prompt": "ab " * 20_000}), 400)
    assert err["param"] == "prompt" and "at least" in err["message"]
    err = error_of(http.post("/tokenize", json={"prompt": "ab " * 20_000}), 400)
    assert "maximum context length is 96" in err["message"]


def test_error_bodies_always_serialise():
    body = error_body(400, "model: 'x\ud800' is unknown", "m\udfff")
    text = json.dumps(body, ensure_ascii=False).encode("utf-8").decode("utf-8")
    assert "\\ud800" in json.loads(text)["error"]["message"]


def test_a_500_says_connection_close():
    """An unexpected exception: the 500 carries `Connection: close` (the server then closes the
    connection), so that a keep-alive client sends its next request on a new connection."""
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/boom")
    async def boom() -> dict:
        raise RuntimeError("unexpected")

    @app.get("/ok")
    async def ok() -> dict:
        return {"ok": True}

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.01)
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.sendall(b"GET /boom HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            head, body = read_response(sock)
            assert head.startswith(b"HTTP/1.1 500")
            assert b"connection: close" in head.lower()
            assert json.loads(body)["error"]["type"] == "internal_server_error"
            assert sock.recv(1) == b""  # closed as announced
        with httpx.Client(base_url=f"http://127.0.0.1:{port}") as c:  # keep-alive client
            assert c.get("/boom").status_code == 500
            assert c.get("/ok").json() == {"ok": True}
    finally:
        server.should_exit = True
        thread.join(10)


def test_server_still_healthy_at_the_end(server, http):
    assert server.alive() and http.get("/health").status_code == 200
    assert "Traceback" not in server.log_text()
