"""Debug endpoints, served only with `--enable-debug-endpoints` (never in production: they
expose the engine's internals to whoever holds the API key).

- `GET /debug/check_integrity`: runs `LLMEngine.check_integrity()` in the engine thread
  (between two steps, so the block manager is in a consistent state) and answers
  `{"ok": true}`, or `{"ok": false, "error": "..."}` with status 500 when a check fails.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse


def install(app: FastAPI, server: Any) -> None:
    """Registers the debug routes for `server` (an `OpenAIServer`)."""

    @app.get("/debug/check_integrity")
    async def check_integrity() -> JSONResponse:
        server.engine.check_ready()
        try:
            await server.engine.call_in_engine_thread(lambda engine: engine.check_integrity())
        except AssertionError as exc:
            return JSONResponse({"ok": False, "error": str(exc) or "integrity check failed"},
                                status_code=500)
        return JSONResponse({"ok": True})
