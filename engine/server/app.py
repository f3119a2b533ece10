"""The FastAPI app: the routes, each handled by one `OpenAIServer` method (routes.py), behind
the guard (middleware.py: Host allow list, drain, API key, body size and deadline) and, when
configured, CORS (Starlette's CORSMiddleware, outside the guard so that preflight requests need
no key), with OpenAI-shaped errors (errors.py) and the served OpenAPI schema (openapi.py). The
engine thread starts and stops with the app.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.middleware.cors import CORSMiddleware

from engine.server import debug, openapi
from engine.server.access import CORSSettings
from engine.server.errors import install_error_handlers
from engine.server.metrics import CONTENT_TYPE
from engine.server.middleware import GuardMiddleware
from engine.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from engine.server.routes import OpenAIServer
from engine.server.shutdown import Drain


def create_app(server: OpenAIServer, api_key: Optional[str] = None,
               max_request_bytes: int = 4 * 1024 * 1024,
               enable_debug_endpoints: bool = False,
               allowed_hosts: Optional[frozenset[str]] = None,
               cors: Optional[CORSSettings] = None, drain: Optional[Drain] = None,
               body_timeout: Optional[float] = None) -> FastAPI:
    """The app for `server`; the engine thread starts with the app (lifespan) and stops with
    it. `enable_debug_endpoints` adds the routes of `engine.server.debug`; the other arguments
    go to `GuardMiddleware` (None: no such check) and CORSMiddleware (None: no CORS)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server.engine.start(asyncio.get_running_loop())
        yield
        server.engine.shutdown()
        server.close()

    # The OpenAPI schema of the routes below, as vLLM serves it (clients and fuzzers read it); no
    # Swagger/ReDoc pages, which load their scripts from a CDN.
    app = FastAPI(title="paged-kernels engine", lifespan=lifespan, docs_url=None,
                  redoc_url=None, openapi_url="/openapi.json")
    install_error_handlers(app)
    openapi.install(app)
    app.add_middleware(GuardMiddleware, api_key=api_key, max_body_bytes=max_request_bytes,
                       allowed_hosts=allowed_hosts, drain=drain, body_timeout=body_timeout)
    if cors is not None:  # added last: the outermost layer
        app.add_middleware(CORSMiddleware, allow_origins=cors.allowed_origins,
                           allow_methods=cors.allowed_methods, allow_headers=cors.allowed_headers,
                           allow_credentials=cors.allow_credentials)
    _add_routes(app, server)
    if enable_debug_endpoints:
        debug.install(app, server)
    return app


def _add_routes(app: FastAPI, server: OpenAIServer) -> None:
    """Registers the routes; their function names are the schema's operation ids."""

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        return await server.completions(req, raw)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, raw: Request) -> Response:
        return await server.chat(req, raw)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return server.models()

    @app.get("/health")
    async def health() -> Response:
        server.engine.check_ready()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.engine.metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        return await server.tokenize(req)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict[str, Any]:
        return await server.detokenize(req)

    @app.get("/internal/stats")
    async def engine_stats() -> dict[str, Any]:
        return server.engine_stats()
