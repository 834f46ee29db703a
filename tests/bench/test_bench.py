"""`pipeserve bench`: workloads, metrics, and the client against small real servers.

The servers here are test stand-ins started on free 127.0.0.1 ports: an OpenAI-shaped
streaming app (starlette under uvicorn, in a thread) whose sleeps are known, so TTFT / ITL /
E2E can be checked within tolerance, and a gRPC `Generation` service speaking the real
generated stubs for the router-overhead mode. Every wait has a timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from pipeserve.bench import client, metrics, workloads
from pipeserve.bench.metrics import RequestResult
from pipeserve.bench.serving import add_bench_parser, run_bench
from pipeserve.bench.workloads import BenchRequest
from pipeserve.rpc import generation_pb2 as pb
from pipeserve.rpc import generation_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(120)


# --- test servers -----------------------------------------------------------------------


def openai_app(ttft=0.0, itl=0.0, fail_every=0, error_every=0, usage=True, delay=0.0):
    """Streams max_tokens chunks of text "t": an empty first chunk, `ttft` s, then `itl` s apart.

    Every `fail_every`-th request answers HTTP 500; every `error_every`-th streams one token
    and then an error event. Non-streaming requests answer after `delay` s.
    """
    state = {"bodies": [], "auth": [], "count": 0, "inflight": 0, "max_inflight": 0}

    def event(obj) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    def chunk(text: str) -> str:
        return event({"object": "text_completion", "choices": [{"index": 0, "text": text}]})

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "test-model", "object": "model"}]})

    async def completions(request: Request):
        body = await request.json()
        state["bodies"].append(body)
        state["auth"].append(request.headers.get("authorization"))
        state["count"] += 1
        n = state["count"]
        if fail_every and n % fail_every == 0:
            return JSONResponse({"error": {"message": "overloaded"}}, status_code=500)
        if not body.get("stream"):
            await asyncio.sleep(delay)
            return JSONResponse({"choices": [{"index": 0, "text": "t", "finish_reason": "length"}]})

        async def gen():
            state["inflight"] += 1
            state["max_inflight"] = max(state["max_inflight"], state["inflight"])
            try:
                yield chunk("")  # role/empty chunk: not a token, must not end TTFT
                await asyncio.sleep(ttft)
                for i in range(body["max_tokens"]):
                    if i:
                        await asyncio.sleep(itl)
                    if error_every and n % error_every == 0 and i == 1:
                        yield event({"error": {"message": "boom"}})
                        return
                    yield chunk("t")
                if usage:
                    u = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"]}
                    yield event({"object": "text_completion", "choices": [], "usage": u})
                yield "data: [DONE]\n\n"
            finally:
                state["inflight"] -= 1

        return StreamingResponse(gen(), media_type="text/event-stream")

    routes = [Route("/v1/models", models), Route("/v1/completions", completions, methods=["POST"])]
    app = Starlette(routes=routes)
    return app, state


class Served:
    """Runs an ASGI app under uvicorn in a thread on a free 127.0.0.1 port."""

    def __init__(self, app) -> None:
        # Port 0, bound by uvicorn: a socket bound here (socket.socket(), proto 0) would make asyncio
        # skip TCP_NODELAY on accepted connections, adding ~40 ms (Nagle + delayed ACK) per response.
        config = uvicorn.Config(
            app, host="127.0.0.1", port=0, log_level="warning", lifespan="off", timeout_graceful_shutdown=2
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = ""

    def __enter__(self) -> Served:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "test server did not start"
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        assert not self.thread.is_alive(), "test server did not stop"


def bench(url, requests, concurrency=4, arrivals=None, timeout_s=30.0, api_key=None):
    async def go():
        async with client.make_client(url, concurrency, timeout_s, api_key) as http:
            offsets = arrivals or [0.0] * len(requests)
            return await client.run_requests(http, "test-model", requests, offsets, concurrency, timeout_s)

    return asyncio.run(go())


def bench_cli(argv: list[str]) -> int:
    """`pipeserve bench ...` through the subcommand's own parser (independent of the rest of the CLI)."""
    parser = argparse.ArgumentParser(prog="pipeserve")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def fixed(n: int, prompt_len: int = 8, output_len: int = 4) -> list[BenchRequest]:
    return workloads.random_workload(n, prompt_len, output_len, 0.0, 256, seed=1)


# --- workloads --------------------------------------------------------------------------


def test_random_workload_lengths_in_bounds_and_deterministic():
    reqs = workloads.random_workload(500, 128, 64, 0.5, 300, seed=7)
    in_lens = [r.prompt_len for r in reqs]
    out_lens = [r.output_len for r in reqs]
    assert min(in_lens) >= 64 and max(in_lens) <= 128
    assert min(out_lens) >= 32 and max(out_lens) <= 64
    assert len(set(in_lens)) > 30  # really drawn, not constant
    ids = [t for r in reqs for t in r.prompt]
    assert min(ids) >= workloads.DEFAULT_MIN_TOKEN_ID and max(ids) < 300
    assert reqs == workloads.random_workload(500, 128, 64, 0.5, 300, seed=7)
    assert reqs != workloads.random_workload(500, 128, 64, 0.5, 300, seed=8)
    # range_ratio 0: every length is exactly the requested one
    exact = workloads.random_workload(20, 16, 5, 0.0, 256, 0)
    assert {(r.prompt_len, r.output_len) for r in exact} == {(16, 5)}


def test_shared_prefix_requests_share_their_prefix():
    reqs = workloads.shared_prefix_workload(12, 32, 8, 0.5, 256, seed=3, shared_prefix_len=40, num_prefixes=3)
    prefixes = [tuple(r.prompt[:40]) for r in reqs]
    assert len(set(prefixes)) == 3
    for k, p in enumerate(prefixes):
        assert p == prefixes[k % 3]  # round robin
    assert all(40 + 16 <= r.prompt_len <= 40 + 32 for r in reqs)
    assert len({tuple(r.prompt) for r in reqs}) == 12  # suffixes keep prompts distinct
    assert reqs == workloads.shared_prefix_workload(12, 32, 8, 0.5, 256, 3, 40, 3)


def test_arrival_offsets_are_poisson_and_seeded():
    assert workloads.arrival_offsets(5, math.inf, 0) == [0.0] * 5
    a = workloads.arrival_offsets(4000, 50.0, 0)
    assert a == workloads.arrival_offsets(4000, 50.0, 0)
    assert a[0] == 0.0 and all(x <= y for x, y in itertools.pairwise(a))
    assert np.mean(np.diff(a)) == pytest.approx(1 / 50, rel=0.1)


def test_vocab_size_from_model_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 1024}))
    assert workloads.resolve_vocab_size(None, str(tmp_path)) == 1024
    assert workloads.resolve_vocab_size(500, str(tmp_path)) == 500
    assert workloads.resolve_vocab_size(None, None) == 256
    with pytest.raises(ValueError, match="vocab_size"):
        workloads.resolve_vocab_size(None, str(tmp_path / "missing"))


# --- metrics ----------------------------------------------------------------------------


def test_percentiles_on_known_values():
    s = metrics.stats_ms([i / 1000 for i in range(1, 101)])  # 1..100 ms
    # numpy's linear interpolation: p50 = (50 + 51) / 2, p90 = 90 + 0.1, p99 = 99 + 0.01
    assert s == pytest.approx({"mean": 50.5, "p50": 50.5, "p90": 90.1, "p99": 99.01})
    assert metrics.stats_ms([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_summary_on_known_results():
    results = [
        RequestResult(True, prompt_len=10, output_len=5, ttft=0.1, latency=0.5, itl=[0.1] * 4),
        RequestResult(True, prompt_len=20, output_len=3, ttft=0.2, latency=1.0, itl=[0.4, 0.4]),
        RequestResult(False, prompt_len=30, error="HTTP 500: x"),
    ]
    s = metrics.summarize(results, duration_s=2.0)
    assert (s["completed"], s["failed"]) == (2, 1)
    assert s["total_input_tokens"] == 30 and s["total_output_tokens"] == 8
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["input_throughput"] == pytest.approx(15.0)
    assert s["output_throughput"] == pytest.approx(4.0)
    assert s["total_throughput"] == pytest.approx(19.0)
    assert s["concurrency"] == pytest.approx(0.75)  # (0.5 + 1.0) / 2
    assert s["ttft_ms"]["mean"] == pytest.approx(150.0)
    assert s["itl_ms"]["p50"] == pytest.approx(100.0)  # pooled: four 0.1 s and two 0.4 s
    assert s["tpot_ms"]["mean"] == pytest.approx((100.0 + 400.0) / 2)  # (0.5-0.1)/4, (1.0-0.2)/2
    assert s["e2e_ms"]["p99"] == pytest.approx(995.0)
    assert s["errors"] == {"HTTP 500: x": 1}
    table = metrics.format_table(s, {"Model": "m"})
    assert "Failed requests:" in table and "Median TTFT (ms):" in table and "HTTP 500" in table


def test_sse_parser():
    p = client.SSEParser()
    lines = [": keep-alive", 'data: {"a": 1}', "", "event: x", "data: line1", "data:line2", ""]
    lines.append("data: [DONE]")
    out = [d for line in lines if (d := p.feed(line)) is not None]
    assert out == ['{"a": 1}', "line1\nline2"]
    assert p.flush() == "[DONE]"  # a last event without its blank line still counts
    assert p.flush() is None


# --- against a real HTTP server ---------------------------------------------------------


def test_streaming_timings_and_request_shape():
    ttft, itl, n_out = 0.15, 0.04, 5
    app, state = openai_app(ttft=ttft, itl=itl)
    reqs = fixed(4, prompt_len=8, output_len=n_out)
    with Served(app) as srv:
        results, duration = bench(srv.url, reqs, concurrency=2, api_key="sk-test")
    assert all(r.success for r in results), [r.error for r in results]
    for r in results:
        assert r.output_len == n_out and r.prompt_len == 8
        assert ttft <= r.ttft < ttft + 0.1
        assert len(r.itl) == n_out - 1
        assert all(g >= itl * 0.9 for g in r.itl)  # sleeps are lower bounds; a loaded box only adds
        assert np.mean(r.itl) < itl + 0.04
        assert ttft + (n_out - 1) * itl * 0.9 <= r.latency < ttft + (n_out - 1) * itl + 0.2
    # two at a time: two waves
    assert state["max_inflight"] == 2
    assert duration >= 2 * (ttft + (n_out - 1) * itl) * 0.95
    body = state["bodies"][0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["temperature"] == 0 and body["model"] == "test-model"
    assert sorted(b["max_tokens"] for b in state["bodies"]) == [n_out] * 4
    assert sorted(map(tuple, (b["prompt"] for b in state["bodies"]))) == sorted(tuple(r.prompt) for r in reqs)
    assert state["auth"] == ["Bearer sk-test"] * 4


def test_output_tokens_counted_from_chunks_without_usage():
    app, _ = openai_app(usage=False)
    with Served(app) as srv:
        results, _ = bench(srv.url, fixed(3, output_len=7))
    assert [r.output_len for r in results] == [7, 7, 7]
    assert all(r.success for r in results)


def test_failures_are_counted_not_fatal():
    app, state = openai_app(fail_every=3, error_every=4)
    with Served(app) as srv:
        results, duration = bench(srv.url, fixed(12, output_len=3), concurrency=3)
    s = metrics.summarize(results, duration)
    # requests 3, 6, 9, 12 answer 500; 4 and 8 break mid-stream (12 already failed)
    assert state["count"] == 12
    assert (s["completed"], s["failed"]) == (6, 6)
    assert s["errors"] == {'HTTP 500: {"error":{"message":"overloaded"}}': 4, "stream error: boom": 2}
    assert s["total_output_tokens"] == 6 * 3


def test_request_timeout_is_a_failure():
    app, _ = openai_app(ttft=5.0)
    with Served(app) as srv:
        results, duration = bench(srv.url, fixed(2), timeout_s=0.3)
    assert duration < 3
    assert [r.success for r in results] == [False, False]
    assert all(r.error == "TimeoutError" for r in results)


def test_request_rate_spaces_arrivals():
    app, _ = openai_app()
    arrivals = workloads.arrival_offsets(6, 20.0, seed=0)
    with Served(app) as srv:
        results, duration = bench(srv.url, fixed(6), concurrency=6, arrivals=arrivals)
    assert all(r.success for r in results)
    assert duration >= arrivals[-1]


def test_cli_bench_writes_json_and_markdown(tmp_path, capsys):
    app, state = openai_app(ttft=0.02, itl=0.005)
    out_json, out_md = tmp_path / "r.json", tmp_path / "RESULTS.md"
    out_md.write_text("# Benchmark results\n")
    with Served(app) as srv:
        argv = ["bench", "--url", srv.url, "--workload", "shared-prefix", "--num-requests", "6"]
        argv += ["--concurrency", "3", "--input-len", "8", "--output-len", "4", "--shared-prefix-len", "16"]
        argv += ["--num-prefixes", "2", "--api-key", "secret", "--label", "unit test", "--warmup", "2"]
        argv += ["--json", str(out_json), "--results-md", str(out_md)]
        assert bench_cli(argv) == 0
    assert state["count"] == 8  # 2 warmup + 6 timed
    assert all(b["max_tokens"] <= 4 for b in state["bodies"][:2])
    doc = json.loads(out_json.read_text())
    assert doc["label"] == "unit test" and doc["model"] == "test-model"
    assert doc["args"]["api_key"] == "***" and doc["args"]["request_rate"] is None
    assert doc["results"]["completed"] == 6 and doc["results"]["failed"] == 0
    assert doc["results"]["total_input_tokens"] == sum(len(b["prompt"]) for b in state["bodies"][2:])
    assert doc["results"]["ttft_ms"]["p50"] >= 20 and doc["router_overhead"] is None
    md = out_md.read_text()
    assert md.startswith("# Benchmark results\n")  # appended, not overwritten
    assert "## Serving benchmark: unit test" in md and "| Successful requests | 6 |" in md
    assert "| TTFT |" in md and "secret" not in md
    assert "--workload shared-prefix" in md and "--label 'unit test'" in md
    stdout = capsys.readouterr().out
    assert "Serving Benchmark Result" in stdout and "Output token throughput (tok/s):" in stdout


def test_cli_bench_unreachable_server_fails_cleanly(capsys):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    assert bench_cli(["bench", "--url", url, "--num-requests", "2", "--timeout-s", "5"]) == 1
    assert "cannot benchmark" in capsys.readouterr().err


# --- router overhead --------------------------------------------------------------------


class Stage0(pb_grpc.GenerationServicer):
    def __init__(self) -> None:
        self.requests: list[pb.GenerateRequest] = []

    def Generate(self, request, context):
        self.requests.append(request)
        n = len(request.prompt_token_ids)
        yield pb.GenerateResponse(token_ids=[5], finish_reason="length", prompt_tokens=n)


def test_router_overhead_mode(tmp_path, capsys):
    stage0 = Stage0()
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_GenerationServicer_to_server(stage0, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    added = 0.02  # the stand-in router's own latency
    app, state = openai_app(delay=added)
    out_json, out_md = tmp_path / "o.json", tmp_path / "o.md"
    try:
        with Served(app) as srv:
            argv = ["bench", "--router-overhead", "--url", srv.url, "--grpc", f"127.0.0.1:{port}"]
            argv += ["--num-requests", "10", "--warmup", "1", "--json", str(out_json)]
            assert bench_cli([*argv, "--results-md", str(out_md)]) == 0
    finally:
        server.stop(grace=None).wait(timeout=5)
    assert len(stage0.requests) == 11 and state["count"] == 11
    assert len({r.request_id for r in stage0.requests}) == 11  # unique per call
    sp = stage0.requests[0].sampling
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.top_k) == (1, 0.0, 1.0, -1)
    body = state["bodies"][0]
    assert body["max_tokens"] == 1 and body["temperature"] == 0 and not body.get("stream")
    assert body["prompt"] == list(stage0.requests[0].prompt_token_ids)
    o = json.loads(out_json.read_text())["router_overhead"]
    assert o["router"]["ok"] == 10 and o["direct"]["ok"] == 10
    # Wide bounds: both series share the machine with whatever else runs on it.
    assert added * 1000 * 0.5 <= o["overhead_p50_ms"] < added * 1000 + 50
    md = out_md.read_text()
    assert "Router overhead (p50 difference)" in md and "--router-overhead" in md and "--workload" not in md
    assert "Router overhead p50 (ms):" in capsys.readouterr().out


def test_pipeserve_cli_has_bench():
    from pipeserve.cli import build_parser

    args = build_parser().parse_args(["bench", "--url", "http://h:1", "--concurrency", "3"])
    assert args.func is run_bench and args.concurrency == 3 and math.isinf(args.request_rate)
