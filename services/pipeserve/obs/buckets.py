"""Histogram buckets for LLM latencies, shared by the router and the stages (docs/metrics.md).

One set per kind of interval, so that a router histogram and a stage histogram of the same
quantity can be compared bucket by bucket in one Grafana panel:
  REQUEST_S  a request-level interval (TTFT, queue, prefill, decode, end to end): 1 ms to ~10 min
  TOKEN_S    a per-token interval (inter-token latency, time per output token): 1 ms to 40 s
Bounds are floats so the exposition writes them as Prometheus does ("1.0", not "1").
"""

from __future__ import annotations

REQUEST_S: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
    10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0,
)  # fmt: skip
TOKEN_S: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3,
    0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0,
)  # fmt: skip
