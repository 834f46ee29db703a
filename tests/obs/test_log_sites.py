"""The serving path's repeated log lines are rate-limited where they are logged: a flood of failing
requests or hostile connections to a real router (scripted stage 0 over real gRPC) logs O(1) lines."""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from router_support import RouterHarness, ScriptedStage

pytestmark = pytest.mark.timeout(120)
FLOOD = 12


@pytest.fixture
def stage() -> ScriptedStage:
    return ScriptedStage(list(range(10, 40)), vocab_size=1024, max_model_len=256)


@pytest.fixture
def router(llama_dir: Path, stage: ScriptedStage) -> Iterator[RouterHarness]:
    with RouterHarness(llama_dir, {"g0": stage}, served_model_name="demo", max_header_bytes=8192) as h:
        yield h


def lines(caplog: pytest.LogCaptureFixture, needle: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if needle in r.getMessage()]


def test_failing_requests_log_one_line_per_interval(router, stage, caplog):
    caplog.set_level(logging.INFO)
    stage.mode = "internal"  # every request fails before its first token: a 500 each
    body = {"model": "demo", "prompt": [5, 6, 7], "max_tokens": 2}
    with httpx.Client(timeout=30) as http:
        for _ in range(FLOOD):
            assert http.post(router.url + "/v1/completions", json=body).status_code == 500
    assert len(lines(caplog, "upstream error")) == 1, lines(caplog, "upstream error")
    (record,) = [r for r in caplog.records if "upstream error" in r.getMessage()]
    assert record.request_id.startswith("cmpl-")  # the request id rides along as a field


def test_oversized_headers_flood_logs_one_line(router, caplog):
    caplog.set_level(logging.INFO)
    host, port = router.url.removeprefix("http://").split(":")
    for _ in range(FLOOD):
        with socket.create_connection((host, int(port)), timeout=10) as s:
            try:
                s.sendall(b"GET /health HTTP/1.1\r\nX-big: " + b"a" * 20_000)  # unfinished, over the cap
                while s.recv(65536):
                    pass
            except (BrokenPipeError, ConnectionResetError):
                pass
    assert httpx.get(router.url + "/health", timeout=10).status_code == 200  # still serving
    assert len(lines(caplog, "431 to")) == 1, lines(caplog, "431 to")
