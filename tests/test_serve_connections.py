"""Connections the server must not keep (engine/server/connections.py, the body deadline in
middleware.py), with raw sockets on loopback against a real `python -m engine.serve`.

The HTTP side needs no model, so the server is given a model file that does not exist: it
answers at once (the API with 503 "failed to load", `/openapi.json` with 200) and costs no CPU.
Timeouts are 1 s: a connection that sends nothing, a request head that never completes (sent
whole but for its last line, or dripped a byte at a time, which an idle timeout would never
end), a body that stops short, and an idle keep-alive connection are all closed within about a
second, a partial request with a 408 in OpenAI's shape (an oversized one with its 413).
`--limit-concurrency` answers OpenAI's 503 with `Retry-After`.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from serve_process import ServerProcess

TIMEOUT_S = 1.0
LIMIT = 3


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess("--model", "/nonexistent/missing.gguf",
                         "--timeout-header-read", str(TIMEOUT_S),
                         "--timeout-body-read", str(TIMEOUT_S),
                         "--timeout-keep-alive", str(TIMEOUT_S),
                         "--limit-concurrency", str(LIMIT))
    proc.start(until_ready=False)
    yield proc
    proc.stop()


def _connect(server: ServerProcess) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=5 * TIMEOUT_S)


def _read_until_closed(sock: socket.socket, drip: bytes = b"") -> tuple[float, bytes]:
    """Reads until the server closes the connection (or 5 x the timeout pass: then the test
    fails); with `drip`, first sends it one byte per 0.2 s while the connection lasts."""
    start = time.monotonic()
    data = b""
    for i in range(len(drip)):
        try:
            sock.sendall(drip[i:i + 1])
        except OSError:  # closed by the server
            break
        time.sleep(0.2)
    try:
        while chunk := sock.recv(4096):
            data += chunk
    except socket.timeout:
        pytest.fail(f"connection still open after {time.monotonic() - start:.1f} s: {data!r}")
    except ConnectionResetError:
        pass
    return time.monotonic() - start, data


def _status_and_json(raw: bytes) -> tuple[int, dict[str, str], dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, json.loads(body)


def test_a_connection_that_sends_nothing_is_closed(server):
    with _connect(server) as sock:
        elapsed, data = _read_until_closed(sock)
    assert data == b"" and elapsed < 3 * TIMEOUT_S


@pytest.mark.parametrize("how", ["stalled", "dripped"])
def test_an_incomplete_request_head_gets_408_and_is_closed(server, how):
    head = b"GET /openapi.json HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 40 + b"\r\n"
    with _connect(server) as sock:
        if how == "stalled":
            sock.sendall(head)
            elapsed, data = _read_until_closed(sock)
        else:  # a byte every 0.2 s for longer than the timeout: a deadline, not an idle timer
            elapsed, data = _read_until_closed(sock, drip=head)
    assert elapsed < 3 * TIMEOUT_S + (0.2 * len(head) if how == "dripped" else 0)
    status, headers, body = _status_and_json(data)
    assert status == 408 and headers["connection"] == "close"
    assert body["error"]["code"] == 408 and "--timeout-header-read" in body["error"]["message"]


def test_a_body_that_stops_short_gets_408_and_is_closed(server):
    with _connect(server) as sock:
        sock.sendall(b"POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                     b"application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\": ")
        elapsed, data = _read_until_closed(sock)
    assert elapsed < 3 * TIMEOUT_S
    status, headers, body = _status_and_json(data)
    assert status == 408 and headers["connection"] == "close"
    assert body["error"]["code"] == 408 and "--timeout-body-read" in body["error"]["message"]


def test_an_oversized_body_that_never_comes_gets_413_and_is_closed(server):
    with _connect(server) as sock:
        sock.sendall(b"POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: "
                     + str(1 << 30).encode() + b"\r\n\r\n{")
        elapsed, data = _read_until_closed(sock)
    assert elapsed < 3 * TIMEOUT_S
    status, headers, body = _status_and_json(data)
    assert status == 413 and headers["connection"] == "close"
    assert "--max-request-bytes" in body["error"]["message"]


def test_an_idle_keep_alive_connection_is_closed(server):
    with _connect(server) as sock:
        sock.sendall(b"GET /openapi.json HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        elapsed, data = _read_until_closed(sock)
    assert data.startswith(b"HTTP/1.1 200") and elapsed < 3 * TIMEOUT_S


def test_beyond_the_concurrency_limit_503_with_retry_after(server):
    idle = [_connect(server) for _ in range(LIMIT)]
    try:
        time.sleep(0.2)
        r = httpx.get(f"{server.base_url}/openapi.json", timeout=10)
        assert r.status_code == 503, r.text
        assert r.headers["retry-after"].isdigit() and r.headers["connection"] == "close"
        err = r.json()["error"]
        assert err["code"] == 503 and "--limit-concurrency" in err["message"]
    finally:
        for sock in idle:
            sock.close()
    time.sleep(0.2)
    assert httpx.get(f"{server.base_url}/openapi.json", timeout=10).status_code == 200


def test_every_503_carries_retry_after(server):
    r = httpx.get(f"{server.base_url}/health", timeout=10)  # the model failed to load
    assert r.status_code == 503 and r.headers["retry-after"].isdigit()
