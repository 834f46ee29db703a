"""A follower's plan spans for sampled requests (docs/observability.md, "Traces").

Stage 0 decides which requests are traced: a sampled request's first plan (and its resumption after
a preemption) carries its W3C traceparent in `StepPlan.traces`. The follower keeps the context per
request id until a plan frees the id, and for every plan it executes adds, per traced request in
the plan, one span `pipeserve.stage_plan` (pipeserve.plan_id, pipeserve.stage, the chunk's tokens)
parented to stage 0's span of that request, from the start of the plan's execution to its end. So
one trace shows the request crossing the ring.

Cost: a follower holds a PlanTraces only when its process exports traces; with nothing traced, one
truthiness check per plan.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from opentelemetry.context import Context

from pipeserve.engine.plan import StepPlan
from pipeserve.obs import tracing


@dataclass
class PlanTraces:
    rank: int
    contexts: dict[str, Context] = field(default_factory=dict)  # traced req id -> stage 0's span

    def before(self, plan: StepPlan) -> int | None:
        """Apply the plan's frees and traces (in the runner's order); the start time if it has a
        traced request, else None."""
        if self.contexts:
            for req_id in plan.freed:
                self.contexts.pop(req_id, None)
        if plan.traces:
            for req_id, traceparent in plan.traces.items():
                self.contexts[req_id] = tracing.extract({"traceparent": traceparent})
        if not self.contexts:
            return None
        return time.time_ns()

    def after(self, plan: StepPlan, start_ns: int) -> None:
        """The plan executed: its spans, from `start_ns` to now."""
        end = time.time_ns()
        tracer = tracing.tracer()
        for chunk in plan.chunks:
            ctx = self.contexts.get(chunk.req_id)
            if ctx is None:
                continue
            attributes = {
                "pipeserve.plan_id": plan.step_id,
                "pipeserve.stage": self.rank,
                "pipeserve.chunk.start_pos": chunk.start_pos,
                "pipeserve.chunk.tokens": len(chunk.token_ids),
            }
            span = tracer.start_span("pipeserve.stage_plan", ctx, attributes=attributes, start_time=start_ns)
            span.end(end)
