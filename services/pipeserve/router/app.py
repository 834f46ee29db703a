"""The router's FastAPI app: OpenAI-compatible endpoints over a ReplicaSet.

    registry = CollectorRegistry()
    replicas = ReplicaSet(config, {"g0": "127.0.0.1:50051"}, registry)

    async def main() -> None:
        await replicas.start()          # in the loop that serves HTTP: grpc.aio is per loop
        app = build_app(config, replicas, registry)
        try:
            await uvicorn_server(app, config).serve()
        finally:
            await replicas.close()

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models,
GET /health (200 when a group is ready, else 503), GET /health_generate,
GET /metrics (the whole `registry`, so metrics others register on it show
too). Callers may add routes to the returned app.

Every error, including FastAPI's own (404 unknown path, 405 method, request
validation) and unexpected exceptions (500), is answered in OpenAI's shape
{"error": {"message", "type", "param", "code"}}. A client that disconnected
before its response was ready is logged as 499 (nothing reaches it).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from pipeserve.config import RouterConfig
from pipeserve.router import errors
from pipeserve.router.errors import APIError
from pipeserve.router.handlers import ClientGone, Router
from pipeserve.router.metrics import RequestMetrics
from pipeserve.router.replicas import ReplicaSet

log = logging.getLogger("pipeserve.router")

CLIENT_CLOSED = 499  # nginx's "client closed request": only the access log and the metrics see it


def build_app(config: RouterConfig, replicas: ReplicaSet, registry: CollectorRegistry) -> FastAPI:
    router = Router(config, replicas, registry)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await router.upstream.close()

    app = FastAPI(title="pipeserve router", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.router = router
    app.add_middleware(RequestMetrics, metrics=router.metrics)
    _install_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await router.completions(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await router.chat(request)

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        return router.models(request)

    @app.get("/health")
    async def health() -> Response:
        return router.health()

    @app.get("/health_generate")
    async def health_generate() -> Response:
        return await router.health_generate()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Response:
        return errors.error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")]
        message = first.get("msg", "invalid request")
        return errors.error_response(errors.invalid(".".join(loc) or None, message))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        err = errors.http_error(exc.status_code, exc.detail)
        return errors.error_response(err) if exc.headers is None else _with_headers(err, exc.headers)

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=CLIENT_CLOSED)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return errors.error_response(errors.internal("internal server error"))


def _with_headers(err: APIError, headers: dict[str, str]) -> Response:
    response = errors.error_response(err)
    response.headers.update(headers)
    return response


def uvicorn_server(app: FastAPI, config: RouterConfig, **kwargs: object) -> uvicorn.Server:
    """A uvicorn server for `app` on config.host:config.port; `await server.serve()` in the replicas' loop.

    Outside the main thread uvicorn installs no signal handlers: set `server.should_exit = True` to stop it.
    """
    options: dict = {"host": config.host, "port": config.port, "log_level": "warning", "lifespan": "on"}
    options.update(kwargs)
    return uvicorn.Server(uvicorn.Config(app, **options))
