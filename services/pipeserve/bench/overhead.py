"""Router overhead: the latency the router adds to a request over calling stage 0 directly.

N sequential 1-token requests with the same short prompt go (a) through the router's
`/v1/completions` (non-streaming) and (b) straight to stage 0's gRPC `Generation.Generate`,
interleaved a, b, a, b, ... so that drift (other load, clock changes, cache state) touches
both series alike. The same prompt every time means both paths hit stage 0's prefix cache
the same way, so the difference of the medians is the router's own cost: HTTP parsing,
validation, routing, the gRPC hop and response formatting. The project's goal is <= 2 ms.
Both clients keep one connection open for the whole run, so no handshake is measured.
"""

from __future__ import annotations

import time
import uuid

import grpc
import httpx

from pipeserve.bench.metrics import stats_ms
from pipeserve.rpc import generation_pb2 as pb
from pipeserve.rpc import generation_pb2_grpc as pb_grpc

GOAL_MS = 2.0
# A fixed short prompt: ids >= 3 avoid the demo model's special tokens and < 256 fit any vocab.
PROMPT_IDS = list(range(10, 26))


class _Side:
    def __init__(self) -> None:
        self.times: list[float] = []
        self.failed = 0
        self.errors: list[str] = []

    def record(self, start: float, error: str | None) -> None:
        if error is None:
            self.times.append(time.perf_counter() - start)
        else:
            self.failed += 1
            if len(self.errors) < 3:  # a few samples say why; thousands would drown the report
                self.errors.append(error)

    def summary(self) -> dict:
        return {"ok": len(self.times), "failed": self.failed, **stats_ms(self.times), "errors": self.errors}


def _via_router(http: httpx.Client, model: str, timeout_s: float) -> str | None:
    body = {"model": model, "prompt": PROMPT_IDS, "max_tokens": 1, "temperature": 0}
    try:
        resp = http.post("/v1/completions", json=body, timeout=timeout_s)
        if resp.status_code != 200:
            return f"HTTP {resp.status_code}: {resp.text[:200]}"
        if not resp.json().get("choices"):
            return "response without choices"
    except (httpx.HTTPError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def _direct(stub: pb_grpc.GenerationStub, timeout_s: float) -> str | None:
    request = pb.GenerateRequest(
        request_id=f"bench-overhead-{uuid.uuid4().hex}",  # unique per live request on the group
        prompt_token_ids=PROMPT_IDS,
        sampling=pb.SamplingParams(max_tokens=1, temperature=0.0, top_p=1.0, top_k=-1),
    )
    try:
        finish = ""
        for msg in stub.Generate(request, timeout=timeout_s):
            finish = msg.finish_reason or finish
        if not finish:
            return "stream ended without finish_reason"
    except grpc.RpcError as e:
        return f"gRPC {e.code().name}: {e.details()}"
    return None


def measure_router_overhead(
    url: str,
    grpc_target: str,
    model: str,
    num_requests: int,
    warmup: int,
    timeout_s: float,
    api_key: str | None = None,
) -> dict:
    """Runs `warmup` untimed pairs, then `num_requests` timed pairs; returns the summary."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    router, direct = _Side(), _Side()
    with (
        httpx.Client(base_url=url.rstrip("/"), headers=headers, trust_env=False) as http,
        grpc.insecure_channel(grpc_target) as channel,
    ):
        try:
            grpc.channel_ready_future(channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError as e:
            raise ConnectionError(f"gRPC {grpc_target} not reachable within {timeout_s:g}s") from e
        stub = pb_grpc.GenerationStub(channel)
        for _ in range(warmup):
            _via_router(http, model, timeout_s)
            _direct(stub, timeout_s)
        for _ in range(num_requests):
            start = time.perf_counter()
            router.record(start, _via_router(http, model, timeout_s))
            start = time.perf_counter()
            direct.record(start, _direct(stub, timeout_s))
    r, d = router.summary(), direct.summary()
    diff = None if r["p50"] is None or d["p50"] is None else r["p50"] - d["p50"]
    return {
        "num_requests": num_requests,
        "prompt_len": len(PROMPT_IDS),
        "router": r,
        "direct": d,
        "overhead_p50_ms": diff,
        "goal_ms": GOAL_MS,
    }


def format_overhead(o: dict) -> str:
    width = 50
    lines = [" Router Overhead ".center(width, "=")]
    for key, name in (("router", "Router HTTP"), ("direct", "Stage 0 gRPC")):
        s = o[key]
        lines.append(f"{name + ' ok/failed:':<40} {s['ok']}/{s['failed']}")
        for stat in ("mean", "p50", "p90", "p99"):
            v = s[stat]
            lines.append(f"{f'{name} {stat} (ms):':<40} {'n/a' if v is None else f'{v:.3f}'}")
        lines += [f"{name + ' error:':<40} {e}" for e in s["errors"]]
    diff = o["overhead_p50_ms"]
    lines.append(f"{'Router overhead p50 (ms):':<40} {'n/a' if diff is None else f'{diff:.3f}'}")
    lines.append(f"{'Goal (ms):':<40} <= {o['goal_ms']:g}")
    lines.append("=" * width)
    return "\n".join(lines)
