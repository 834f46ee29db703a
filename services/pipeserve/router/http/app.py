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
too), GET /openapi.json (API key required when one is set, like /v1/*).
Callers may add routes to the returned app.

Every error, including FastAPI's own (404 unknown path, 405 method, request
validation), an InvalidRequestError raised anywhere (400) and unexpected
exceptions (500), is answered in OpenAI's shape {"error": {"message", "type",
"param", "code"}}, and logged as one line (a traceback only for a 500). A
client that disconnected before its response was ready, even in the middle of
its body, is counted and logged as 499 (nothing reaches it).

A handler may note warnings for the client in `request.state.warnings` (router/features/tools.py: tools
the chat template drops); each is sent as a `Warning: 299 pipeserve "..."` response header, a
header OpenAI clients ignore and a person reading the response sees.

`uvicorn_server` serves with router/http/http_guard.py's protocol (header deadline
and size cap) and ends open streams before the graceful-shutdown deadline.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pipeserve.config import RouterConfig
from pipeserve.errors import InvalidRequestError
from pipeserve.router import errors
from pipeserve.router.api import openapi as openapi_doc
from pipeserve.router.errors import APIError
from pipeserve.router.http.edge import ClientGone
from pipeserve.router.http.handlers import Router
from pipeserve.router.http.http_guard import RouterServer, server_config
from pipeserve.router.upstream import trace
from pipeserve.router.upstream.metrics import RequestMetrics
from pipeserve.router.upstream.replicas import ReplicaSet

log = logging.getLogger("pipeserve.router")

CLIENT_CLOSED = 499  # nginx's "client closed request": only the access log and the metrics see it


def build_app(config: RouterConfig, replicas: ReplicaSet, registry: CollectorRegistry) -> FastAPI:
    router = Router(config, replicas, registry)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await router.upstream.close()

    app = FastAPI(
        title="pipeserve router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.router = router
    app.add_middleware(RequestMetrics, metrics=router.metrics)
    app.add_middleware(WarningHeaders)
    trace.instrument(app)  # a server span per request when this process traces (router/upstream/trace.py)
    _install_error_handlers(app)

    @app.post("/v1/completions", openapi_extra=openapi_doc.COMPLETIONS)
    async def completions(request: Request) -> Response:
        return await router.completions(request)

    @app.post("/v1/chat/completions", openapi_extra=openapi_doc.CHAT)
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

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(request: Request) -> Response:
        router.check_auth(request)
        return JSONResponse(app.openapi())

    return app


class WarningHeaders:
    """Adds a `Warning` header per entry of `request.state.warnings` (scope["state"]) as the
    response starts, streamed or not."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_warnings(message: Message) -> None:
            warnings = (scope.get("state") or {}).get("warnings")
            if message["type"] == "http.response.start" and warnings:
                quoted = [w.replace("\\", "\\\\").replace('"', '\\"') for w in warnings]
                extra = [(b"warning", f'299 pipeserve "{w}"'.encode("latin-1", "replace")) for w in quoted]
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, send_with_warnings)


def _install_error_handlers(app: FastAPI) -> None:
    def answer(request: Request, err: APIError) -> Response:
        # One line per refused request: what a client was told, never a traceback.
        level = logging.WARNING if err.status >= 500 else logging.INFO
        log.log(level, "%s %s -> %d: %s", request.method, request.url.path, err.status, err.message[:300])
        return errors.error_response(err)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Response:
        return answer(request, exc)

    @app.exception_handler(InvalidRequestError)
    async def invalid_request(request: Request, exc: InvalidRequestError) -> Response:
        return answer(request, errors.from_invalid_request(exc))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")]
        message = first.get("msg", "invalid request")
        return answer(request, errors.invalid(".".join(loc) or None, message))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        response = answer(request, errors.http_error(exc.status_code, exc.detail))
        if exc.headers is not None:
            response.headers.update(exc.headers)
        return response

    @app.exception_handler(ClientGone)
    @app.exception_handler(ClientDisconnect)
    async def client_gone(request: Request, exc: Exception) -> Response:
        log.info(
            "%s %s -> %d: the client disconnected %s",
            request.method,
            request.url.path,
            CLIENT_CLOSED,
            exc or "before its response was ready",
        )
        return Response(status_code=CLIENT_CLOSED)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return errors.error_response(errors.internal("internal server error"))


def uvicorn_server(app: FastAPI, config: RouterConfig, **kwargs: object) -> RouterServer:
    """A uvicorn server for `app` on config.host:config.port; `await server.serve()` in the replicas' loop.

    Outside the main thread uvicorn installs no signal handlers: set `server.should_exit = True` to stop it.
    """
    return RouterServer(server_config(app, config, **kwargs))
