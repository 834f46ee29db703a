"""Several models behind one router (`pipeserve router --models FILE`, router/upstream/models_file.py).

Each served model is a whole single-model router (its own tokenizer and chat template, ReplicaSet,
discovery, policy, admission limit: `build_app` as for one model); `ModelRouter` is the ASGI app in
front of them:

* POST (any path): the body is read (within `body_timeout_s`, at most edge.MAX_BODY_BYTES: else 408 /
  413 as a single router answers) and its `model` picks the model's app, which gets the body
  unchanged. No `model` (or a body that is not a JSON object: that app answers the 400) -> the first
  model. A `model` no entry serves -> 404 `model_not_found` in OpenAI's shape (after the API key
  check: a bad key is still 401).
* GET /v1/models: every model's card, in the file's order. GET /health: 200 while at least one model
  has a ready group, with the ready groups per model; else 503. GET /metrics: every model's metrics
  in one exposition, each sample labelled `model_name` (the served name, as vLLM labels its own).
* GET /v1/models/<id> (where an app serves it) goes to the model <id>'s app.
* Anything else (GET /health_generate, /openapi.json, ...) is the first model's.
Shutdown: `end_streams` ends every model's open streams (http_guard.RouterServer calls it).
"""

from __future__ import annotations

import asyncio
import json
import types
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.samples import Sample
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.types import Message, Receive, Scope, Send

from pipeserve.router import errors
from pipeserve.router.errors import APIError
from pipeserve.router.http.edge import BIG_BODY_BYTES, MAX_BODY_BYTES, check_auth


@dataclass
class Served:
    """One model: its served name, its app (build_app's), and the registry that app reports to."""

    name: str
    app: Any
    registry: CollectorRegistry

    @property
    def router(self) -> Any:
        return self.app.state.router


class ModelMetrics:
    """A collector: every model's registry, each sample labelled model_name=<served name>."""

    def __init__(self, served: list[Served]) -> None:
        self.served = served

    def collect(self) -> Iterable[Metric]:
        families: dict[str, Metric] = {}
        for s in self.served:
            for m in s.registry.collect():
                merged = families.get(m.name)
                if merged is None:
                    merged = families[m.name] = Metric(m.name, m.documentation, m.type, m.unit)
                merged.samples += [
                    Sample(x.name, {**x.labels, "model_name": s.name}, x.value, x.timestamp, x.exemplar)
                    for x in m.samples
                ]
        return list(families.values())


class ModelRouter:
    def __init__(self, served: list[Served], api_key: str | None, body_timeout_s: float) -> None:
        assert served, "at least one model"
        self.served = served
        self.by_name = {s.name: s for s in served}
        self.api_key = api_key
        self.body_timeout_s = body_timeout_s
        self.registry = CollectorRegistry()
        self.registry.register(ModelMetrics(served))  # a Collector: collect() is all it needs
        self.state = types.SimpleNamespace(router=self)  # RouterServer finds end_streams here

    def end_streams(self) -> None:
        for s in self.served:
            s.router.end_streams()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        default = self.served[0].app
        if scope["type"] != "http":
            return await default(scope, receive, send)
        method, path = scope["method"], scope["path"]
        if method == "POST":
            return await self._dispatch(scope, receive, send)
        request = Request(scope, receive)
        if method == "GET" and path == "/v1/models":
            response = self._answer(lambda: self._models(request))
        elif method == "GET" and path == "/health":
            response = self._answer(self._health)
        elif method == "GET" and path == "/metrics":
            response = Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)
        else:
            owner = (
                self.by_name.get(path.removeprefix("/v1/models/")) if path.startswith("/v1/models/") else None
            )
            return await (owner.app if owner else default)(scope, receive, send)
        await response(scope, receive, send)

    # --- routing by model ----------------------------------------------------------------
    async def _dispatch(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw = bytearray()
        more = True
        try:
            async with asyncio.timeout(self.body_timeout_s):
                while more and len(raw) <= MAX_BODY_BYTES:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        raise ClientDisconnect()
                    raw += message.get("body", b"")
                    more = message.get("more_body", False)
        except TimeoutError:
            err = APIError(
                408,
                f"the request body did not arrive within {self.body_timeout_s}s",
                code="request_timeout",
                headers={"Connection": "close"},
            )
            return await errors.error_response(err)(scope, receive, send)
        except ClientDisconnect:
            return  # nobody to answer
        target = self.served[0]
        model = await self._model_of(bytes(raw)) if not more else None
        if isinstance(model, str):
            chosen = self.by_name.get(model)
            if chosen is None:
                try:
                    check_auth(Request(scope), self.api_key)
                except APIError as e:
                    return await errors.error_response(e)(scope, receive, send)
                return await errors.error_response(errors.model_not_found(model))(scope, receive, send)
            target = chosen
        await target.app(scope, _replay(bytes(raw), more, receive), send)

    @staticmethod
    async def _model_of(raw: bytes) -> Any:
        """The body's `model`, or None when it is not a JSON object (the model's app answers the 400)."""
        try:
            body = await asyncio.to_thread(json.loads, raw) if len(raw) > BIG_BODY_BYTES else json.loads(raw)
        except (ValueError, RecursionError):
            return None
        return body.get("model") if isinstance(body, dict) else None

    # --- the front's own answers ---------------------------------------------------------
    @staticmethod
    def _answer(fn: Any) -> Response:
        try:
            return JSONResponse(fn())
        except APIError as e:
            return errors.error_response(e)

    def _models(self, request: Request) -> dict:
        check_auth(request, self.api_key)
        data = [card for s in self.served for card in s.router.models(request)["data"]]
        return {"object": "list", "data": data}

    def _health(self) -> dict:
        ready = {s.name: len(s.router.replicas.ready_groups()) for s in self.served}
        if not any(ready.values()):
            raise errors.unavailable("no pipeline group of any model is ready")
        return {"status": "ok", "ready_groups": ready}

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                for s in self.served:
                    await s.router.upstream.close()
                await send({"type": "lifespan.shutdown.complete"})
                return


def _replay(raw: bytes, more: bool, receive: Receive) -> Receive:
    """`receive` with the body already read handed out first."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": more}
        return await receive()

    return replay
