"""bench/load_gen.py's statistics, length draws and raw HTTP client (against a loopback socket
that answers with fixed bytes; the end-to-end run against a real server is in
tests/test_serve.py)."""

from __future__ import annotations

import asyncio
import math
import random

import pytest

from bench.load_gen import (
    HTTPStatusError,
    RawClient,
    RequestResult,
    build_parser,
    draw_lengths,
    percentiles,
)


def test_percentiles_interpolate_like_numpy():
    values = [float(v) for v in range(1, 101)]  # 1..100
    p = percentiles(values)
    assert p["mean"] == pytest.approx(50.5)
    assert p["p50"] == pytest.approx(50.5) and p["p90"] == pytest.approx(90.1)
    assert p["p99"] == pytest.approx(99.01)
    assert percentiles([3.0])["p99"] == 3.0
    assert all(math.isnan(v) for v in percentiles([]).values())


def test_tpot_excludes_the_first_token():
    r = RequestResult(prompt_len=4, output_len=5, ok=True, ttft=1.0, latency=3.0,
                      output_tokens=5)
    assert r.tpot == pytest.approx(0.5)
    assert RequestResult(4, 1, ok=True, ttft=1.0, latency=1.0, output_tokens=1).tpot is None


def test_fixed_and_sharegpt_lengths():
    args = build_parser().parse_args(["--concurrency", "2", "--num-prompts", "400",
                                      "--prompt-len", "256", "--output-len", "128"])
    assert draw_lengths(args, random.Random(0)) == [(256, 128)] * 400
    args.length_dist = "sharegpt"
    drawn = draw_lengths(args, random.Random(0))
    prompts, outputs = sorted(p for p, _ in drawn), sorted(o for _, o in drawn)
    assert all(4 <= p <= 4 * 256 for p in prompts) and all(4 <= o <= 4 * 128 for o in outputs)
    assert 180 < prompts[200] < 360 and 90 < outputs[200] < 180  # medians near the given
    assert prompts[-1] > 2 * prompts[200]  # a long tail, unlike the fixed lengths


# --------------------------------------------------------------------- the raw HTTP client
def _serve_once(response: bytes):
    """A one-shot loopback server that answers the first request with `response` (raw bytes)
    and records the request it got; returns (base_url, requests, server)."""
    requests: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        requests.append(head + await reader.readexactly(length))
        writer.write(response)
        await writer.drain()
        writer.close()

    return handle, requests


def _chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


def _run_client(response: bytes, headers: dict[str, str] | None = None
                ) -> tuple[list[str], list[bytes], Exception | None]:
    async def main() -> tuple[list[str], list[bytes], Exception | None]:
        handle, requests = _serve_once(response)
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        lines: list[str] = []
        error = None
        try:
            client = RawClient(f"http://127.0.0.1:{port}", headers or {})
            async for line in client.post_lines("/v1/completions", {"prompt": [1, 2]}):
                lines.append(line)
        except (HTTPStatusError, OSError, ValueError, asyncio.IncompleteReadError) as exc:
            error = exc
        finally:
            server.close()
            await server.wait_closed()
        return lines, requests, error

    return asyncio.run(main())


def test_raw_client_reads_chunked_events_split_anywhere():
    events = 'data: {"a": "é"}\n\ndata: {"b": 2}\n\ndata: [DONE]\n\n'.encode()
    # cut inside a line, inside the UTF-8 character and between the two newlines
    cut = [5, events.index(b"\xa9"), events.index(b"\n\n") + 1, len(events)]
    pieces = [events[a:b] for a, b in zip([0, *cut], cut)]
    head = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    lines, requests, error = _run_client(head + _chunked(*pieces), {"Authorization": "Bearer k"})
    assert error is None
    assert lines == ['data: {"a": "é"}', "", 'data: {"b": 2}', "", "data: [DONE]", ""]
    request = requests[0]
    assert request.startswith(b"POST /v1/completions HTTP/1.1\r\n")
    assert b"\r\nAuthorization: Bearer k\r\n" in request
    assert request.endswith(b'\r\n\r\n{"prompt": [1, 2]}')


def test_raw_client_length_delimited_and_close_delimited_bodies():
    body = b"data: 1\r\n\r\ndata: 2"
    lines, _, error = _run_client(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s"
                                  % (len(body), body))
    assert error is None and lines == ["data: 1", "", "data: 2"]
    lines, _, error = _run_client(b"HTTP/1.0 200 OK\r\n\r\n" + body)
    assert error is None and lines == ["data: 1", "", "data: 2"]


def test_raw_client_non_200_is_an_error_with_the_body():
    body = b'{"error": {"message": "too long"}}'
    _, _, error = _run_client(b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n%s"
                              % (len(body), body))
    assert isinstance(error, HTTPStatusError) and "HTTP 400" in str(error)
    assert "too long" in str(error)


def test_raw_client_truncated_chunk_is_an_error():
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    _, _, error = _run_client(head + b"20\r\ndata: short")
    assert isinstance(error, asyncio.IncompleteReadError)


def test_raw_client_rejects_a_bad_base_url():
    with pytest.raises(ValueError, match="base_url"):
        RawClient("ftp://example.com", {})
