"""The router's Prometheus metrics, registered on a registry the caller passes in.

Nothing here touches prometheus_client's global default registry: the
supervisor renders one registry (router + its own group-restart metrics) at
/metrics, and tests build as many routers as they like, each on its own
registry. Every name starts with `pipeserve:router_` (docs/metrics.md lists them); the latency
histograms share their buckets with stage 0's (obs/buckets.py), so both views compare bucket by bucket.

`RequestMetrics` is an ASGI middleware counting responses by endpoint and
status. The endpoint label is the route's path template, or "other" for a
path no route matches, so a scan of random URLs cannot grow the label set.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pipeserve.obs.buckets import REQUEST_S, TOKEN_S

P = "pipeserve:router_"

_LATENCY = REQUEST_S
_ITL = TOKEN_S


class GroupMetrics:
    """Per-group gauges, set by the ReplicaSet poller."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(P + name, doc, ["group"], registry=registry)

        self.ready = gauge(
            "group_ready", "1 if the group's last Health said ready (and it is not marked down)"
        )
        self.running = gauge("group_running", "Requests running on the group (last Load)")
        self.waiting = gauge("group_waiting", "Requests waiting on the group (last Load)")
        self.kv_used = gauge("group_kv_blocks_used", "KV blocks in use on the group (last Load)")
        self.kv_total = gauge("group_kv_pool_blocks", "KV blocks of the group (last Load)")
        self.inflight = gauge("group_inflight", "Requests the router has in flight to the group")


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            P + "requests",
            "HTTP responses by endpoint and status code",
            ["endpoint", "status"],
            registry=registry,
        )
        self.in_flight = Gauge(
            P + "requests_in_flight", "Prompts in flight (a batch counts each)", registry=registry
        )
        self.ttft = Histogram(
            P + "time_to_first_token_seconds",
            "Request arrival to first token",
            buckets=_LATENCY,
            registry=registry,
        )
        self.itl = Histogram(
            P + "inter_token_latency_seconds", "Time between output tokens", buckets=_ITL, registry=registry
        )
        self.e2e = Histogram(
            P + "e2e_request_latency_seconds",
            "Request arrival to last token",
            buckets=_LATENCY,
            registry=registry,
        )
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens sent upstream", registry=registry)
        self.generation_tokens = Counter(
            P + "generation_tokens", "Output tokens returned to clients", registry=registry
        )
        self.retries = Counter(
            P + "retries", "Requests retried on another group before their first token", registry=registry
        )
        self.upstream_errors = Counter(
            P + "upstream_errors",
            "Failed Generate calls by group and gRPC code",
            ["group", "code"],
            registry=registry,
        )
        self.probes = Counter(
            P + "health_probes", "/health_generate probes by result", ["result"], registry=registry
        )


class RequestMetrics:
    """ASGI middleware: counts every HTTP response by (route template, status)."""

    def __init__(self, app: ASGIApp, metrics: RouterMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # an exception escaping the app before a response started

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            self.metrics.requests.labels(_endpoint(scope), str(status)).inc()


def _endpoint(scope: Scope) -> str:
    app = scope.get("app")
    for route in getattr(getattr(app, "router", None), "routes", ()):
        match, _ = route.matches(scope)
        if match != Match.NONE:  # PARTIAL: the path matched, the method did not (405)
            return getattr(route, "path", "other")
    return "other"
