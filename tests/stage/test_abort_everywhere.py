"""Work stops when its client is gone (issue 29, point 5): `pipeserve up` with a two-stage group.

A client disconnects while its prompt is being scored (prompt_logprobs over a long prompt, the
step pace set low so the scoring spans hundreds of steps): within 1 s of the disconnect, stage 0's
gauges show nothing running or waiting, no KV block held in its pool, and every stage's own count
of held blocks (reported along the ring) is 0. While the scoring runs it is visible in the gauges
(running 1), and an unrelated request is answered meanwhile (the scoring shares the steps).
"""

from __future__ import annotations

import json
import random
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest

from serving_support import UpProcess, metric, running_up, wait_until

pytestmark = pytest.mark.slow

PROMPT_LEN = 1800  # the demo model's context is 2048
GONE_WITHIN_S = 1.0


@pytest.fixture(scope="module")
def up(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    args = ("--model", str(llama_dir), "--stages", "2", "--num-threads", "1", "--num-kv-blocks", "512")
    # A 1 ms step target: the pace's floor (16 cost units a step) chunks the scoring of the prompt
    # into ~200 steps, so the disconnect lands while it runs however fast the machine is.
    with running_up(*args, "--step-target-ms", "1", log_dir=tmp_path_factory.mktemp("up")) as server:
        yield server


def gauges(up: UpProcess) -> dict[str, float | None]:
    stage0 = up.groups()[0]["health"][0]
    text = httpx.get(stage0 + "/metrics", timeout=2).text
    out = {
        name: metric(text, "pipeserve:" + name)
        for name in ("num_requests_running", "num_requests_waiting", "kv_blocks_used")
    }
    for rank in (0, 1):
        out[f"stage {rank} blocks"] = metric(text, "pipeserve:group_stage_blocks_held", stage=str(rank))
    return out


def open_and_hold(url: str, body: dict) -> socket.socket:
    """Send a completion request and leave its response unread: the caller closes the socket."""
    u = urlparse(url)
    payload = json.dumps(body).encode()
    sock = socket.create_connection((u.hostname, u.port), timeout=10)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {u.hostname}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    ).encode()
    sock.sendall(head + payload)
    return sock


def test_a_disconnect_mid_scoring_stops_the_work_on_every_stage(up: UpProcess) -> None:
    prompt = [random.Random(5).randrange(3, 1000) for _ in range(PROMPT_LEN)]
    body = {"prompt": prompt, "max_tokens": 1, "prompt_logprobs": 5, "temperature": 0}
    sock = open_and_hold(up.url, body)
    try:
        wait_until(lambda: gauges(up)["num_requests_running"] == 1, 30, "the scoring visible as running")
        # it shares the steps: an unrelated request is answered while the scoring runs
        r = httpx.post(up.url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2}, timeout=30)
        assert r.status_code == 200, r.text
        during = gauges(up)
        assert during["num_requests_running"] == 1 and (during["kv_blocks_used"] or 0) > 0, during
    finally:
        sock.close()
    gone = time.monotonic()
    last: dict = {}

    def stopped() -> bool:
        last.update(gauges(up))
        return all(v == 0 for v in last.values())

    wait_until(stopped, 10, "work stopped on every stage", interval_s=0.02)
    took = time.monotonic() - gone
    assert took <= GONE_WITHIN_S, f"work stopped {took:.2f}s after the disconnect: {last}"
    stage0 = httpx.get(up.groups()[0]["health"][0] + "/metrics", timeout=2).text
    aborted = metric(stage0, "pipeserve:request_success_total", finished_reason="abort")
    assert aborted == 1, "stage 0 aborted the request (it did not run to its end)"
    text = httpx.get(up.url + "/metrics", timeout=2).text
    closed = metric(text, "pipeserve:router_requests_total", endpoint="/v1/completions", status="499")
    assert closed == 1, "the router counted the disconnect (499)"
