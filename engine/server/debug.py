"""Debug endpoints, served only with `--enable-debug-endpoints` (never in production: they
expose the engine's internals, and the fault routes break it on purpose, for whoever holds the
API key).

- `GET /debug/check_integrity`: runs `LLMEngine.check_integrity()` in the engine thread
  (between two steps, so the block manager is in a consistent state) and answers
  `{"ok": true}`, or `{"ok": false, "error": "..."}` with status 500 when a check fails.
- `POST /debug/faults` `{"kind": ..., "count": 1, "prompt_prefix": [ids] | null}`: arms a fault
  in the engine's model run (`FaultInjector`); answers the injector's state. A bad body is a 400
  naming the field.
- `GET /debug/faults`: the faults armed and those fired (with their wall-clock time).
- `DELETE /debug/faults`: disarms every armed fault.

Fault kinds (each fires inside `LLMEngine.step`, after the scheduler has placed the step's
sequences and allocated their blocks, before the runner moves any block or runs the model, so
that the engine's state is mid-step, as when a kernel fails):

- `step_raises`: the step raises `InjectedFault` (an `Exception`), as a failing model run would.
- `engine_thread_dies`: the step raises `InjectedThreadDeath` (a `BaseException`), which passes
  every `except Exception` and ends the engine thread unless its loop handles that.

With `prompt_prefix` a fault fires only in a step that schedules a sequence whose prompt starts
with those token ids (one request's path: the client that sends such a prompt is the victim);
without it, in the next step that runs the model. `count`: how many times it fires.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Literal, Optional

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt

#: The fault kinds `POST /debug/faults` arms.
FAULT_KINDS = ("step_raises", "engine_thread_dies")


class InjectedFault(Exception):
    """Raised by an armed `step_raises` fault."""


class InjectedThreadDeath(BaseException):
    """Raised by an armed `engine_thread_dies` fault: not an `Exception`, so that it ends the
    engine thread as an interpreter-level failure would."""


class FaultRequest(BaseModel):
    """The body of `POST /debug/faults`; unknown fields are refused (a typo must not arm a
    different fault than the one meant)."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["step_raises", "engine_thread_dies"]
    count: StrictInt = Field(1, ge=1, le=1000)
    prompt_prefix: Optional[list[StrictInt]] = Field(None, min_length=1)


class FaultInjector:
    """Armed faults and a record of those fired; wraps the model run (`runner.execute`) of each
    engine it is installed on. `install` and the wrapped run are called by the engine thread
    only; the state is shared with the event loop under a lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._armed: list[dict[str, Any]] = []
        self._fired: list[dict[str, Any]] = []

    def install(self, engine: Any) -> None:
        """Wraps `engine.runner.execute` (once per runner)."""
        runner = engine.runner
        if getattr(runner, "_fault_injector", None) is self:
            return
        original = runner.execute

        def execute(out: Any, tables: Any) -> Any:
            self._maybe_fire(out)
            return original(out, tables)

        runner.execute = execute
        runner._fault_injector = self

    def arm(self, fault: FaultRequest) -> None:
        """Adds `fault` to the armed ones."""
        with self._lock:
            self._armed.append(fault.model_dump())

    def disarm(self) -> None:
        """Drops every armed fault (those fired stay on record)."""
        with self._lock:
            self._armed.clear()

    def state(self) -> dict[str, Any]:
        """`{"armed": [...], "fired": [...]}`; each fired one has `kind`, `prompt_prefix`,
        `time` (Unix seconds) and `request_ids` (the requests its step had scheduled)."""
        with self._lock:
            return {"armed": [dict(f) for f in self._armed],
                    "fired": [dict(f) for f in self._fired]}

    def _maybe_fire(self, out: Any) -> None:
        prompts = [(seq.group.request_id, seq.group.prompt_token_ids) for seq, _ in out.scheduled]
        with self._lock:
            fault = next((f for f in self._armed if _matches(f["prompt_prefix"], prompts)), None)
            if fault is None:
                return
            fault["count"] -= 1
            if fault["count"] == 0:
                self._armed.remove(fault)
            self._fired.append({"kind": fault["kind"], "prompt_prefix": fault["prompt_prefix"],
                                "time": time.time(),
                                "request_ids": sorted({rid for rid, _ in prompts})})
        if fault["kind"] == "engine_thread_dies":
            raise InjectedThreadDeath("injected fault: the engine thread dies")
        raise InjectedFault("injected fault: the step raises")


def _matches(prefix: Optional[list[int]], prompts: list[tuple[str, list[int]]]) -> bool:
    if prefix is None:
        return bool(prompts)
    return any(ids[:len(prefix)] == prefix for _, ids in prompts)


def install(app: FastAPI, server: Any) -> None:
    """Registers the debug routes for `server` (an `OpenAIServer`)."""
    injector = FaultInjector()

    @app.get("/debug/check_integrity")
    async def check_integrity() -> JSONResponse:
        server.engine.check_ready()
        try:
            await server.engine.call_in_engine_thread(lambda engine: engine.check_integrity())
        except AssertionError as exc:
            return JSONResponse({"ok": False, "error": str(exc) or "integrity check failed"},
                                status_code=500)
        return JSONResponse({"ok": True})

    @app.post("/debug/faults")
    async def arm_fault(fault: FaultRequest) -> JSONResponse:
        server.engine.check_ready()

        def arm(engine: Any) -> None:
            injector.install(engine)
            injector.arm(fault)

        await server.engine.call_in_engine_thread(arm)
        return JSONResponse(injector.state())

    @app.get("/debug/faults")
    async def faults() -> JSONResponse:
        return JSONResponse(injector.state())

    @app.delete("/debug/faults")
    async def disarm_faults() -> JSONResponse:
        injector.disarm()
        return JSONResponse(injector.state())
