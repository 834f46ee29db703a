"""Traces across real processes: `pipeserve up --stages 2` exporting to a file (PIPESERVE_TRACE_FILE,
inherited by the stage processes), one request carrying a client `traceparent`.

* one trace id from the router's server span through the gRPC client span, stage 0's server span and
  its request spans (queue, prefill chunk, decode, finish) to stage 1's plan spans, each parented
  right, the client's trace id and parent honoured; GenAI attributes on the router's request span;
  polled paths (/health, Health, Load) make no span;
* tracing off (no env): no SDK provider, no exporter thread; on: both (the check can fail);
* OTEL_EXPORTER_OTLP_ENDPOINT: spans reach a local OTLP receiver (what a collector gets);
* a plan without traces keeps its bytes (no `traces` key), one with traces round-trips.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from pipeserve.engine.plan import StepPlan, plan_digest
from pipeserve.ring.messages import Forward, decode_frame, encode_frame
from serving_support import running_up

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_PARENT = "00f067aa0ba902b7"
MAX_TOKENS = 6


def _one(spans: list[dict], **want: object) -> dict:
    found = [s for s in spans if all(s.get(k) == v for k, v in want.items())]
    assert len(found) == 1, (want, [(s["name"], s["kind"], s["service"]) for s in spans])
    return found[0]


@pytest.mark.slow
def test_one_trace_from_the_client_through_the_ring(llama_dir: Path, tmp_path: Path) -> None:
    spans_file = tmp_path / "spans.jsonl"
    env = {"PIPESERVE_TRACE_FILE": str(spans_file), "OTEL_BSP_SCHEDULE_DELAY": "200"}
    args = ("--model", str(llama_dir), "--stages", "2", "--num-kv-blocks", "256")
    with running_up(*args, log_dir=tmp_path / "up", env=env) as up:
        assert httpx.get(up.url + "/health", timeout=10).status_code == 200
        r = httpx.post(
            up.url + "/v1/completions",
            json={
                "model": str(llama_dir),
                "prompt": "The lighthouse keeper",
                "max_tokens": MAX_TOKENS,
                "temperature": 0.5,
                "ignore_eos": True,
            },
            headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_PARENT}-01"},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        body = r.json()
        # A streamed chat request without a traceparent: a trace of its own, usage set at the stream's end.
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "ignore_eos": True}
        with httpx.stream("POST", up.url + "/v1/chat/completions", json={**chat, "stream": True}) as sse:
            assert sse.status_code == 200 and "[DONE]" in sse.read().decode()
    # `up` has exited 0 after SIGTERM: every process flushed its spans on the way out.
    assert "ended span" not in up.log()  # every attribute was set while its span was open
    spans = [json.loads(line) for line in spans_file.read_text().splitlines()]
    assert not [s for s in spans if "health" in s["name"].lower() or "Load" in s["name"]]
    ours = [s for s in spans if s["trace_id"] == CLIENT_TRACE]
    assert {s["service"] for s in ours} == {"pipeserve-router", "pipeserve-stage"}

    # The router: the HTTP server span under the client's span, the gRPC client span under it.
    http = _one(ours, kind="SERVER", service="pipeserve-router")
    assert http["parent_id"] == CLIENT_PARENT
    a = http["attributes"]
    usage = body["usage"]
    assert a["gen_ai.request.model"] == str(llama_dir)
    assert a["gen_ai.request.max_tokens"] == MAX_TOKENS
    assert a["gen_ai.request.temperature"] == 0.5
    assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == MAX_TOKENS
    assert a["gen_ai.response.finish_reasons"] == [body["choices"][0]["finish_reason"]]
    assert a["pipeserve.group"] == ["group-0"] and a["pipeserve.retries"] == 0
    assert a["pipeserve.cached_tokens"] == 0
    call = _one(ours, kind="CLIENT", name="pipeserve.v1.Generation/Generate")
    assert call["parent_id"] == http["span_id"] and call["attributes"]["rpc.grpc.status_code"] == 0

    # Stage 0: the Generate server span (the official interceptor) under the client span.
    generate = _one(ours, kind="SERVER", service="pipeserve-stage")
    assert generate["parent_id"] == call["span_id"]
    assert generate["attributes"]["pipeserve.request_id"] == f"{body['id']}-0"
    under = [s for s in ours if s["parent_id"] == generate["span_id"]]
    queue = _one(under, name="pipeserve.queue")
    chunks = [s for s in under if s["name"] == "pipeserve.prefill_chunk"]
    decode = _one(under, name="pipeserve.decode")
    finish = _one(under, name="pipeserve.finish")
    assert chunks and all(c["start"] >= queue["end"] for c in chunks)
    assert decode["attributes"]["gen_ai.usage.output_tokens"] == MAX_TOKENS
    assert [e["name"] for e in decode["events"]] == ["tokens"] * len(decode["events"]) and decode["events"]
    f = finish["attributes"]
    assert f["gen_ai.response.finish_reasons"] == ["length"]
    assert (f["gen_ai.usage.input_tokens"], f["gen_ai.usage.output_tokens"]) == (
        usage["prompt_tokens"],
        MAX_TOKENS,
    )

    chat_http = _one(spans, kind="SERVER", name="POST /v1/chat/completions")
    assert chat_http["trace_id"] != CLIENT_TRACE and chat_http["parent_id"] is None
    assert chat_http["attributes"]["gen_ai.usage.output_tokens"] == 3
    assert chat_http["attributes"]["gen_ai.response.finish_reasons"] == ["length"]

    # Stage 1: a span per plan it executed for the request, parented to stage 0's span, the same plans.
    plans = [s for s in under if s["name"] == "pipeserve.stage_plan"]
    assert plans and {s["attributes"]["pipeserve.stage"] for s in plans} == {1}
    ids = {s["attributes"]["pipeserve.plan_id"] for s in plans}
    assert {c["attributes"]["pipeserve.plan_id"] for c in chunks} <= ids
    assert len(ids) == len(plans) >= 2  # the prefill plan and decode plans
    assert all(set(s) >= {"start", "end", "attributes", "events"} for s in ours)


def _threads_and_provider(env: dict[str, str]) -> tuple[list[str], str]:
    """In a fresh process with `env` (and none of the tracing variables of ours): setup_tracing, a span,
    then the thread names and the global provider."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_") and k != "PIPESERVE_TRACE_FILE"}
    code = (
        "import json, os, threading\n"
        "from opentelemetry import trace\n"
        "from pipeserve.obs.tracing import setup_tracing\n"
        "t = setup_tracing('probe')\n"
        "trace.get_tracer('x').start_span('s').end()\n"
        "names = [th.name for th in threading.enumerate()]\n"
        "print(json.dumps([names, type(trace.get_tracer_provider()).__name__]))\n"
        "t.shutdown(2.0)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    names, provider = json.loads(out.splitlines()[-1])
    return names, provider


def test_tracing_off_starts_no_exporter_thread(tmp_path: Path) -> None:
    names, provider = _threads_and_provider({})
    assert provider == "ProxyTracerProvider" and not [n for n in names if "Otel" in n], names
    # The same probe sees the thread and the SDK provider when tracing is on: it can fail.
    spans = tmp_path / "spans.jsonl"
    names, provider = _threads_and_provider({"PIPESERVE_TRACE_FILE": str(spans)})
    assert provider == "TracerProvider" and [n for n in names if n.startswith("OtelBatch")], names
    assert [json.loads(line)["name"] for line in spans.read_text().splitlines()] == ["s"]
    names, provider = _threads_and_provider({"PIPESERVE_TRACE_FILE": str(spans), "OTEL_SDK_DISABLED": "true"})
    assert provider == "ProxyTracerProvider"


class _Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """A local OTLP receiver: what a collector would be sent."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, str]] = []  # (service.name, span name)

    def Export(self, request, context):
        for rs in request.resource_spans:
            service = next(a.value.string_value for a in rs.resource.attributes if a.key == "service.name")
            self.spans += [(service, sp.name) for ss in rs.scope_spans for sp in ss.spans]
        return trace_service_pb2.ExportTraceServiceResponse()


def test_otlp_endpoint_exports_to_a_collector() -> None:
    receiver = _Receiver()
    server = grpc.server(ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        endpoint = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}", "OTEL_SERVICE_NAME": "svc"}
        names, provider = _threads_and_provider(endpoint)
    finally:
        server.stop(None)
    assert provider == "TracerProvider" and [n for n in names if n.startswith("OtelBatch")], names
    assert receiver.spans == [("svc", "s")]  # flushed by shutdown; OTEL_SERVICE_NAME wins


def test_plans_without_traces_keep_their_bytes() -> None:
    plain = StepPlan(7, ["a"], [], [])
    assert b"traces" not in encode_frame(Forward(plain, []))
    traced = StepPlan(7, ["a"], [], [], traces={"r": f"00-{CLIENT_TRACE}-{CLIENT_PARENT}-01"})
    assert decode_frame(encode_frame(Forward(traced, []))) == Forward(traced, [])
    assert plan_digest(traced) != plan_digest(plain)
