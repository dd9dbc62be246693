"""The OpenAI-compatible HTTP API of ``spire serve`` (FastAPI): the engine runs in one thread, handlers queue
requests into it and await or stream their tokens.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (the target's chat template, as
``spire generate --chat``), both streamed (Server-Sent Events, ``data: {...}`` chunks then ``data: [DONE]``) or
not, with n choices, logprobs and (completions) echo; ``GET /v1/models``; ``GET /health`` (200: the model is loaded
and the engine thread alive); ``GET /metrics`` (Prometheus text); ``GET /docs`` (the request schemas). A body larger
than ``max_request_bytes`` is a 413 before it is read whole; parsing, validation, tokenizing and templating run on
two parse threads, never on the event loop. Bad requests get OpenAI's error body with a 4xx naming the field (:mod:`spire.serving.protocol`);
past ``max_waiting`` queued requests a 503 with Retry-After; with an API key, a /v1 request without
``Authorization: Bearer KEY`` a 401. A client that disconnects has its request aborted (its slot is free at the
engine's next step).
"""

from __future__ import annotations

import logging
import threading
from contextlib import asynccontextmanager
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from spire.serving import protocol
from spire.serving.engine_loop import EngineLoop, torch_thread, trim_heap
from spire.engine.output import TextStream
from spire.serving.protocol import ApiError
from spire.serving.server import Server

__all__ = ["EngineLoop", "Server", "TextStream", "create_app", "run", "torch_thread", "trim_heap"]

log = logging.getLogger("spire.serve")


def create_app(server: Server) -> FastAPI:
    """The FastAPI app over ``server``; its lifespan starts and stops the engine thread."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.loop.start()
        yield
        server.loop.stop()

    app = FastAPI(title="spire serve", lifespan=lifespan, docs_url="/docs", redoc_url=None,
                  openapi_url="/openapi.json")

    def openapi() -> dict:
        """FastAPI's schema, with the request models of the two generation endpoints (their bodies are read by
        hand: capped, then validated off the event loop)."""
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            comps = schema.setdefault("components", {}).setdefault("schemas", {})
            for path, model in (("/v1/completions", protocol.CompletionRequest),
                                ("/v1/chat/completions", protocol.ChatCompletionRequest)):
                js = model.model_json_schema(ref_template="#/components/schemas/{model}")
                comps.update(js.pop("$defs", {}))
                comps[model.__name__] = js
                schema["paths"][path]["post"]["requestBody"] = {
                    "required": True,
                    "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        err = ApiError(e.status_code, str(e.detail), None, "not_found" if e.status_code == 404 else None)
        return JSONResponse(err.body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def internal(request: Request, e: Exception) -> JSONResponse:
        log.exception("internal error")
        err = ApiError(500, f"internal error: {type(e).__name__}", None, "internal_error", "server_error")
        return JSONResponse(err.body(), status_code=500)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await server.generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await server.generate(request, chat=True)

    @app.get("/v1/models")
    async def models(request: Request):
        server.check_auth(request)
        return server.models()

    @app.get("/health")
    async def health():
        if not server.loop.alive():
            raise ApiError(503, "the engine thread is not running", None, "engine_down", "server_error")
        return {"status": "ok", "model": server.model_id, "draft": server.draft}

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST

        return PlainTextResponse(server.metrics(), media_type=CONTENT_TYPE_LATEST)

    return app


ABORT_MARGIN_S = 2.0
"""Seconds of the shutdown grace kept for aborted requests to send their last response."""


def run(app: FastAPI, host: str, port: int, graceful_s: float = 30.0, log_level: str = "info",
        abort_all: Callable[[], None] | None = None) -> None:
    """Serve ``app`` with uvicorn until SIGINT / SIGTERM. On SIGTERM in-flight requests get ``graceful_s`` seconds
    to finish; those still running ``ABORT_MARGIN_S`` before the end are aborted through ``abort_all`` (each client
    gets its answer so far, finish_reason "abort", not a cut connection); then the engine stops and the process
    exits with status 0 (uvicorn itself would re-raise the signal)."""
    import signal

    import uvicorn

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame) -> None:
            first = not self.should_exit
            super().handle_exit(sig, frame)
            if sig == signal.SIGTERM and sig in self._captured_signals:
                self._captured_signals.remove(sig)
            if first and abort_all is not None:
                timer = threading.Timer(max(graceful_s - ABORT_MARGIN_S, 0.0), abort_all)
                timer.daemon = True
                timer.start()

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=graceful_s)
    _Server(config).run()
