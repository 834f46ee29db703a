"""A stage's side port: /livez, /readyz, /metrics (what kubelet and Prometheus call).

  /livez   200 unless the wedge detector declared a wedge (then 503 with the
           report); answers from the moment the process starts, loading included
  /readyz  200 only once the whole ring is formed and warmed up (stage 0: and
           its request server is accepting); 503 while loading, joining,
           draining or stopped
  /metrics Prometheus text: the stage's gauges and counters, read live at
           scrape time from the objects that own them (no polling thread)

The app runs on uvicorn in a daemon thread with its own event loop, so it
answers while the stage's main thread computes or blocks on the ring.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pipeserve.care.wedge import WedgeDetector
from pipeserve.lifecycle import ProcessPhase

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Metric:
    """One metric read at scrape time: a single value, or `values` keyed by the `label`'s values,
    or (kind "histogram") a Histogram's cumulative `buckets` and `value` as its sum."""

    kind: str  # "gauge", "counter" or "histogram"
    help: str
    value: float = 0.0
    label: str = ""
    values: dict[str, float] = field(default_factory=dict)
    buckets: list[tuple[str, float]] = field(default_factory=list)


@dataclass
class StageStatus:
    """What the side port reports; the stage's threads update `phase`, the rest is read live."""

    rank: int
    world_size: int
    phase: ProcessPhase = ProcessPhase.LOADING
    detector: WedgeDetector | None = None
    # Stage 0: whether its engine loop accepts requests (not after a group stop or while draining).
    serving: Callable[[], bool] | None = None
    # Extra metrics, read at scrape time: name -> Metric.
    sources: list[Callable[[], dict[str, Metric]]] = field(default_factory=list)

    @property
    def ready(self) -> bool:
        """What /readyz and stage 0's Health both answer."""
        return (
            self.phase is ProcessPhase.READY and not self.wedged and (self.serving is None or self.serving())
        )

    @property
    def wedged(self) -> bool:
        return self.detector is not None and self.detector.wedged


class _StageCollector(Collector):
    def __init__(self, status: StageStatus) -> None:
        self.status = status

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily]:
        s = self.status
        labels = ["rank"]
        rank = [str(s.rank)]
        for name, help_, value in (
            ("pipeserve:stage_ready", "1 when the ring is formed and the stage serves", float(s.ready)),
            ("pipeserve:stage_wedged", "1 once the wedge detector fired", float(s.wedged)),
        ):
            g = GaugeMetricFamily(name, help_, labels=labels)
            g.add_metric(rank, value)
            yield g
        for source in s.sources:
            for name, m in source().items():
                if m.kind == "histogram":
                    h = HistogramMetricFamily(name, m.help, labels=labels)
                    h.add_metric(rank, m.buckets, m.value)
                    yield h
                    continue
                family = CounterMetricFamily if m.kind == "counter" else GaugeMetricFamily
                if m.label:
                    fam = family(name, m.help, labels=[*labels, m.label])
                    for key, v in m.values.items():
                        fam.add_metric([*rank, key], v)
                else:
                    fam = family(name, m.help, labels=labels)
                    fam.add_metric(rank, m.value)
                yield fam


def build_health_app(status: StageStatus) -> Starlette:
    """/livez, /readyz, /metrics. Starlette rather than FastAPI: the side port needs no schema,
    and FastAPI's import (~0.4 s) would sit on every stage's start-up path."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_StageCollector(status))

    def livez(_: Request) -> JSONResponse:
        det = status.detector
        if det is not None and det.wedged:
            return JSONResponse({"status": "wedged", "report": det.report}, status_code=503)
        return JSONResponse({"status": "ok", "phase": status.phase})

    def readyz(_: Request) -> JSONResponse:
        code = 200 if status.ready else 503
        return JSONResponse({"ready": status.ready, "phase": status.phase}, status_code=code)

    def metrics(_: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return Starlette(
        routes=[
            Route("/livez", livez, methods=["GET"]),
            Route("/readyz", readyz, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ]
    )


class SidePort:
    """The health app on uvicorn in a daemon thread; `stop()` ends it within a deadline."""

    def __init__(self, status: StageStatus, host: str, port: int) -> None:
        config = uvicorn.Config(
            build_health_app(status),
            host=host,
            port=port,
            log_level="warning",
            access_log=False,
            log_config=None,  # its lines go through the process's handler (obs/logs.py: text|json)
        )
        self.server = uvicorn.Server(config)
        self.address = f"{host}:{port}"
        self._thread = threading.Thread(target=self.server.run, name="side-port", daemon=True)

    def start(self) -> None:
        self._thread.start()
        log.info("side port http://%s (/livez /readyz /metrics)", self.address)

    def stop(self, timeout_s: float = 2.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout_s)
