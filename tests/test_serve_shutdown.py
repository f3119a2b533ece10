"""Graceful shutdown (engine/server/shutdown.py) of a real `python -m engine.serve`.

One server (`--shutdown-timeout 10`, room for 5 sequences) gets SIGTERM while five requests run:
a short stream and a short non-streamed request that finish within the timeout, and a long
stream (read raw and by the official client) and a long non-streamed request (the official
client) that cannot. The short ones must
complete normally; the long ones must end with OpenAI's 503 (a final SSE error event and
`[DONE]`, never a stream cut mid-body); a new request during the drain gets a 503 with
`Retry-After`; every KV block is free at the end and the process exits 0. A second,
model-less server shows that SIGINT with nothing in flight exits 0 at once.
"""

from __future__ import annotations

import json
import re
import signal
import threading
import time
from typing import Any

import httpx
import openai
import pytest
from serve_process import ServerProcess

SHUTDOWN_TIMEOUT_S = 10.0
SHORT, LONG = 48, 1500
PROMPT = "Once upon a time"


def _stream_lines(url: str, max_tokens: int, out: dict[str, Any], started: threading.Event
                  ) -> None:
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=120) as client:
        with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            out["status"] = r.status_code
            lines = []
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    started.set()
    out["lines"], out["ended"] = lines, time.monotonic()


def _plain(url: str, max_tokens: int, out: dict[str, Any]) -> None:
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    out["response"], out["ended"] = r, time.monotonic()


def _client_stream(url: str, out: dict[str, Any], started: threading.Event) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    texts = []
    try:
        for chunk in client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT,
                                               max_tokens=LONG, stream=True,
                                               extra_body={"ignore_eos": True}):
            texts.append(chunk.choices[0].text)
            started.set()
    except openai.APIError as exc:
        out["error"] = exc
    out["texts"] = texts


def _client_plain(url: str, out: dict[str, Any]) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    try:
        out["result"] = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT,
                                                  max_tokens=LONG,
                                                  extra_body={"ignore_eos": True})
    except openai.APIStatusError as exc:
        out["error"] = exc


@pytest.fixture(scope="module")
def drained():
    """Runs the scenario of the module docstring; what each request saw, and the process."""
    proc = ServerProcess("--max-model-len", "2048", "--num-kv-blocks", "512",
                         "--max-num-seqs", "5", "--num-threads", "1",
                         "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S))
    proc.start()
    url = proc.base_url
    seen: dict[str, dict[str, Any]] = {k: {} for k in ("short_stream", "short_plain",
                                                       "long_stream", "long_raw",
                                                       "long_plain")}
    started = {k: threading.Event() for k in ("short_stream", "long_stream", "long_raw")}
    threads = [
        threading.Thread(target=_plain, args=(url, SHORT, seen["short_plain"])),
        threading.Thread(target=_client_plain, args=(url, seen["long_plain"])),
        threading.Thread(target=_stream_lines, args=(url, SHORT, seen["short_stream"],
                                                     started["short_stream"])),
        threading.Thread(target=_client_stream, args=(url, seen["long_stream"],
                                                      started["long_stream"])),
        threading.Thread(target=_stream_lines, args=(url, LONG, seen["long_raw"],
                                                     started["long_raw"])),
    ]
    for t in threads:
        t.start()
    for event in started.values():
        assert event.wait(120), "a stream never started"
    deadline = time.monotonic() + 60
    while httpx.get(f"{url}/internal/stats").json()["num_running"] < 5:
        assert time.monotonic() < deadline, "the five requests never ran together"
        time.sleep(0.05)
    proc.proc.send_signal(signal.SIGTERM)
    sigterm = time.monotonic()
    time.sleep(0.3)
    late = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
    health = httpx.get(f"{url}/health")
    for t in threads:
        t.join(SHUTDOWN_TIMEOUT_S + 60)
    returncode = proc.proc.wait(60)
    result = {"seen": seen, "sigterm": sigterm, "late": late, "health": health,
              "returncode": returncode, "log": proc.log_text()}
    proc.stop()
    return result


def test_requests_that_finish_within_the_timeout_complete(drained):
    stream = drained["seen"]["short_stream"]
    assert stream["status"] == 200 and stream["ended"] > drained["sigterm"]
    lines = stream["lines"]
    assert lines[-1] == "data: [DONE]" and not any('"error"' in line for line in lines)
    last = json.loads(lines[-2][len("data: "):])
    assert last["choices"][0]["finish_reason"] == "length"
    plain = drained["seen"]["short_plain"]
    assert plain["ended"] > drained["sigterm"]
    r = plain["response"]
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == SHORT


def test_requests_still_running_at_the_timeout_end_with_openai_errors(drained):
    log = drained["log"]
    # 5, or 6 while the last /internal/stats poll's handler returns after its client has read it
    match = re.search(r"SIGTERM: draining \(new requests get 503; (\d+) in flight", log)
    assert match and int(match.group(1)) >= 5, re.findall(r".*in flight.*", log)
    assert "shutdown: ending 3 requests still in flight" in log
    stream = drained["seen"]["long_stream"]
    assert isinstance(stream.get("error"), openai.APIError), stream  # the SSE error event
    assert "shutting down" in stream["error"].message and stream["texts"]
    plain = drained["seen"]["long_plain"]["error"]
    assert plain.status_code == 503 and plain.response.headers["retry-after"].isdigit()
    assert plain.body["code"] == 503 and "--shutdown-timeout" in plain.body["message"]


def test_a_cut_stream_ends_with_an_error_event_and_done(drained):
    raw = drained["seen"]["long_raw"]
    assert raw["ended"] - drained["sigterm"] >= SHUTDOWN_TIMEOUT_S - 1
    *events, done = raw["lines"]
    assert done == "data: [DONE]"
    payloads = [json.loads(line[len("data: "):]) for line in events]  # every event whole
    assert payloads[-1]["error"]["code"] == 503
    assert all("choices" in p for p in payloads[:-1]) and len(payloads) > 1


def test_new_requests_during_the_drain_get_503_with_retry_after(drained):
    for r in (drained["late"], drained["health"]):
        assert r.status_code == 503 and r.headers["retry-after"].isdigit()
        assert r.headers["connection"] == "close"
        assert r.json()["error"]["code"] == 503


def test_every_block_is_free_and_the_process_exits_0(drained):
    match = re.search(r"shutdown: engine idle, (\d+) of (\d+) KV blocks free", drained["log"])
    assert match and match.group(1) == match.group(2), drained["log"][-2000:]
    assert drained["returncode"] == 0


def test_sigint_with_nothing_in_flight_exits_0_at_once():
    proc = ServerProcess("--model", "/nonexistent/missing.gguf")
    proc.start(until_ready=False)
    try:
        start = time.monotonic()
        proc.proc.send_signal(signal.SIGINT)
        assert proc.proc.wait(30) == 0
        assert time.monotonic() - start < 10  # not the 30 s default --shutdown-timeout
        assert "SIGINT: draining" in proc.log_text()
    finally:
        proc.stop()
