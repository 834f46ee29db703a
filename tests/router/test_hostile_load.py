"""One client must not slow everyone: `pipeserve up` under hostile requests (slow; issue 9 section 2).

While a hostile request runs — the largest accepted stop-string configuration against a long
generation, a 15 MB prompt, 60 slowloris connections — `/health` answers in a median under 100 ms
(each within 1 s), and an ordinary request's latency stays within 2x of its value without the
hostile client (medians of a few repetitions). A hostile request that also costs the group compute
(a long generation) is compared with a benign twin doing the same compute, so the figure is the
hostile part's cost alone.
The router runs in its own process (`pipeserve up`, one live stage), so the test's client code does
not share its interpreter.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from pipeserve.detokenize import MAX_STOP_CHARS, MAX_STOP_STRINGS
from serving_support import UpProcess, running_up

pytestmark = pytest.mark.slow

# 32 tokens: the demo model decodes a token in ~1.5 ms on the native step, so 8 tokens (~14 ms) made
# the 2x bound a bound on milliseconds of scheduling noise rather than on the hostile client's cost.
ORDINARY = {"prompt": "The lighthouse keeper", "max_tokens": 32, "temperature": 0, "ignore_eos": True}
# /health while a hostile client runs: its median under 100 ms, and every answer within the 1 s a
# kubelet's probe waits by default (a 15 MB body holds the GIL while it is decoded, even in a worker
# thread, so a probe can wait for one decode on a busy 2-core machine; it must never wait for more).
HEALTH_MEDIAN_S = 0.1
HEALTH_MAX_S = 1.0


@pytest.fixture(scope="module")
def up(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    # One torch thread: the stage leaves a core to the router and the clients, so the figures show
    # what a hostile client costs the router, not the group's compute contention on 2 cores (a
    # benign long generation alone slows an ordinary request ~1.4x when the stage takes both cores).
    args = ("--model", str(llama_dir), "--num-kv-blocks", "512", "--num-threads", "1")
    with running_up(*args, log_dir=tmp_path_factory.mktemp("up")) as server:
        yield server


def ordinary_latency(client: httpx.Client, url: str, n: int = 15) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        r = client.post(url + "/v1/completions", json=ORDINARY, timeout=60)
        times.append(time.perf_counter() - t0)
        assert r.status_code == 200, r.text
    return statistics.median(times)


def health_times(url: str, n: int = 15, every_s: float = 0.1) -> list[float]:
    times = []
    with httpx.Client(timeout=10) as c:
        for _ in range(n):
            t0 = time.perf_counter()
            r = c.get(url + "/health")
            times.append(time.perf_counter() - t0)
            assert r.status_code == 200, r.text
            time.sleep(every_s)
    return times


# The hostile client runs in a process of its own: in a thread here it would hold this process's
# GIL (reading a long response, encoding 15 MB) and slow the measuring client, not the server.
POSTER = """
import sys, httpx
url, path, expect = sys.argv[1], sys.argv[2], int(sys.argv[3])
body = open(path, "rb").read()
with httpx.Client(timeout=300) as c:
    while True:
        r = c.post(url, content=body, headers={"content-type": "application/json"})
        assert r.status_code == expect, (r.status_code, r.text[:300])
"""
SLOWLORIS = """
import socket, sys, time
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
conns = [socket.create_connection((host, port), timeout=10) for _ in range(n)]
for s in conns:
    s.sendall(b"POST /v1/completions HTTP/1.1\\r\\nHost: x\\r\\n")
while True:
    time.sleep(0.5)
    for s in conns:
        try:
            s.sendall(b"X-slow: 1\\r\\n")
        except OSError:  # closed by the header deadline: the point
            pass
"""


# The 15 MB prompt's benign twin posts the same body to this sink, which reads it whole and answers
# 400 without parsing it: the client's own cost of sending 15 MB in a loop (a core's worth on this
# machine) is then on both sides of the comparison, and the figure is the router's cost alone.
SINK = """
import socket
srv = socket.create_server(("127.0.0.1", 0))
print(srv.getsockname()[1], flush=True)
while True:
    conn, _ = srv.accept()
    with conn, conn.makefile("rb") as f:
        while True:
            length = 0
            while (line := f.readline()) not in (b"\\r\\n", b""):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            if not line:
                break
            f.read(length)
            conn.sendall(b"HTTP/1.1 400 Bad Request\\r\\ncontent-length: 0\\r\\n\\r\\n")
"""


@contextmanager
def sink() -> Iterator[str]:
    """The URL of a SINK process, stopped afterwards."""
    proc = subprocess.Popen([sys.executable, "-c", SINK], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        yield f"http://127.0.0.1:{int(proc.stdout.readline())}/v1/completions"
    finally:
        proc.kill()
        proc.wait(30)


def latency_beside(client: httpx.Client, url: str, script: str, *args: str) -> tuple[float, list[float]]:
    """Ordinary latency and /health times while `script` (python -c ARGS) runs in a process of its own."""
    other = subprocess.Popen(
        [sys.executable, "-c", script, *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        time.sleep(1.0)  # its work is under way
        health = health_times(url)
        latency = ordinary_latency(client, url)
        assert other.poll() is None, f"the other client stopped: {other.stderr.read()[-2000:]}"
    finally:
        other.kill()
        other.wait(30)
        other.stderr.close()
    return latency, health


def under_load(up: UpProcess, script: str, *args: str, benign: tuple[str, ...] = ()) -> None:
    """Run the hostile `script` with ARGS; check the others' service against the `benign` ARGS (the
    same script doing the same compute harmlessly) or, with none, against no other client."""
    with httpx.Client() as client:
        ordinary_latency(client, up.url, 2)  # warm: connections, prefix cache
        if benign:
            base, _ = latency_beside(client, up.url, script, *benign)
        else:
            base = ordinary_latency(client, up.url)
        loaded, health = latency_beside(client, up.url, script, *args)
    print(
        f"ordinary request: {base * 1e3:.0f} ms {'beside the benign twin' if benign else 'alone'}, "
        f"{loaded * 1e3:.0f} ms beside the hostile client; "
        f"/health max {max(health) * 1e3:.0f} ms, median {statistics.median(health) * 1e3:.0f} ms"
    )
    assert statistics.median(health) < HEALTH_MEDIAN_S and max(health) < HEALTH_MAX_S, health
    assert loaded <= 2 * base, (loaded, base)


def test_largest_accepted_stop_strings_against_a_long_generation(up: UpProcess, tmp_path: Path) -> None:
    # Stop strings that keep matching long prefixes of the output (so text is held all along) but
    # never match whole: the worst case for a matcher that rescans.
    text = httpx.post(
        up.url + "/v1/completions",
        json={**ORDINARY, "max_tokens": 400, "ignore_eos": True},
        timeout=120,
    ).json()["choices"][0]["text"]
    each = MAX_STOP_CHARS // MAX_STOP_STRINGS
    stops = [(text[k : k + each - 1] + "\u2603").rjust(each, "\u2603") for k in range(MAX_STOP_STRINGS)]
    body, twin = tmp_path / "hostile.json", tmp_path / "benign.json"
    body.write_text(json.dumps({**ORDINARY, "max_tokens": 400, "ignore_eos": True, "stop": stops}))
    twin.write_text(json.dumps({**ORDINARY, "max_tokens": 400, "ignore_eos": True}))
    url = up.url + "/v1/completions"
    under_load(up, POSTER, url, str(body), "200", benign=(url, str(twin), "200"))


def test_a_15_mb_prompt(up: UpProcess, tmp_path: Path) -> None:
    body = tmp_path / "hostile.json"
    body.write_text(json.dumps({"prompt": "lighthouse " * (15 * 2**20 // 11), "max_tokens": 1}))
    with sink() as twin:  # the same 15 MB posted in a loop, to a server that only reads it
        url = up.url + "/v1/completions"
        under_load(up, POSTER, url, str(body), "400", benign=(twin, str(body), "400"))  # beyond the context


def test_60_slowloris_connections(up: UpProcess) -> None:
    host, port = up.url.removeprefix("http://").split(":")
    under_load(up, SLOWLORIS, host, port, "60")


def test_a_batch_of_2500_prompts_is_refused_and_the_largest_admitted_batch_is_served(up: UpProcess) -> None:
    """A batch opens one Generate call per prompt: admission counts prompts (max_concurrency, 256 by
    default, below stage 0's queue bound), so no batch can overflow stage 0 into 5xx answers."""
    r = httpx.post(up.url + "/v1/completions", json={"prompt": ["hi"] * 2500, "max_tokens": 1}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text[:300]
    body = {"prompt": [f"prompt {i}" for i in range(256)], "max_tokens": 2, "temperature": 0}
    r = httpx.post(up.url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text[:300]
    assert [c["index"] for c in r.json()["choices"]] == list(range(256))
