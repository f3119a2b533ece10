"""Load generator for any OpenAI-compatible completions server (this repo's `engine.serve`,
vLLM, llama.cpp's server, ...).

    python -m bench.load_gen --base-url http://127.0.0.1:8000 --concurrency 16 \\
        --num-prompts 32 --prompt-len 256 --output-len 128 --output run.json

Arrivals: `--concurrency N` keeps N requests in flight; `--rate R` sends Poisson arrivals at R
requests/s (with `--concurrency` as an optional cap). Lengths: fixed (`--prompt-len`,
`--output-len`) or drawn per request (`--length-dist sharegpt`: log-normal prompt and output
lengths whose medians and spreads resemble the ShareGPT conversations used by vLLM's serving
benchmark, clipped to [4, 4 x the given length]; the given lengths set the medians).

Prompts are random token ids sent as a token-id `prompt` (exact lengths whatever the tokenizer;
random so no two requests share a cached prefix); `ignore_eos` makes every request produce
exactly its output length. Each request streams (`stream_options.include_usage`), so the client
sees every token arrive: TTFT = first token - send; TPOT = (last - first token) / (tokens - 1);
ITL = gaps between token-carrying chunks. Prints a table and writes JSON.

The streams are read by a small HTTP/1.1 client on asyncio's own streams (`--client raw`, the
default; one `Connection: close` connection per request): on a 2-core machine that also runs the
server, the client's CPU per streamed chunk is taken from the server, and httpx's layered
stream decoding costs several times more per chunk. `--client httpx` uses httpx instead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import platform
import random
import time
import urllib.parse
from dataclasses import asdict, dataclass, field
from typing import Any, AsyncIterator, Optional

import httpx


@dataclass
class RequestResult:
    prompt_len: int
    output_len: int
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> Optional[float]:
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def percentiles(values: list[float], ps: tuple[int, ...] = (50, 90, 99)) -> dict[str, float]:
    """Nearest-rank-interpolated percentiles (and the mean); empty input gives NaNs."""
    if not values:
        return {"mean": math.nan, **{f"p{p}": math.nan for p in ps}}
    s = sorted(values)
    out = {"mean": sum(s) / len(s)}
    for p in ps:
        k = (len(s) - 1) * p / 100
        lo, hi = math.floor(k), math.ceil(k)
        out[f"p{p}"] = s[lo] + (s[hi] - s[lo]) * (k - lo)
    return out


def draw_lengths(args: argparse.Namespace, rng: random.Random) -> list[tuple[int, int]]:
    """(prompt length, output length) per request."""
    if args.length_dist == "fixed":
        return [(args.prompt_len, args.output_len)] * args.num_prompts

    def lognormal(median: int, sigma: float) -> int:
        value = int(round(median * math.exp(rng.gauss(0.0, sigma))))
        return max(4, min(4 * median, value))

    # ShareGPT's prompt and reply lengths are roughly log-normal with sigma ~ 1 (prompts) and
    # ~ 0.8 (replies) in log space.
    return [(lognormal(args.prompt_len, 1.0), lognormal(args.output_len, 0.8))
            for _ in range(args.num_prompts)]


def make_prompt(length: int, vocab: int, rng: random.Random) -> list[int]:
    # Skip the first ids: byte-level vocabularies keep special tokens there.
    return [rng.randrange(256, vocab) for _ in range(length)]


class HTTPStatusError(Exception):
    """A response other than 200: `status` and the start of its body."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}: {body[:200]!r}")


class RawClient:
    """POSTs JSON and yields the response body's lines as they arrive, over one HTTP/1.1
    connection per request (`Connection: close`). Bodies may be chunked, length-delimited or
    end with the connection. `base_url`: http:// or https://; `headers` go with every request."""

    def __init__(self, base_url: str, headers: dict[str, str]) -> None:
        url = urllib.parse.urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"base_url: expected http://HOST[:PORT] or https://..., got "
                             f"{base_url!r}")
        self.tls = url.scheme == "https"
        self.host = url.hostname
        self.port = url.port or (443 if self.tls else 80)
        self.prefix = url.path.rstrip("/")
        self.headers = "".join(f"{k}: {v}\r\n" for k, v in headers.items())

    async def post_lines(self, path: str, payload: dict[str, Any]) -> AsyncIterator[str]:
        """The response's lines (without line ends); HTTPStatusError for a status but 200."""
        body = json.dumps(payload).encode()
        reader, writer = await asyncio.open_connection(self.host, self.port,
                                                       ssl=True if self.tls else None)
        try:
            writer.write((f"POST {self.prefix}{path} HTTP/1.1\r\nHost: {self.host}:{self.port}"
                          f"\r\nContent-Type: application/json\r\nAccept: text/event-stream"
                          f"\r\nContent-Length: {len(body)}\r\nConnection: close\r\n"
                          f"{self.headers}\r\n").encode() + body)
            status, headers = await _read_head(reader)
            pieces = _body_pieces(reader, headers)
            if status != 200:
                raise HTTPStatusError(status, b"".join([p async for p in pieces]))
            rest = b""
            async for piece in pieces:
                *lines, rest = (rest + piece).split(b"\n")
                for line in lines:
                    yield line.rstrip(b"\r").decode()
            if rest:
                yield rest.rstrip(b"\r").decode()
        finally:
            writer.close()


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    """The status code and the (lower-cased) headers of a response."""
    status_line = (await reader.readuntil(b"\r\n")).decode("latin-1").split(" ", 2)
    if len(status_line) < 2 or not status_line[0].startswith("HTTP/"):
        raise ValueError(f"expected an HTTP status line, got {' '.join(status_line)!r}")
    headers = {}
    while (line := await reader.readuntil(b"\r\n")) != b"\r\n":
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(status_line[1]), headers


async def _body_pieces(reader: asyncio.StreamReader,
                       headers: dict[str, str]) -> AsyncIterator[bytes]:
    """The body as it arrives: de-chunked, length-delimited or up to the end of the stream."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):
            yield (await reader.readexactly(size + 2))[:-2]
        while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers
            pass
    elif "content-length" in headers:
        yield await reader.readexactly(int(headers["content-length"]))
    else:
        while piece := await reader.read(1 << 16):
            yield piece


async def _lines_httpx(client: httpx.AsyncClient, path: str,
                       payload: dict[str, Any]) -> AsyncIterator[str]:
    async with client.stream("POST", path, json=payload) as r:
        if r.status_code != 200:
            raise HTTPStatusError(r.status_code, await r.aread())
        async for line in r.aiter_lines():
            yield line


async def one_request(client: httpx.AsyncClient | RawClient, args: argparse.Namespace,
                      model: str, prompt: list[int], output_len: int) -> RequestResult:
    result = RequestResult(len(prompt), output_len)
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "stream": True,
            "temperature": args.temperature, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    lines = (client.post_lines("/v1/completions", body) if isinstance(client, RawClient)
             else _lines_httpx(client, "/v1/completions", body))
    start = time.perf_counter()

    async def read() -> None:
        last = None
        try:
            async for line in lines:
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = str(chunk["error"])[:200]
                    return
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    now = time.perf_counter()
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
        finally:
            await lines.aclose()  # type: ignore[attr-defined]
        result.latency = (last or time.perf_counter()) - start
        result.ok = True

    try:
        await asyncio.wait_for(read(), args.timeout)
    except (httpx.HTTPError, HTTPStatusError, OSError, asyncio.TimeoutError,
            asyncio.IncompleteReadError, asyncio.LimitOverrunError,
            ValueError) as exc:  # JSONDecodeError is a ValueError
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=max(args.concurrency or 0, 1) + 4)
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=args.timeout,
                                 limits=limits) as client:
        model = args.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        streams = RawClient(args.base_url, headers) if args.client == "raw" else client
        for _ in range(args.warmup):
            await one_request(streams, args, model, make_prompt(16, args.vocab_size, rng), 4)
        lengths = draw_lengths(args, rng)
        prompts = [make_prompt(p, args.vocab_size, rng) for p, _ in lengths]
        sem = asyncio.Semaphore(args.concurrency) if args.concurrency else None

        async def limited(i: int) -> RequestResult:
            if sem is None:
                return await one_request(streams, args, model, prompts[i], lengths[i][1])
            async with sem:
                return await one_request(streams, args, model, prompts[i], lengths[i][1])

        start = time.perf_counter()
        tasks = []
        for i in range(len(prompts)):
            tasks.append(asyncio.create_task(limited(i)))
            if args.rate:
                await asyncio.sleep(rng.expovariate(args.rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(args, model, results, duration)


def summarize(args: argparse.Namespace, model: str, results: list[RequestResult],
              duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)

    def scale(d: dict) -> dict:  # seconds -> ms
        return {k: v * 1000.0 for k, v in d.items()}

    return {
        "config": {k: v for k, v in vars(args).items() if k not in ("api_key", "output")},
        "model": model,
        "client_host": platform.node(),
        "num_requests": len(results), "num_ok": len(ok),
        "errors": [r.error for r in results if not r.ok][:10],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput_tok_s": out_tokens / duration,
        "total_throughput_tok_s": (in_tokens + out_tokens) / duration,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "ttft_ms": scale(percentiles([r.ttft for r in ok])),
        "tpot_ms": scale(percentiles([r.tpot for r in ok if r.tpot is not None])),
        "itl_ms": scale(percentiles([x for r in ok for x in r.itl])),
        "e2e_latency_ms": scale(percentiles([r.latency for r in ok])),
        "requests": [asdict(r) | {"itl": None} for r in results] if args.per_request else None,
    }


def table(summary: dict[str, Any]) -> str:
    cfg = summary["config"]
    mode = f"rate {cfg['rate']}/s" if cfg["rate"] else f"concurrency {cfg['concurrency']}"
    lines = [f"model {summary['model']}  {mode}  {summary['num_ok']}/{summary['num_requests']} "
             f"ok in {summary['duration_s']:.1f} s",
             f"request throughput   {summary['request_throughput']:9.3f} req/s",
             f"output throughput    {summary['output_throughput_tok_s']:9.1f} tok/s",
             f"total throughput     {summary['total_throughput_tok_s']:9.1f} tok/s",
             f"{'':21}{'mean':>9}{'p50':>9}{'p90':>9}{'p99':>9}"]
    for key, label in (("ttft_ms", "TTFT (ms)"), ("tpot_ms", "TPOT (ms)"),
                       ("itl_ms", "ITL (ms)"), ("e2e_latency_ms", "E2E (ms)")):
        d = summary[key]
        lines.append(f"{label:21}" + "".join(f"{d[k]:9.1f}" for k in ("mean", "p50", "p90",
                                                                        "p99")))
    if summary["errors"]:
        lines.append(f"errors (first): {summary['errors'][0]}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.load_gen", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="default: the first of /v1/models")
    p.add_argument("--api-key", default=None)
    p.add_argument("--concurrency", type=int, default=None, help="requests in flight")
    p.add_argument("--rate", type=float, default=None, help="Poisson arrivals per second")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--length-dist", choices=("fixed", "sharegpt"), default="fixed")
    p.add_argument("--vocab-size", type=int, default=32000,
                   help="prompt token ids are drawn below this")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--warmup", type=int, default=1, help="short requests sent first, unscored")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800.0,
                   help="seconds a request may take (httpx: also per read)")
    p.add_argument("--client", choices=("raw", "httpx"), default="raw",
                   help="how the streams are read: a small asyncio HTTP/1.1 client (default; "
                        "least CPU per chunk) or httpx")
    p.add_argument("--per-request", action="store_true", help="keep per-request rows in JSON")
    p.add_argument("--output", default=None, help="write the JSON summary here")
    return p


def main(argv: Optional[list[str]] = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.concurrency and not args.rate:
        parser.error("give --concurrency N or --rate R")
    for name in ("num_prompts", "prompt_len", "output_len"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: expected >= 1, got {getattr(args, name)}")
    summary = asyncio.run(run(args))
    print(table(summary))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(summary, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
