"""OpenTelemetry tracing for one pipeserve process: set up once at start, shut down on the way out.

    tracing = setup_tracing("pipeserve-router")      # first thing in the process
    try:
        ...serve...
    finally:
        tracing.shutdown(deadline_s=5.0)             # flushes what is queued, within the deadline

Tracing is ON only when one of these is set (docs/observability.md, "Traces"):
  OTEL_EXPORTER_OTLP_ENDPOINT / OTEL_EXPORTER_OTLP_TRACES_ENDPOINT  OTLP over gRPC to a collector
                                                                    (the exporter reads every other
                                                                    OTEL_EXPORTER_OTLP_* itself)
  PIPESERVE_TRACE_FILE=PATH     every span as one JSON line appended to PATH (a debugging and testing
                                exporter: several processes may share one file, each batch is one
                                O_APPEND write)
and OTEL_SDK_DISABLED is not "true". Then the process gets an SDK TracerProvider (resource from
`service_name` + OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES, which win; sampler from
OTEL_TRACES_SAMPLER / _ARG, default parentbased_always_on) with one BatchSpanProcessor per exporter:
its queue is the bounded buffer (OTEL_BSP_MAX_QUEUE_SIZE, 2048 spans; beyond it spans are dropped and
counted by the SDK), its thread exports every OTEL_BSP_SCHEDULE_DELAY ms.

When OFF nothing is installed: the global provider stays the API's proxy (no-op tracers, no thread,
no exporter), `enabled()` is False and callers skip their instrumentation altogether.

The TracerProvider is process-wide state: OpenTelemetry's API keeps one global provider per process
(`trace.set_tracer_provider` accepts a single call). It is set here once, at start-up, and nowhere
else; everything else asks `trace.get_tracer(...)`.

No torch here: the router imports this module (tests/test_import_graph.py).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import OTELResourceDetector, Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from pipeserve import env as pipeserve_env

log = logging.getLogger(__name__)

TRACE_FILE_ENV = pipeserve_env.TRACE_FILE
ENDPOINT_ENVS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
TRACER_NAME = "pipeserve"
# W3C trace context only: what pipeserve's own hops (gRPC metadata, plans) carry.
_W3C = TraceContextTextMapPropagator()


def _id(n: int, width: int) -> str:
    return format(n, f"0{width}x")


def span_to_dict(span: ReadableSpan) -> dict:
    """One span as the file exporter writes it (ids as W3C hex, times in ns since the epoch)."""
    ctx = span.get_span_context()
    parent = span.parent
    return {
        "trace_id": _id(ctx.trace_id, 32) if ctx else None,
        "span_id": _id(ctx.span_id, 16) if ctx else None,
        "parent_id": _id(parent.span_id, 16) if parent else None,
        "name": span.name,
        "kind": span.kind.name,
        "service": (span.resource.attributes.get("service.name") if span.resource else None),
        "start": span.start_time,
        "end": span.end_time,
        "status": span.status.status_code.name,
        "attributes": dict(span.attributes or {}),
        "events": [
            {"name": e.name, "time": e.timestamp, "attributes": dict(e.attributes or {})} for e in span.events
        ],
        "links": [_id(link.context.span_id, 16) for link in span.links],
    }


class JsonLinesFileExporter(SpanExporter):
    """Appends every exported span to `path` as one JSON object per line (span_to_dict's shape).

    A debugging and testing exporter (PIPESERVE_TRACE_FILE). Behind a BatchSpanProcessor, whose
    bounded queue is the buffer; each batch is one write() on an O_APPEND descriptor, so processes
    sharing the file do not interleave lines.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        data = "".join(json.dumps(span_to_dict(s), default=str) + "\n" for s in spans).encode()
        with self._lock:
            if self._fd is None:
                return SpanExportResult.FAILURE
            try:
                os.write(self._fd, data)
            except OSError as e:
                log.warning("trace file %s: %s", self.path, e)
                return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def wanted(env: Mapping[str, str] | None = None) -> bool:
    """Whether `env` (default os.environ) turns tracing on."""
    env = pipeserve_env.environ() if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return any(env.get(k) for k in (*ENDPOINT_ENVS, TRACE_FILE_ENV))


@dataclass
class Tracing:
    """What setup_tracing installed; `provider` is None when tracing is off."""

    provider: TracerProvider | None = None
    exporters: list[str] = field(default_factory=list)

    @property
    def on(self) -> bool:
        return self.provider is not None

    def shutdown(self, deadline_s: float = 5.0) -> bool:
        """Export what is queued and stop the exporter threads, within `deadline_s`; True if done in
        time. Safe to call when off and more than once. A stuck collector costs at most the deadline:
        the shutdown runs on a daemon thread we stop waiting for."""
        provider, self.provider = self.provider, None
        if provider is None:
            return True
        worker = threading.Thread(target=provider.shutdown, name="otel-shutdown", daemon=True)
        worker.start()
        worker.join(deadline_s)
        if worker.is_alive():
            log.warning("tracing: spans not flushed within %.1fs; some are lost", deadline_s)
            return False
        return True


def setup_tracing(service_name: str, attributes: Mapping[str, str | int] | None = None) -> Tracing:
    """Install this process's TracerProvider if the environment asks for tracing (the SDK's exporter,
    sampler and resource read os.environ too, so there is no other source).

    Call once per process, before any instrumented object is built. `attributes` become resource
    attributes (e.g. the stage's rank). Raises ValueError if a provider is already installed here.
    """
    env = pipeserve_env.environ()
    if not wanted(env):
        return Tracing()
    if enabled():
        raise ValueError("tracing is already set up in this process")
    resource = Resource.create({"service.name": service_name, **(attributes or {})}).merge(
        OTELResourceDetector().detect()  # OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES win
    )
    provider = TracerProvider(resource=resource, shutdown_on_exit=False)  # shutdown() has a deadline
    names: list[str] = []
    if path := env.get(TRACE_FILE_ENV):
        provider.add_span_processor(BatchSpanProcessor(JsonLinesFileExporter(path)))
        names.append(f"file {path}")
    if any(env.get(k) for k in ENDPOINT_ENVS):
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        names.append("otlp")
    trace.set_tracer_provider(provider)
    log.info("tracing on (%s): %s", service_name, ", ".join(names))
    return Tracing(provider, names)


def enabled() -> bool:
    """Whether this process exports traces (an SDK provider is installed)."""
    return isinstance(trace.get_tracer_provider(), TracerProvider)


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME)


def inject(context: Context | None = None) -> dict[str, str]:
    """The W3C headers (`traceparent`, maybe `tracestate`) of `context` (default: the current one)."""
    carrier: dict[str, str] = {}
    _W3C.inject(carrier, context=context)
    return carrier


def traceparent_of(span: trace.Span) -> str | None:
    """`span`'s W3C traceparent if it is sampled (what stage 0 puts in a plan), else None."""
    ctx = span.get_span_context()
    if not ctx.is_valid or not ctx.trace_flags.sampled:
        return None
    return inject(trace.set_span_in_context(span)).get("traceparent")


def extract(carrier: Mapping[str, str]) -> Context:
    """A context whose parent is the span named by `carrier`'s W3C headers (empty if none valid)."""
    return _W3C.extract(dict(carrier))
