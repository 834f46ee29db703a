"""Spans of a sampled request's life on stage 0 (docs/observability.md, "Traces").

Under the gRPC server span of its Generate call (opentelemetry-instrumentation-grpc's aio server
interceptor, which extracts the router's `traceparent` from the call's metadata), a request gets:

  pipeserve.queue          submit -> the first plan that schedules it (cached tokens at admission)
  pipeserve.prefill_chunk  one per prompt chunk: its plan submitted -> that plan's result back
                           (pipeserve.plan_id, pipeserve.chunk.start_pos, pipeserve.chunk.tokens)
  pipeserve.decode         ONE span from the first decode plan to the end, with an event per
                           doubling of the output (1, 2, 4, ... tokens) and per preemption
  pipeserve.finish         finish reason (or error), token counts, cached tokens per tier

and the gRPC server span's traceparent goes into the request's first plan (StepPlan.traces), so
followers parent their plan spans to it (ring/plan_trace.py).

Cost: `RequestTrace.start` returns None unless the call's span is recording (tracing on and the
request sampled); the engine loop keeps a `StageTraces` only when this process traces, and checks
it once per plan and per published delta — nothing is done per token for unsampled requests.
Threads: `RequestTrace.start` runs on the gRPC handler; everything else on the engine-loop thread.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import grpc
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span
from opentelemetry.util.types import AttributeValue

from pipeserve.engine.plan import StepPlan
from pipeserve.engine.request import Request
from pipeserve.obs import tracing


@dataclass
class RequestTrace:
    """One sampled request's spans on stage 0; its parent is the Generate call's server span."""

    parent: Context
    traceparent: str
    queue: Span
    req: Request | None = None
    decode: Span | None = None
    next_mark: int = 1  # output length of the decode span's next progress event
    preemptions: int = 0

    @staticmethod
    def start(req_id: str) -> RequestTrace | None:
        """The trace of a request submitted now, under the current span; None if that is not sampled."""
        span = trace.get_current_span()
        if not span.is_recording():
            return None
        traceparent = tracing.traceparent_of(span)
        if traceparent is None:
            return None
        parent = trace.set_span_in_context(span)
        span.set_attribute("pipeserve.request_id", req_id)
        queue = tracing.tracer().start_span("pipeserve.queue", context=parent)
        return RequestTrace(parent, traceparent, queue)

    def child(self, name: str, attributes: dict[str, AttributeValue]) -> Span:
        return tracing.tracer().start_span(name, context=self.parent, attributes=attributes)


@dataclass
class StageTraces:
    """The traced requests of one engine loop and the open plan spans; engine-loop thread only."""

    rank: int = 0
    requests: dict[str, RequestTrace] = field(default_factory=dict)
    plan_spans: dict[int, list[Span]] = field(default_factory=dict)  # step id -> its chunk spans

    def admitted(self, req: Request, rt: RequestTrace) -> None:
        """`req` entered the scheduler: its plans carry the trace context to the followers."""
        rt.req = req
        req.traceparent = rt.traceparent
        self.requests[req.req_id] = rt

    # --- the engine's plan observer (LLMEngine.observer) ------------------------
    def submitted(self, plan: StepPlan) -> None:
        if not self.requests:
            return
        for chunk in plan.chunks:
            rt = self.requests.get(chunk.req_id)
            if rt is None or rt.req is None:
                continue
            req = rt.req
            if rt.queue.is_recording():
                rt.queue.set_attribute("pipeserve.cached_tokens", req.num_cached_prompt_tokens)
                rt.queue.end()
            if chunk.start_pos < len(req.prompt_token_ids):
                span = rt.child(
                    "pipeserve.prefill_chunk",
                    {
                        "pipeserve.plan_id": plan.step_id,
                        "pipeserve.chunk.start_pos": chunk.start_pos,
                        "pipeserve.chunk.tokens": len(chunk.token_ids),
                        "pipeserve.stage": self.rank,
                    },
                )
                self.plan_spans.setdefault(plan.step_id, []).append(span)
            elif rt.decode is None:
                rt.decode = rt.child("pipeserve.decode", {"pipeserve.plan_id": plan.step_id})
            if req.num_preemptions > rt.preemptions and rt.decode is not None:
                rt.preemptions = req.num_preemptions
                rt.decode.add_event("preempted", {"pipeserve.preemptions": req.num_preemptions})

    def completed(self, plan: StepPlan) -> None:
        for span in self.plan_spans.pop(plan.step_id, ()):
            span.end()

    # --- the engine loop's publication ------------------------------------------
    def published(self, req_id: str, outputs: int) -> None:
        """The request has `outputs` tokens out: an event at each doubling (bounded by log2 max_tokens)."""
        rt = self.requests.get(req_id)
        if rt is None or rt.decode is None or outputs < rt.next_mark:
            return
        rt.decode.add_event("tokens", {"pipeserve.output_tokens": outputs})
        while rt.next_mark <= outputs:
            rt.next_mark *= 2

    def finished(self, req_id: str, finish_reason: str | None, error: str | None) -> None:
        """The request got its final delta: close its spans with the finish span."""
        rt = self.requests.pop(req_id, None)
        if rt is None:
            return
        now = time.time_ns()
        if rt.queue.is_recording():
            rt.queue.end(now)  # never scheduled (aborted, the group stopped)
        req = rt.req
        attrs: dict[str, AttributeValue] = {"pipeserve.stage": self.rank}
        if finish_reason is not None:
            attrs["gen_ai.response.finish_reasons"] = [finish_reason]
        if error is not None:
            attrs["error.type"] = "request_failed"
            attrs["pipeserve.error"] = error[:300]
        outputs = len(req.output_token_ids) if req is not None else 0
        if req is not None:
            attrs["gen_ai.usage.input_tokens"] = len(req.prompt_token_ids)
            attrs["gen_ai.usage.output_tokens"] = outputs
            attrs["pipeserve.cached_tokens"] = req.num_cached_prompt_tokens
            for tier, n in req.cached_by_tier.items():
                attrs[f"pipeserve.cached_tokens.{tier}"] = n
            attrs["pipeserve.preemptions"] = req.num_preemptions
        if rt.decode is not None:
            rt.decode.set_attribute("gen_ai.usage.output_tokens", outputs)
            rt.decode.end(now)
        rt.child("pipeserve.finish", attrs).end()


def generate_interceptor() -> grpc.aio.ServerInterceptor:
    """opentelemetry-instrumentation-grpc's aio server interceptor, for Generate only: it extracts the
    caller's W3C context from the call's metadata and makes the call's server span. Health and Load
    are polled all the time and get no span."""
    from opentelemetry.instrumentation.grpc import aio_server_interceptor, filters

    return aio_server_interceptor(filter_=filters.method_name("Generate"))
