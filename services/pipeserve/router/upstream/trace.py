"""The router's traces (docs/observability.md, "Traces"); all of it is skipped unless the process traces.

* The server span of each HTTP request: opentelemetry-instrumentation-fastapi on the app
  (`instrument`), which honours the client's W3C `traceparent`. Polled and scraped paths (/metrics,
  /health*, /livez, /readyz) get no span; neither do the ASGI send/receive steps (a streamed
  response would get one per chunk).
* A client span per Generate call (`GenerateSpan`), made here and not by
  opentelemetry-instrumentation-grpc's aio client interceptors: for a unary-stream call those return
  the response as an async iterator, and grpc.aio then refuses `call.read()` (mixing the two
  streaming styles) and hides the call's initial metadata, which upstream.py reads on every message
  for the admitted rule. So the span is started here and its context injected with the W3C
  propagator into the call's metadata; stage 0's official aio server interceptor extracts it.
* GenAI semantic-convention attributes on the server span (`RequestAttributes`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import grpc
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from pipeserve.obs import tracing

if TYPE_CHECKING:
    from fastapi import FastAPI

    from pipeserve.router.api.responses import ChoiceResult
    from pipeserve.sampling_params import SamplingParams

UNTRACED_PATHS = "/metrics,/health,/livez,/readyz"  # each a prefix: /health covers /health_generate
GENERATE_METHOD = "/pipeserve.v1.Generation/Generate"


def instrument(app: FastAPI) -> None:
    """A server span per HTTP request on `app`, if this process traces."""
    if not tracing.enabled():
        return
    from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

    FastAPIInstrumentor.instrument_app(app, excluded_urls=UNTRACED_PATHS, exclude_spans=["receive", "send"])


class GenerateSpan:
    """The client span of one Generate call; `metadata` carries its context to stage 0."""

    def __init__(self, group: str, target: str, request_id: str) -> None:
        self.span: Span | None = None
        self.metadata: tuple[tuple[str, str], ...] = ()
        if not trace.get_current_span().is_recording():
            return  # tracing off, or the request not sampled: nothing to do
        self.span = tracing.tracer().start_span(
            GENERATE_METHOD.lstrip("/"),
            kind=SpanKind.CLIENT,
            attributes={
                "rpc.system": "grpc",
                "rpc.service": "pipeserve.v1.Generation",
                "rpc.method": "Generate",
                "server.address": target,
                "pipeserve.group": group,
                "pipeserve.request_id": request_id,
            },
        )
        self.metadata = tuple(tracing.inject(trace.set_span_in_context(self.span)).items())

    def end(self, code: grpc.StatusCode | None = None, details: str = "") -> None:
        """End the span (idempotent): `code` None or OK for a call that ended well."""
        span, self.span = self.span, None
        if span is None:
            return
        if code is not None:
            span.set_attribute("rpc.grpc.status_code", code.value[0])
            if code != grpc.StatusCode.OK:
                span.set_status(Status(StatusCode.ERROR, f"{code.name}: {details}"[:300]))
        span.end()


class RequestAttributes:
    """GenAI and pipeserve attributes on the HTTP request's server span (the current span when built)."""

    def __init__(self, model: str, params: Sequence[SamplingParams]) -> None:
        span = trace.get_current_span()
        self.span: Span | None = span if span.is_recording() else None
        if self.span is None or not params:
            return
        p = params[0]  # one request's prompts share their sampling parameters
        self.span.set_attributes(
            {
                "gen_ai.operation.name": "text_completion",
                "gen_ai.system": "pipeserve",
                "gen_ai.request.model": model,
                "gen_ai.request.max_tokens": p.max_tokens or 0,
                "gen_ai.request.temperature": p.temperature,
                "gen_ai.request.top_p": p.top_p,
            }
        )

    def ended(self, results: Sequence[ChoiceResult], groups: Sequence[str], retries: int) -> None:
        """The response is complete (or abandoned): usage, finish reasons, where it ran."""
        span, self.span = self.span, None
        if span is None:
            return
        span.set_attributes(
            {
                "gen_ai.usage.input_tokens": sum(r.prompt_tokens for r in results),
                "gen_ai.usage.output_tokens": sum(r.completion_tokens for r in results),
                "gen_ai.response.finish_reasons": [r.finish_reason or "none" for r in results],
                "pipeserve.cached_tokens": sum(r.cached_tokens for r in results),
                "pipeserve.group": sorted(set(groups)),
                "pipeserve.retries": retries,
            }
        )
