"""The server's API key (--api-key), its readiness (503 while the model loads) and its queue
limit (429 with --max-queue), against one real `python -m engine.serve` subprocess.

The server runs one sequence at a time (--max-num-seqs 1) with room for one waiting request
(--max-queue 1), so a third concurrent request is refused. The running request asks for most of
the model length, 4000 tokens (tens of seconds on one thread of a 2-vCPU machine, where 1000
took 7.6 s), so it is still generating when the third one arrives, however slowly the test
gets there; the test keeps its stream open (and so the request alive) until the end.
"""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from serve_process import ServerProcess

KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess("--max-model-len", "4096", "--max-num-seqs", "1", "--max-queue", "1",
                         "--num-threads", "1",
                         "--num-kv-blocks", "256", "--api-key", KEY)
    proc.start(early_headers=AUTH)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=300, headers=AUTH) as c:
        yield c


def assert_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    assert "Traceback" not in response.text
    err = response.json()["error"]
    assert err["code"] == status and err["message"] and "type" in err
    return err


def wait_idle(http, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        s = http.get("/internal/stats").json()
        if s["num_running"] == 0 and s["num_waiting"] == 0:
            return
        assert time.monotonic() < deadline, f"engine not idle: {s}"
        time.sleep(0.2)


def test_503_while_loading(server):
    statuses = [status for status, _ in server.startup_answers]
    assert statuses[0] == 503 and statuses[-1] == 200, statuses
    body = server.startup_answers[0][1]
    assert body["error"]["code"] == 503 and "loading" in body["error"]["message"]
    status, early = server.early_completion
    assert status == 503 and early["error"]["code"] == 503


def test_missing_or_wrong_key_is_401(server):
    url = server.base_url
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                    {"Authorization": "Basic " + KEY}):
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 1},
                       headers=headers)
        err = assert_error(r, 401)
        assert err["type"] == "authentication_error"
        assert r.headers.get("www-authenticate") == "Bearer"
    for path in ("/v1/models", "/metrics", "/internal/stats"):
        assert_error(httpx.get(url + path), 401)
    assert httpx.get(f"{url}/health").status_code == 200  # open without a key
    assert "/v1/completions" in httpx.get(f"{url}/openapi.json").json()["paths"]  # also open


def test_openai_client_with_and_without_key(server):
    bad = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    good = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0,
                         timeout=300)
    model = good.models.list().data[0].id
    r = good.completions.create(model=model, prompt=PROMPT, max_tokens=2, temperature=0,
                                extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 2


def test_queue_full_is_429(server, http):
    wait_idle(http)
    body = {"prompt": PROMPT, "max_tokens": 4000, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.base_url, timeout=300, headers=AUTH) as a, \
            httpx.Client(base_url=server.base_url, timeout=300, headers=AUTH) as b:
        with a.stream("POST", "/v1/completions", json=body) as running:
            assert running.status_code == 200
            # keep the line iterator: dropping it would close A's stream (and so abort A)
            lines = running.iter_lines()
            next(line for line in lines if line)  # A is generating
            with b.stream("POST", "/v1/completions", json=body) as waiting:
                assert waiting.status_code == 200  # B is accepted and waits
                deadline = time.monotonic() + 60
                while http.get("/internal/stats").json()["num_waiting"] != 1:
                    assert time.monotonic() < deadline
                    time.sleep(0.1)
                refused = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
                err = assert_error(refused, 429)
                assert "--max-queue" in err["message"]
                assert refused.headers["retry-after"].isdigit()
    wait_idle(http)  # both disconnected: aborted
    ok = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert ok.status_code == 200
    assert http.get("/health").status_code == 200
