"""Stage 0's request timing: the engine families' latency histograms (docs/metrics.md).

The EngineLoop calls three hooks, all on its own thread, none per token:
  step_started()          once per engine step, before it: the time a request scheduled in this
                          step left the queue (scheduling happens at the start of the step)
  seen(times, req)        once per open request per step: stamps its first scheduling
  delta(times, req, ...)  once per delta pushed to the request's sink (a step's new tokens,
                          or its finish)
Each costs a few float operations and at most a bisect into a bucket list. The histograms are
read at scrape time by the side port (`metrics()`), from another thread: a scrape sees a slightly
stale but well-formed copy (pipeserve.histogram.Histogram's contract).

What is measured (all on stage 0's monotonic clock, from `Request.arrival`, the moment the engine
loop applied the submit):
  queue time      arrival -> first scheduled (requests ended before that are not observed)
  TTFT            arrival -> the first delta with tokens
  inter-token     between two deltas with tokens (a delta of k tokens counts once, as vLLM's v1)
  prefill time    first scheduled -> first token
  decode time     first token -> last token (finished requests)
  TPOT            decode time / (output tokens - 1) (finished requests with 2 or more tokens)
  e2e             arrival -> finish (every finish reason, error included)
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from pipeserve.care.health import Metric
from pipeserve.engine.request import Request, RequestStatus
from pipeserve.histogram import Histogram
from pipeserve.obs.buckets import REQUEST_S, TOKEN_S

P = "pipeserve:"


@dataclass(slots=True)
class RequestTimes:
    """One open request's timestamps (monotonic seconds; None until it happens)."""

    scheduled: float | None = None
    first: float | None = None
    last: float | None = None


class RequestTimer:
    def __init__(self) -> None:
        self.queue = Histogram(REQUEST_S)
        self.ttft = Histogram(REQUEST_S)
        self.itl = Histogram(TOKEN_S)
        self.prefill = Histogram(REQUEST_S)
        self.decode = Histogram(REQUEST_S)
        self.tpot = Histogram(TOKEN_S)
        self.e2e = Histogram(REQUEST_S)
        self.prompt_tokens = 0  # counted when a request's prefill is done (its first token)
        self._step_t = 0.0

    def step_started(self) -> None:
        self._step_t = time.monotonic()

    def seen(self, t: RequestTimes, req: Request) -> None:
        if t.scheduled is None and req.status is not RequestStatus.WAITING:
            t.scheduled = self._step_t
            self.queue.observe(max(0.0, self._step_t - req.arrival))

    def delta(self, t: RequestTimes, req: Request, new_tokens: int, finished: bool) -> None:
        now = time.monotonic()
        if new_tokens:
            if t.first is None:
                t.first = now
                self.ttft.observe(now - req.arrival)
                self.prompt_tokens += len(req.prompt_token_ids)
                if t.scheduled is not None:
                    self.prefill.observe(now - t.scheduled)
            elif t.last is not None:
                self.itl.observe(now - t.last)
            t.last = now
        if finished:
            self.e2e.observe(now - req.arrival)
            if t.first is not None and t.last is not None:
                self.decode.observe(t.last - t.first)
                if (n := len(req.output_token_ids)) > 1:
                    self.tpot.observe((t.last - t.first) / (n - 1))

    def metrics(self) -> dict[str, Metric]:
        def hist(h: Histogram, help_: str) -> Metric:
            buckets, total = h.snapshot()
            return Metric("histogram", help_, total, buckets=buckets)

        return {
            P + "request_queue_time_seconds": hist(self.queue, "arrival at stage 0 -> first scheduled"),
            P + "time_to_first_token_seconds": hist(self.ttft, "arrival at stage 0 -> first token"),
            P + "inter_token_latency_seconds": hist(self.itl, "time between two steps' tokens of a request"),
            P + "request_prefill_time_seconds": hist(self.prefill, "first scheduled -> first token"),
            P + "request_decode_time_seconds": hist(self.decode, "first token -> last token"),
            P + "request_time_per_output_token_seconds": hist(
                self.tpot, "decode time / (output tokens - 1) of a finished request"
            ),
            P + "e2e_request_latency_seconds": hist(self.e2e, "arrival at stage 0 -> finish"),
            P + "prompt_tokens": Metric(
                "counter", "prompt tokens prefilled (counted at the first token)", self.prompt_tokens
            ),
        }
