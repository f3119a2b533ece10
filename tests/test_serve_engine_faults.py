"""The engine loop under faults (engine/server/async_engine.py).

Unit level, with a fake `LLMEngine` whose step (or add, or an engine call) raises on demand: an
`Exception` fails the requests in flight with a 500 and the loop goes on; a `BaseException`
kills the engine thread, the requests in flight (and an add not yet acknowledged, and a pending
engine call) get a 500, `check_ready` answers 503 while no thread runs, the supervisor starts a
new one, which aborts what the engine still held, and the server serves again. The fake's
`check_integrity` fails while it holds "blocks" of a request nobody tracks any more.

Real server: a fault injected into the real engine's model step (tests/faulty_serve.py) ends a
stream with an error event and `[DONE]`, a non-streamed request with a 500 JSON, leaves the
engine's blocks consistent (`/debug/check_integrity`) and the server serving, for both kinds of
fault.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any, Optional

import httpx
import openai
import pytest
from serve_process import REPO, ServerProcess

from engine.server import async_engine
from engine.server.async_engine import AsyncEngine
from engine.server.errors import APIError
from engine.server.metrics import ServerMetrics
from engine.server.protocol import CompletionRequest
from engine.server.routes import OpenAIServer


class Fault(BaseException):
    """Not an Exception: what kills a thread (as an injected fault or an async exception)."""


@dataclass
class _Group:
    request_id: str
    max_tokens: int
    tokens: list[int] = field(default_factory=list)


@dataclass
class _Completion:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: Optional[str]
    logprobs: Any = None
    stop_reason: Any = None


@dataclass
class _Output:
    request_id: str
    outputs: list[_Completion]
    finished: bool


class _Scheduler:
    def __init__(self, engine: "FakeEngine") -> None:
        self.engine = engine

    def groups(self) -> list[_Group]:
        return list(self.engine.groups.values())


class FakeEngine:
    """An LLMEngine with one token per step per request; `held` stands for KV blocks: a request
    holds them from add to finish or abort. `fail_step` / `fail_add`: raised by the next step /
    add_request."""

    class tokenizer:
        bos_token_id = 1
        vocab_size = 100

    max_model_len = 64

    def __init__(self) -> None:
        self.groups: dict[str, _Group] = {}
        self.held: set[str] = set()
        self.scheduler = _Scheduler(self)
        self.fail_step: Optional[BaseException] = None
        self.fail_add: Optional[BaseException] = None

    def add_request(self, request_id: str, ids: list[int], params: Any,
                    arrival_time: float = 0.0) -> None:
        fault, self.fail_add = self.fail_add, None
        self.groups[request_id] = _Group(request_id, params.max_tokens)
        self.held.add(request_id)
        if fault is not None:
            raise fault

    def abort_request(self, request_id: str) -> None:
        self.groups.pop(request_id, None)
        self.held.discard(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    def step(self) -> list[_Output]:
        fault, self.fail_step = self.fail_step, None
        if fault is not None:
            raise fault
        outputs = []
        for group in list(self.groups.values()):
            group.tokens.append(7)
            done = len(group.tokens) >= group.max_tokens
            outputs.append(_Output(group.request_id, [_Completion(
                0, "x" * len(group.tokens), list(group.tokens), "length" if done else None)],
                done))
            if done:
                self.abort_request(group.request_id)
        return outputs

    def stats(self) -> dict[str, int]:
        return {"num_running": len(self.groups), "num_waiting": 0}

    def check_integrity(self) -> None:
        assert self.held == set(self.groups), f"blocks held by {self.held - set(self.groups)}"


def _params(max_tokens: int) -> Any:
    from engine.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


async def _started(fake: FakeEngine) -> AsyncEngine:
    engine = AsyncEngine(lambda: fake, ServerMetrics("fake"))
    engine.start(asyncio.get_running_loop())
    for _ in range(200):
        if engine.ready:
            return engine
        await asyncio.sleep(0.01)
    raise AssertionError("fake engine not ready")


async def _first_delta(stream: Any) -> None:
    await asyncio.wait_for(stream.__anext__(), 5)


async def _expect_500(stream: Any) -> APIError:
    """Reads `stream` to its end; it must end with a 500 APIError within 5 s (never hang)."""
    with pytest.raises(APIError) as info:
        async def drain() -> None:
            async for _ in stream:
                pass
        await asyncio.wait_for(drain(), 5)
    assert info.value.status == 500 and "server log" in info.value.message
    return info.value


async def _complete(engine: AsyncEngine, request_id: str) -> int:
    stream = await engine.add(request_id, [1, 2], _params(3))
    deltas = [d async for d in stream]
    assert deltas[-1].finished
    return deltas[-1].num_output_tokens


async def _in_flight(engine: AsyncEngine, n: int = 2) -> list[Any]:
    """`n` requests past their first delta that cannot finish before the test's fault fires
    (a fake step takes microseconds: a thousand of them can run before the test goes on)."""
    streams = [await engine.add(f"r{i}", [1, 2], _params(10 ** 6)) for i in range(n)]
    for stream in streams:
        await _first_delta(stream)
    return streams


async def _in_engine(engine: AsyncEngine, fn: Any) -> Any:
    return await asyncio.wait_for(engine.call_in_engine_thread(fn), 5)


def test_step_exception_fails_in_flight_and_keeps_the_loop():
    async def run() -> None:
        fake = FakeEngine()
        engine = await _started(fake)
        streams = await _in_flight(engine)
        thread = engine._thread
        fake.fail_step = RuntimeError("injected")
        for stream in streams:
            await _expect_500(stream)
        await _in_engine(engine, lambda e: e.check_integrity())
        assert engine._thread is thread and thread.is_alive()  # same loop, never restarted
        engine.check_ready()
        assert await _complete(engine, "after") == 3
        engine.shutdown()

    asyncio.run(run())


def test_base_exception_kills_the_thread_and_the_supervisor_restarts_it(monkeypatch):
    monkeypatch.setattr(async_engine, "SUPERVISE_INTERVAL_S", 0.5)

    async def run() -> None:
        fake = FakeEngine()
        engine = await _started(fake)
        streams = await _in_flight(engine)
        dead = engine._thread
        fake.fail_step = Fault()
        await asyncio.to_thread(dead.join, 5)
        assert not dead.is_alive()
        with pytest.raises(APIError) as info:  # before the supervisor's next look
            engine.check_ready()
        assert info.value.status == 503
        engine.check_loaded()  # the model is there: a request can still be checked
        server = OpenAIServer(engine, ["fake"])
        bad = CompletionRequest(prompt=[FakeEngine.tokenizer.vocab_size], max_tokens=1)
        with pytest.raises(APIError) as info:  # a bad request is a 400 whatever the loop
            await server.completions(bad, None)  # type: ignore[arg-type]
        assert (info.value.status, info.value.param) == (400, "prompt")
        server.close()
        for stream in streams:
            await _expect_500(stream)
        assert engine._thread is not dead and engine._thread.is_alive()
        engine.check_ready()
        await _in_engine(engine, lambda e: e.check_integrity())
        assert not fake.groups and not fake.held  # the new thread aborted what was left
        assert b"engine:engine_loop_restarts_total" in engine.metrics.render()
        assert engine.metrics.engine_loop_restarts._value.get() == 1
        assert await _complete(engine, "after") == 3
        engine.shutdown()

    asyncio.run(run())


def test_thread_death_during_an_add_and_during_an_engine_call():
    async def run() -> None:
        fake = FakeEngine()
        engine = await _started(fake)
        fake.fail_add = Fault()
        with pytest.raises(APIError) as info:  # its acknowledgement never comes
            await asyncio.wait_for(engine.add("lost", [1, 2], _params(5)), 5)
        assert info.value.status == 500
        await _wait_alive(engine)
        await _in_engine(engine, lambda e: e.check_integrity())  # "lost" was aborted

        def die(_: Any) -> None:
            raise Fault()

        with pytest.raises(APIError) as info:
            await _in_engine(engine, die)
        assert info.value.status == 500
        await _wait_alive(engine)
        assert await _complete(engine, "after") == 3
        engine.shutdown()

    asyncio.run(run())


async def _wait_alive(engine: AsyncEngine) -> None:
    for _ in range(500):
        try:
            engine.check_ready()
            return
        except APIError:
            await asyncio.sleep(0.01)
    raise AssertionError("engine loop not restarted")


def test_close_ends_requests_in_flight_and_refuses_new_ones():
    async def run() -> None:
        fake = FakeEngine()
        engine = await _started(fake)
        [stream] = await _in_flight(engine, 1)
        engine.close(APIError(503, "shutting down"))
        with pytest.raises(APIError, match="shutting down"):
            async for _ in stream:
                pass
        with pytest.raises(APIError, match="shutting down"):
            await engine.add("late", [1, 2], _params(3))
        await _in_engine(engine, lambda e: e.check_integrity())
        assert not fake.groups
        engine.shutdown()

    asyncio.run(run())


# ------------------------------------------------------------------------------ real server
@pytest.fixture(scope="module")
def faulty_server():
    trigger = os.path.join(tempfile.mkdtemp(prefix="fault-"), "fault")
    proc = ServerProcess("--max-model-len", "256", "--num-kv-blocks", "64", "--num-threads", "1",
                         "--enable-debug-endpoints",
                         launcher=[sys.executable, os.path.join(REPO, "tests", "faulty_serve.py")],
                         env={"FAULTY_SERVE_TRIGGER": trigger})
    proc.start()
    proc.trigger = trigger
    yield proc
    proc.stop()


def _inject(server: ServerProcess, kind: str) -> None:
    with open(server.trigger + ".tmp", "w") as f:
        f.write(kind)
    os.replace(server.trigger + ".tmp", server.trigger)


@pytest.mark.parametrize("kind", ["exception", "base"])
def test_real_server_survives_a_fault_in_the_step(faulty_server, kind):
    url = faulty_server.base_url
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    with httpx.Client(base_url=url, timeout=120) as http:
        body = {"model": model, "prompt": "Once upon a time", "max_tokens": 200,
                "ignore_eos": True, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line).startswith("data: {")
            _inject(faulty_server, kind)
            events = [line for line in lines if line]
        assert events[-1] == "data: [DONE]", events[-3:]
        assert '"error"' in events[-2] and '"code":500' in events[-2].replace(" ", "")
        assert http.get("/debug/check_integrity").json() == {"ok": True}
        assert http.get("/health").status_code == 200
        # a non-streamed request in flight when the fault strikes: OpenAI's 500 JSON
        _inject(faulty_server, kind)
        r = http.post("/v1/completions", json={**body, "stream": False})
        assert r.status_code == 500 and r.json()["error"]["code"] == 500, r.text
        assert http.get("/debug/check_integrity").json() == {"ok": True}
    ok = client.completions.create(model=model, prompt="Hello", max_tokens=3, temperature=0,
                                   extra_body={"ignore_eos": True})
    assert ok.usage.completion_tokens == 3
    log = faulty_server.log_text()
    if kind == "base":  # two faults, two restarts
        assert log.count("engine loop restarted") == 2
        metrics = httpx.get(f"{url}/metrics").text
        assert 'engine:engine_loop_restarts_total{model_name="SmolLM2-135M-Instruct"} 2.0' in \
            metrics
