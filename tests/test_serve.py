"""The OpenAI-compatible server, end to end: one real `python -m engine.serve` subprocess for the
module, driven by the official `openai` client (sync and async) and raw HTTP (httpx).

Covers completions and chat (streaming and not, usage, logprobs, n, several prompts, stop
strings), 16 concurrent streams, aborts on client disconnect (the KV blocks come back), every
bad-input error (OpenAI's error shape, the right status, no traceback) and that the server is
still healthy at the end. Outputs are greedy (temperature 0) so that streaming and non-streaming
answers can be compared exactly.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import openai
import pytest
from serve_process import ServerProcess

from engine.dtypes import auto_dtype

MAX_MODEL_LEN = 96
BODY_LIMIT = 64 * 1024
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess("--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "16",
                         "--num-threads", "1",
                         "--num-kv-blocks", "128", "--max-request-bytes", str(BODY_LIMIT))
    proc.start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def model(server) -> str:
    return httpx.get(f"{server.base_url}/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0,
                         timeout=300)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=300) as c:
        yield c


def sse_events(lines) -> list:
    """Parses an SSE body: every event must be `data: ...`; returns the JSON payloads and the
    literal "[DONE]" in order."""
    events = []
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def stats(http) -> dict:
    return http.get("/internal/stats").json()


def metric(http, name: str, labels: str = "") -> float:
    """The value of one sample of /metrics (0 when absent)."""
    text = http.get("/metrics").text
    pattern = re.compile(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", re.M)
    for found_labels, value in pattern.findall(text):
        if labels in found_labels:
            return float(value)
    return 0.0


def wait_idle(http, timeout: float = 120.0) -> dict:
    """Stats once no request runs or waits and every KV block is free again."""
    deadline = time.monotonic() + timeout
    while True:
        s = stats(http)
        if s["num_running"] == 0 and s["num_waiting"] == 0 \
                and s["num_free_blocks"] == s["num_total_blocks"]:
            return s
        assert time.monotonic() < deadline, f"engine not idle: {s}"
        time.sleep(0.2)


def assert_error(response: httpx.Response, status: int, *words: str) -> dict:
    assert response.status_code == status, response.text
    assert "Traceback" not in response.text and 'File "' not in response.text
    body = response.json()
    err = body["error"]
    assert set(err) >= {"message", "type", "param", "code"}, body
    assert err["code"] == status
    for word in words:
        assert word in err["message"], (word, err["message"])
    return err


# ------------------------------------------------------------------------------------ basics
def test_health_models_and_startup(server, http, model):
    assert http.get("/health").status_code == 200
    body = http.get("/v1/models").json()
    assert body["object"] == "list" and body["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert model == "SmolLM2-135M-Instruct"
    dtype = str(auto_dtype("cpu")).removeprefix("torch.")  # --dtype auto on this CPU
    assert "KV blocks" in server.log_text() and f"dtype {dtype}" in server.log_text()


def test_completion_sync_openai(client, model, http):
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert len(r.choices) == 1 and r.choices[0].finish_reason == "length"
    assert r.choices[0].text
    expected_prompt = http.post("/tokenize", json={"prompt": PROMPT}).json()["count"]
    assert r.usage.prompt_tokens == expected_prompt
    assert r.usage.completion_tokens == 5 and r.usage.total_tokens == expected_prompt + 5
    again = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert again.choices[0].text == r.choices[0].text  # greedy is deterministic


def test_completion_stream_raw_sse_matches_non_stream(http, model):
    body = {"model": model, "prompt": PROMPT, "max_tokens": 5, "temperature": 0,
            "ignore_eos": True}
    full = http.post("/v1/completions", json=body).json()
    with http.stream("POST", "/v1/completions",
                     json={**body, "stream": True,
                           "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == full["usage"]
    text = "".join(c["choices"][0]["text"] for c in chunks[:-1])
    assert text == full["choices"][0]["text"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in c for c in chunks[:-1])


def test_chat_sync_and_async_stream(client, model, server):
    r = client.chat.completions.create(model=model, messages=CHAT, max_tokens=5, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"

    async def stream() -> tuple[str, list]:
        aclient = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="x",
                                     max_retries=0, timeout=300)
        chunks = []
        s = await aclient.chat.completions.create(
            model=model, messages=CHAT, max_tokens=5, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in s:
            chunks.append(chunk)
        await aclient.close()
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks

    text, chunks = asyncio.run(stream())
    assert text == r.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[-1].usage.completion_tokens == 5 and chunks[-1].choices == []
    assert chunks[-2].choices[0].finish_reason == "length"


def test_logprobs(client, model):
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0,
                                  logprobs=2, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert "".join(lp.tokens) == r.choices[0].text
    for value, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and len(top) >= 2
        assert max(top.values()) == pytest.approx(value, abs=1e-4)  # greedy: the best token
    c = client.chat.completions.create(model=model, messages=CHAT, max_tokens=3, temperature=0,
                                       logprobs=True, top_logprobs=2,
                                       extra_body={"ignore_eos": True})
    content = c.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) >= 2 for t in content)
    assert "".join(t.token for t in content) == c.choices[0].message.content


def test_n_and_several_prompts(client, model):
    r = client.completions.create(model=model, prompt=[PROMPT, "One, two,"], n=2, max_tokens=3,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    by_index = {c.index: c.text for c in r.choices}
    assert by_index[0] == by_index[1] and by_index[2] == by_index[3]  # greedy copies
    assert r.usage.completion_tokens == 12


def test_stop_string_streaming_and_not(http, model):
    base = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}
    text = http.post("/v1/completions", json=base).json()["choices"][0]["text"]
    assert len(text) >= 4, text
    stop = text[2:4]
    cut = text[:text.index(stop)]
    full = http.post("/v1/completions", json={**base, "stop": [stop]}).json()["choices"][0]
    assert full["text"] == cut and full["finish_reason"] == "stop"
    assert full["stop_reason"] == stop
    with http.stream("POST", "/v1/completions", json={**base, "stop": stop, "stream": True}) as r:
        events = sse_events(r.iter_lines())
    streamed = "".join(e["choices"][0]["text"] for e in events[:-1])
    assert streamed == cut  # the stop string never leaks, even partly


def test_tokenize_detokenize(http, model):
    tok = http.post("/tokenize", json={"model": model, "prompt": PROMPT}).json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == MAX_MODEL_LEN
    detok = http.post("/detokenize", json={"model": model, "tokens": tok["tokens"]}).json()
    assert detok["prompt"] == PROMPT
    chat = http.post("/tokenize", json={"messages": CHAT}).json()
    assert chat["count"] > tok["count"]


def test_seeded_sampling_is_reproducible(client, model):
    def sample(seed):
        return client.completions.create(model=model, prompt=PROMPT, max_tokens=6,
                                         temperature=1.0, seed=seed,
                                         extra_body={"ignore_eos": True}).choices[0].text
    assert sample(7) == sample(7)
    assert len({sample(s) for s in (1, 2, 3)}) > 1


def test_metrics_names_and_prefix_cache(http, model):
    prompt = " ".join(["alpha beta gamma delta"] * 10)  # > 2 full blocks of 16 tokens
    for _ in range(2):
        http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
    text = http.get("/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_bucket"):
        assert f'{name}{{' in text, name
    assert f'model_name="{model}"' in text
    assert metric(http, "vllm:prefix_cache_hits_total") >= 32  # the second request hit
    assert metric(http, "vllm:prefix_cache_queries_total") >= metric(
        http, "vllm:prefix_cache_hits_total")


# ------------------------------------------------------------------------------- concurrency
def test_16_concurrent_streams(server, model, http):
    before = metric(http, "vllm:generation_tokens_total")

    async def one(aclient, i):
        s = await aclient.completions.create(
            model=model, prompt=f"{i} + {i} =", max_tokens=4, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        chunks = [c async for c in s]
        return chunks[-1].usage.completion_tokens, "".join(
            c.choices[0].text for c in chunks if c.choices)

    async def run_all():
        aclient = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="x",
                                     max_retries=0, timeout=300)
        try:
            return await asyncio.gather(*(one(aclient, i) for i in range(16)))
        finally:
            await aclient.close()

    results = asyncio.run(run_all())
    assert [n for n, _ in results] == [4] * 16
    assert all(text for _, text in results)
    assert metric(http, "vllm:generation_tokens_total") - before >= 64
    wait_idle(http)
    assert metric(http, "vllm:num_requests_running") == 0


def test_load_generator_against_the_server(server, model):
    from bench.load_gen import build_parser, run, table

    for mode in (["--concurrency", "4"], ["--rate", "50"]):
        args = build_parser().parse_args([
            "--base-url", server.base_url, *mode, "--num-prompts", "4", "--prompt-len", "8",
            "--output-len", "3", "--vocab-size", "49152", "--warmup", "0"])
        summary = asyncio.run(run(args))
        assert summary["model"] == model and summary["num_ok"] == 4, summary["errors"]
        assert summary["total_output_tokens"] == 12 and summary["total_input_tokens"] == 32
        assert summary["output_throughput_tok_s"] > 0
        assert 0 < summary["ttft_ms"]["p50"] <= summary["e2e_latency_ms"]["p50"]
        assert summary["tpot_ms"]["p50"] > 0 and "TPOT" in table(summary)


def test_abort_stream_on_disconnect_frees_blocks(server, http, model):
    idle = wait_idle(http)
    aborted_before = metric(http, "vllm:request_success_total", 'finished_reason="abort"')
    body = {"model": model, "prompt": PROMPT, "max_tokens": 60, "ignore_eos": True,
            "stream": True}
    with httpx.Client(base_url=server.base_url, timeout=300) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line)
            assert first.startswith("data: ")
            busy = stats(http)
            assert busy["num_free_blocks"] < idle["num_total_blocks"]
        # leaving both blocks closes the connection mid-stream
    after = wait_idle(http)
    assert after["num_free_blocks"] == after["num_total_blocks"]
    assert metric(http, "vllm:request_success_total", 'finished_reason="abort"') \
        == aborted_before + 1
    assert metric(http, "vllm:kv_cache_usage_perc") == 0.0


def test_abort_non_stream_on_disconnect(server, http, model):
    wait_idle(http)
    aborted_before = metric(http, "vllm:request_success_total", 'finished_reason="abort"')
    # 16 samples of 88 tokens (the model length allows 96): 88 steps of 16 rows on one thread,
    # seconds of work on the machines we run on, while the client gives up after 0.3 s without
    # a response and the server looks for a disconnect every 0.25 s; only the read times out, so
    # a slow connect on a loaded machine is no flake
    body = {"model": model, "prompt": PROMPT, "max_tokens": 88, "n": 16, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/v1/completions", json=body,
                   timeout=httpx.Timeout(10.0, read=0.3))
    wait_idle(http)
    deadline = time.monotonic() + 60
    while metric(http, "vllm:request_success_total", 'finished_reason="abort"') \
            < aborted_before + 1:
        assert time.monotonic() < deadline, "the disconnected request was not aborted"
        time.sleep(0.2)


# ------------------------------------------------------------------------------------ errors
@pytest.mark.parametrize("payload, param", [
    ({"prompt": PROMPT, "max_tokens": -1}, "max_tokens"),
    ({"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
    ({"prompt": PROMPT, "temperature": -0.5}, "temperature"),
    ({"prompt": PROMPT, "top_p": 0}, "top_p"),
    ({"prompt": PROMPT, "top_p": 1.5}, "top_p"),
    ({"prompt": PROMPT, "n": 0}, "n"),
    ({"prompt": PROMPT, "temperature": "hot"}, "temperature"),
    ({"prompt": PROMPT, "max_tokens": "ten"}, "max_tokens"),
    ({"prompt": PROMPT, "stream": "yes"}, "stream"),
    ({"prompt": 5}, "prompt"),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": [70000]}, "prompt"),
    ({"prompt": PROMPT, "logprobs": 50}, "logprobs"),
])
def test_bad_completion_fields_are_400(http, payload, param):
    err = assert_error(http.post("/v1/completions", json=payload), 400)
    assert err["param"] == param and err["type"] == "invalid_request_error"


@pytest.mark.parametrize("payload", [
    {"messages": "hello"},
    {"messages": []},
    {"messages": [{"role": "wizard", "content": "hi"}]},
    {"messages": CHAT, "top_logprobs": 2},
    {"messages": CHAT, "temperature": -1},
])
def test_bad_chat_fields_are_400(http, payload):
    assert_error(http.post("/v1/chat/completions", json=payload), 400)


@pytest.mark.parametrize("path, payload", [
    ("/tokenize", {}),
    ("/tokenize", {"messages": []}),  # was a 500 (found by schemathesis)
    ("/tokenize", {"prompt": PROMPT, "messages": CHAT}),
    ("/tokenize", {"prompt": 7}),
    ("/detokenize", {"tokens": "abc"}),
    ("/detokenize", {}),
])
def test_bad_tokenize_bodies_are_400(http, path, payload):
    assert_error(http.post(path, json=payload), 400)
    assert http.post("/tokenize", json={"prompt": PROMPT}).status_code == 200  # still serving


def test_wrong_method_is_405_with_allow(http):
    """A path that exists, asked with a method it does not take: 405 naming the methods."""
    r = http.delete("/v1/completions")
    assert_error(r, 405)
    assert r.headers["allow"] == "POST"
    assert http.request("TRACE", "/health").headers["allow"] == "GET"


def test_openapi_schema_lists_the_routes(http):
    """The OpenAPI schema (as vLLM serves it; clients and fuzzers read it) names every route."""
    paths = http.get("/openapi.json").json()["paths"]
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize",
            "/detokenize", "/health", "/metrics"} <= set(paths)


def test_malformed_json_is_400(http):
    r = http.post("/v1/completions", content=b'{"prompt": "x",',
                  headers={"content-type": "application/json"})
    assert_error(r, 400, "malformed JSON")
    assert_error(http.post("/v1/chat/completions", content=b"not json",
                           headers={"content-type": "application/json"}), 400)


def test_prompt_too_long_is_400_with_lengths(http):
    long_prompt = " ".join(["word"] * 200)
    n = http.post("/tokenize", json={"prompt": long_prompt}).json()["count"]
    assert n > MAX_MODEL_LEN
    err = assert_error(http.post("/v1/completions", json={"prompt": long_prompt}), 400,
                       str(MAX_MODEL_LEN), str(n))
    assert "maximum context length" in err["message"]
    near = " ".join(["word"] * (MAX_MODEL_LEN - 10))
    fits = http.post("/tokenize", json={"prompt": near}).json()["count"]
    too_many = MAX_MODEL_LEN - fits + 1
    assert_error(http.post("/v1/completions", json={"prompt": near, "max_tokens": too_many}),
                 400, str(MAX_MODEL_LEN), str(fits + too_many), str(fits), str(too_many))
    ok = http.post("/v1/completions", json={"prompt": near, "max_tokens": too_many - 1,
                                            "temperature": 0})
    assert ok.status_code == 200 and ok.json()["usage"]["total_tokens"] <= MAX_MODEL_LEN
    assert_error(http.post("/v1/chat/completions",
                           json={"messages": [{"role": "user", "content": long_prompt}]}), 400,
                 str(MAX_MODEL_LEN))


def test_engine_refusal_is_400_streaming_or_not(http):
    # n=30 passes the server's own checks (n <= 64) but not the engine's (at most
    # --max-num-seqs=16 sequences per request): the engine refuses the request when it is added,
    # before any response starts, and its message (which names the value given) comes back.
    body = {"prompt": PROMPT, "n": 30, "max_tokens": 4}
    assert_error(http.post("/v1/completions", json=body), 400, "30")
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        r.read()
        assert_error(r, 400, "30")
    wait_idle(http)


def test_unknown_model_is_404(http, client):
    assert_error(http.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"}), 404,
                 "gpt-9")
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=CHAT, max_tokens=1)
    assert_error(http.get("/v1/nothing-here"), 404)


def test_body_too_large_is_413(http):
    big = {"prompt": "a" * (BODY_LIMIT + 10)}
    assert_error(http.post("/v1/completions", json=big), 413, str(BODY_LIMIT))
    chunked = (b"x" * 4096 for _ in range(BODY_LIMIT // 4096 + 4))  # no content-length
    assert_error(http.post("/v1/completions", content=chunked,
                           headers={"content-type": "application/json"}), 413)


def test_openai_client_sees_bad_request(client, model):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=2, temperature=-1)
    assert "temperature" in str(info.value)


def test_server_still_healthy_at_the_end(server, http, client, model):
    assert server.alive()
    assert http.get("/health").status_code == 200
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=2, temperature=0)
    assert r.usage.completion_tokens >= 1
    wait_idle(http)
    assert "Traceback" not in server.log_text()
