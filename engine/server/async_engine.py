"""One engine loop for all clients: `LLMEngine.step()` runs in a background thread, and each
request's new tokens are fanned out to its own asyncio queue.

Threading contract: the `LLMEngine` is touched only by the engine thread (it is not thread-safe).
The asyncio side sends it commands (add, abort) through a lock-protected list and a condition; the
engine thread drains them before every step, runs the step, turns each request's cumulative output
into a delta (`_Tracker`) and hands the deltas and a stats snapshot to the event loop with one
`call_soon_threadsafe` per step. Torch releases the GIL inside its kernels, so the event loop
serves HTTP while a step computes.

A consumer that stops early (client disconnect, cancelled task) aborts its request, which frees
its KV blocks on the next loop turn.

Faults: a step that raises an `Exception` fails every request in flight (a 500 each) and the
loop goes on. A `BaseException` that ends the engine thread (a fault injected into it, say) is
noticed by a supervisor task on the event loop: it fails the requests in flight and pending
engine calls with a 500, and starts a new engine thread, which first aborts every request the
engine still holds (freeing their KV blocks), then loops. While no thread is alive, `check_ready`
answers 503. Both paths depend only on what reaches the loop, not on how the fault got there.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Optional

from engine.server.errors import APIError
from engine.server.metrics import ServerMetrics

logger = logging.getLogger("engine.serve")

#: How often the supervisor checks that the engine thread is alive.
SUPERVISE_INTERVAL_S = 0.05
#: What a request in flight gets when the engine fails under it.
_ENGINE_FAILED = "the engine failed while running this request; see the server log"


@dataclass
class ChoiceDelta:
    """What one choice (sequence) of a request gained in one step."""

    index: int
    text: str
    token_ids: list[int]
    #: One `{token_id: logprob}` dict per new token (the chosen token included) or None.
    logprobs: Optional[list[dict[int, float]]]
    finish_reason: Optional[str] = None
    stop_reason: Any = None


@dataclass
class RequestDelta:
    """One step's news for one request. `error` set: the request failed (no more deltas)."""

    choices: list[ChoiceDelta] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    finished: bool = False
    error: Optional[Exception] = None


class _Tracker:
    """Engine-thread state of one request: what was already sent, per choice, and its timing.

    Stop strings: while a choice is unfinished, its last `max(len(stop)) - 1` characters are held
    back, since the engine may still cut them off when a stop string completes."""

    def __init__(self, request_id: str, num_prompt_tokens: int, params: Any,
                 arrival: float) -> None:
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        stops = getattr(params, "stop", None) or []
        stops = [stops] if isinstance(stops, str) else stops
        keep_stop = getattr(params, "include_stop_str_in_output", False)
        self.hold_back = 0 if keep_stop or not stops else max(len(s) for s in stops) - 1
        self.sent_text: dict[int, int] = {}
        self.sent_tokens: dict[int, int] = {}
        self.finished_choices: set[int] = set()
        self.arrival = arrival
        self.first_token_time: Optional[float] = None
        self.last_token_time: Optional[float] = None
        self.num_output_tokens = 0

    def delta(self, output: Any) -> RequestDelta:
        """The news in `output` (a RequestOutput with cumulative text and token ids)."""
        out = RequestDelta(num_prompt_tokens=self.num_prompt_tokens, finished=output.finished)
        for comp in output.outputs:
            idx = comp.index
            if idx in self.finished_choices:
                continue
            done = comp.finish_reason is not None or output.finished
            text = comp.text
            start = self.sent_text.get(idx, 0)
            end = len(text) if done else max(start, len(text) - self.hold_back)
            tok_start = self.sent_tokens.get(idx, 0)
            token_ids = list(comp.token_ids[tok_start:])
            lps = getattr(comp, "logprobs", None)
            new_lps = [dict(x) for x in lps[tok_start:]] if lps is not None else None
            if end == start and not token_ids and not done:
                continue
            self.sent_text[idx] = end
            self.sent_tokens[idx] = tok_start + len(token_ids)
            if done:
                self.finished_choices.add(idx)
            self.num_output_tokens += len(token_ids)
            out.choices.append(ChoiceDelta(idx, text[start:end], token_ids, new_lps,
                                           comp.finish_reason if done else None,
                                           getattr(comp, "stop_reason", None)))
        out.num_output_tokens = self.num_output_tokens
        return out


class AsyncEngine:
    """Drives one `LLMEngine` (built by `build()` in the engine thread) for many asyncio
    clients.

    `max_queue`: most requests waiting for a first step at once; `generate` refuses more with a
    429. Until the engine is built, `generate` raises a 503.
    """

    def __init__(self, build: Callable[[], Any], metrics: ServerMetrics,
                 max_queue: Optional[int] = None) -> None:
        self._build = build
        self.metrics = metrics
        self.max_queue = max_queue
        self.engine: Any = None
        self.load_error: Optional[BaseException] = None
        self.last_stats: Any = None
        self._ready = threading.Event()
        self._cond = threading.Condition()
        self._commands: list[tuple[str, Any]] = []
        self._stopping = False
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._supervisor: Optional[asyncio.Task] = None
        self._closed: Optional[APIError] = None  # set by close(): refuse new requests with it
        self._queues: dict[str, asyncio.Queue] = {}
        self._calls: set[asyncio.Future] = set()  # call_in_engine_thread results not yet set
        self._trackers: dict[str, _Tracker] = {}  # engine thread only
        self._num_pending = 0  # adds not yet seen by the engine (event-loop side)
        self._num_waiting = 0  # from the last stats snapshot

    # ---------------------------------------------------------------- lifecycle
    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self.load_error is None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Starts the engine thread (it builds the engine first, then loops) and, on `loop`,
        the supervisor that restarts the loop if its thread dies."""
        self._loop = loop
        self._thread = self._spawn(self._run)
        self._supervisor = loop.create_task(self._supervise())

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stops the engine loop (and its supervisor); waits up to `timeout` s for the thread,
        then shuts the engine down (which ends its tensor-parallel workers)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._supervisor is not None:
            self._supervisor.cancel()
        if self._thread is not None:
            self._thread.join(timeout)
        if self.engine is not None and hasattr(self.engine, "shutdown"):
            self.engine.shutdown()

    def close(self, error: APIError) -> None:
        """Ends every request in flight with `error` (their engine requests are aborted, which
        frees their KV blocks) and refuses every later one with it: the last act of a drain."""
        self._closed = error
        self._send("fail", error)

    @staticmethod
    def _spawn(target: Callable[[], None]) -> threading.Thread:
        thread = threading.Thread(target=target, name="engine-loop", daemon=True)
        thread.start()
        return thread

    async def _supervise(self) -> None:
        """Event-loop task: restarts the engine loop when its thread has died of a
        BaseException (a thread that ends because the engine failed to load stays ended)."""
        while not self._stopping:
            await asyncio.sleep(SUPERVISE_INTERVAL_S)
            thread = self._thread
            if self._stopping or thread is None or thread.is_alive() or not self.ready:
                continue
            self._restart()

    def _restart(self) -> None:
        """Fails what the dead thread left (requests in flight, adds not yet acknowledged,
        engine calls) with a 500, drops its unread commands, and starts a new thread that
        cleans the engine up before it loops."""
        logger.error("the engine loop died; failing %d requests in flight and restarting it",
                     len(self._queues))
        with self._cond:
            self._commands = []
        for queue in self._queues.values():
            queue.put_nowait(RequestDelta(error=APIError(500, _ENGINE_FAILED)))
        self._queues.clear()
        for future in self._calls:
            if not future.done():
                future.set_exception(APIError(500, "the engine loop failed during this call; "
                                              "see the server log"))
        self._calls.clear()
        self._num_pending = 0
        self.metrics.engine_loop_restarts.inc()
        self._thread = self._spawn(self._recover)

    # ------------------------------------------------------------- client side
    def check_loaded(self) -> None:
        """Raises a 503 APIError unless the engine is built (its model, tokenizer and limits
        can be used to check a request, whether or not its loop is running)."""
        if self.load_error is not None:
            raise APIError(503, "the model failed to load; see the server log")
        if not self._ready.is_set():
            raise APIError(503, "the server is starting (loading the model); retry shortly")

    def check_ready(self) -> None:
        """Raises a 503 APIError unless the engine is built and its loop alive."""
        self.check_loaded()
        if self._thread is not None and not self._thread.is_alive():
            raise APIError(503, "the engine loop has stopped and is being restarted; see the "
                           "server log")

    async def add(self, request_id: str, prompt_token_ids: list[int],
                  params: Any) -> AsyncIterator[RequestDelta]:
        """Adds the request and waits until the engine has accepted it; returns the iterator of
        its deltas (until it finishes). Raises APIError: 503 before the engine is ready, 429 when
        `max_queue` requests already wait, 400 when the engine refuses the request.

        The caller must iterate the result (leaving it early aborts the request) or call
        `abort(request_id)`."""
        self.check_ready()
        if self._closed is not None:
            raise _copy(self._closed)
        if self.max_queue is not None and self._num_waiting + self._num_pending >= self.max_queue:
            raise APIError(429, f"the server is busy: {self.max_queue} requests are already "
                           "waiting (--max-queue); retry later")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self._num_pending += 1
        self._send("add", (request_id, list(prompt_token_ids), params, time.monotonic()))
        try:
            ack: RequestDelta = await queue.get()
        except BaseException:
            self._queues.pop(request_id, None)
            self._send("abort", request_id)
            raise
        if ack.error is not None:
            self._queues.pop(request_id, None)
            raise ack.error
        return self._deltas(request_id, queue)

    async def _deltas(self, request_id: str,
                      queue: asyncio.Queue) -> AsyncIterator[RequestDelta]:
        finished = False
        try:
            while not finished:
                delta: RequestDelta = await queue.get()
                if delta.error is not None:
                    finished = True
                    raise delta.error
                finished = delta.finished
                yield delta
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self._send("abort", request_id)

    async def call_in_engine_thread(self, fn: Callable[[Any], Any]) -> Any:
        """`fn(llm_engine)` run by the engine thread between two steps (where the engine's
        state is consistent); its result, or its exception re-raised here."""
        self.check_ready()
        assert self._loop is not None
        future: asyncio.Future = self._loop.create_future()
        self._calls.add(future)
        self._send("call", (fn, future))
        try:
            return await future
        finally:
            self._calls.discard(future)

    def abort(self, request_id: str) -> None:
        """Asks the engine thread to abort `request_id` (no-op if it already finished)."""
        self._send("abort", request_id)

    def _send(self, kind: str, payload: Any) -> None:
        with self._cond:
            self._commands.append((kind, payload))
            self._cond.notify()

    def _dispatch(self, deltas: list[tuple[str, RequestDelta]], stats: Any,
                  num_added: int) -> None:
        """Event-loop side of a step: route deltas to their queues, update the gauges."""
        self._num_pending -= num_added
        if stats is not None:
            self.last_stats = stats
            self._num_waiting = _stat(stats, "num_waiting", 0)
            self.metrics.update_from_stats(stats)
        for request_id, delta in deltas:
            queue = self._queues.get(request_id)
            if queue is not None:
                queue.put_nowait(delta)
                if delta.finished or delta.error is not None:
                    # the consumer may never read it (it never started iterating)
                    self._queues.pop(request_id, None)

    # ------------------------------------------------------------- engine side
    def _run(self) -> None:
        try:
            self.engine = self._build()
            self._warm_up()
            self.last_stats = self.engine.stats()
            self.metrics.set_baseline(self.last_stats)
        except BaseException as exc:  # any failure means "not ready", logged
            logger.exception("engine start-up failed")
            self.load_error = exc
            self._ready.set()
            return
        self._ready.set()
        logger.info("engine ready")
        self._serve()

    def _recover(self) -> None:
        """Thread body after a restart: abort whatever the dead loop left in the engine, then
        loop. A BaseException ends the thread (the supervisor restarts it again)."""
        try:
            self._abort_everything()
            self._post([], self.engine.stats(), 0)
            logger.info("engine loop restarted")
            self._serve()
        except BaseException:
            logger.critical("the engine loop died", exc_info=True)

    def _serve(self) -> None:
        """The engine loop: apply the clients' commands, step, post the deltas; until
        `shutdown`. A BaseException is logged and ends the thread (see `_supervise`)."""
        try:
            self._loop_forever()
        except BaseException:
            logger.critical("the engine loop died", exc_info=True)

    def _loop_forever(self) -> None:
        assert self.engine is not None
        while True:
            with self._cond:
                while not self._commands and not self._stopping \
                        and not self.engine.has_unfinished_requests():
                    self._cond.wait()
                if self._stopping:
                    return
                commands, self._commands = self._commands, []
            acks, num_added = self._apply(commands)
            if commands:
                self._post(acks, self.engine.stats(), num_added)
            if self.engine.has_unfinished_requests():
                self._post(self._step(), self.engine.stats(), 0)

    def _warm_up(self) -> None:
        """Runs one tiny request before the server reports ready, so that one-time costs (a
        backend compiling its kernels, oneDNN picking its primitives) are not paid by the first
        client."""
        from engine.sampling_params import SamplingParams

        request_id = "__warmup__"
        self.engine.add_request(request_id, [self.engine.tokenizer.bos_token_id or 0] * 4,
                                SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        while self.engine.has_unfinished_requests():
            self.engine.step()

    def _post(self, deltas: list[tuple[str, RequestDelta]], stats: Any, num_added: int) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(self._dispatch, deltas, stats, num_added)
        except RuntimeError:  # the event loop is closed: the server is shutting down
            self._stopping = True

    def _apply(self, commands: list[tuple[str, Any]]) -> tuple[list[tuple[str, RequestDelta]],
                                                                 int]:
        """Adds and aborts, in the order the clients sent them; an acknowledgement (an empty
        delta, or one carrying the error) for each add."""
        acks: list[tuple[str, RequestDelta]] = []
        num_added = 0
        for kind, payload in commands:
            if kind == "add":
                num_added += 1
                request_id, prompt_ids, params, arrival = payload
                try:
                    self.engine.add_request(request_id, prompt_ids, params, arrival_time=arrival)
                except ValueError as exc:
                    acks.append((request_id, RequestDelta(error=APIError(400, str(exc)))))
                    continue
                self._trackers[request_id] = _Tracker(request_id, len(prompt_ids), params,
                                                      arrival)
                acks.append((request_id, RequestDelta(num_prompt_tokens=len(prompt_ids))))
            elif kind == "abort":
                if self._trackers.pop(payload, None) is not None:
                    self.engine.abort_request(payload)
                    self.metrics.observe_finished("abort")
            elif kind == "call":
                self._call(*payload)
            elif kind == "fail":
                acks.extend(self._fail_all(payload))
        return acks, num_added

    def _call(self, fn: Callable[[Any], Any], future: asyncio.Future) -> None:
        """Runs a `call_in_engine_thread` function and hands its outcome to the event loop."""
        assert self._loop is not None

        def settle(result: Any, exc: Optional[BaseException]) -> None:
            if future.cancelled():
                return
            if exc is not None:
                future.set_exception(exc)
            else:
                future.set_result(result)

        try:
            result, exc = fn(self.engine), None
        except Exception as err:  # handed to the caller
            result, exc = None, err
        self._loop.call_soon_threadsafe(settle, result, exc)

    def _step(self) -> list[tuple[str, RequestDelta]]:
        """One engine step; its outputs as deltas. A failing step fails every request in it
        (with a 500 that says nothing of the internals) and keeps the loop alive."""
        try:
            outputs = self.engine.step()
        except Exception:  # logged; clients get a generic 500
            logger.exception("engine step failed; aborting all requests")
            return self._fail_all(APIError(500, _ENGINE_FAILED))
        now = time.monotonic()
        deltas = []
        for output in outputs:
            tracker = self._trackers.get(output.request_id)
            if tracker is None:
                continue
            delta = tracker.delta(output)
            self._observe(tracker, delta, now)
            if delta.finished:
                del self._trackers[output.request_id]
            deltas.append((output.request_id, delta))
        return deltas

    def _observe(self, tracker: _Tracker, delta: RequestDelta, now: float) -> None:
        new_tokens = sum(len(c.token_ids) for c in delta.choices)
        m = self.metrics
        if new_tokens:
            if tracker.first_token_time is None:
                tracker.first_token_time = now
                m.time_to_first_token.observe(now - tracker.arrival)
                m.prompt_tokens.inc(tracker.num_prompt_tokens)
            elif tracker.last_token_time is not None:
                m.inter_token_latency.observe((now - tracker.last_token_time) / new_tokens)
            tracker.last_token_time = now
            m.generation_tokens.inc(new_tokens)
        if delta.finished:
            m.e2e_request_latency.observe(now - tracker.arrival)
            reasons = [c.finish_reason for c in delta.choices if c.finish_reason]
            m.observe_finished(reasons[-1] if reasons else "stop")

    def _fail_all(self, error: APIError) -> list[tuple[str, RequestDelta]]:
        """Aborts every request in the engine; a delta carrying `error` for each tracked one."""
        failed = [(request_id, RequestDelta(error=_copy(error))) for request_id in self._trackers]
        for _ in failed:
            self.metrics.observe_finished("abort")
        self._abort_everything()
        return failed

    def _abort_everything(self) -> None:
        """Aborts every request the engine holds, tracked or not (a fault may have struck
        between the engine's accepting a request and its tracker's creation)."""
        self._trackers.clear()
        for group in list(self.engine.scheduler.groups()):
            try:
                self.engine.abort_request(group.request_id)
            except Exception:  # logged; the next requests may still be served
                logger.exception("abort of %s failed", group.request_id)


def _copy(error: APIError) -> APIError:
    """A fresh exception per request: one instance raised in many tasks would share its
    traceback."""
    return APIError(error.status, error.message, error.param, error.headers)


def _stat(stats: Any, key: str, default: Any) -> Any:
    if isinstance(stats, dict):
        return stats.get(key, default)
    return getattr(stats, key, default)
