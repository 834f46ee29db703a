"""The HTTP edge against hostile input: stop strings, bodies, headers, auth, batches, shutdown.

Each test pins one rule of the router's edge (issue 9 §2) against a real router (uvicorn, real HTTP)
over real gRPC (scripted stages, tests/router_support.py) or live stage processes where a group's
own behaviour matters; the load tests (does one client slow the others?) are in test_hostile_load.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry

from pipeserve.config import EngineConfig, StageServeConfig, SupervisorConfig
from pipeserve.detokenize import MAX_STOP_CHARS, MAX_STOP_STRINGS, TextStream, held_suffix
from pipeserve.errors import InvalidRequestError
from pipeserve.sampling_params import SamplingParams
from pipeserve.supervisor.group import GroupSlot
from pipeserve.supervisor.supervisor import Supervisor, SupervisorThread
from router_support import RouterHarness, ScriptedStage
from serving_support import UpProcess, metric, wait_until


def chars(ids: list[int]) -> str:
    return "".join(map(chr, ids))


def test_stop_matcher_agrees_with_the_plain_definition() -> None:
    """Every release and every cut equals what the reference held_suffix / find would give."""
    rng = random.Random(3)
    for _ in range(300):
        n = rng.randint(1, 5)
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 6))) for _ in range(n)]
        text = [ord(rng.choice("abcd")) for _ in range(rng.randint(0, 40))]
        ts = TextStream(chars, stops)
        out = ""
        for k, t in enumerate(text):
            out += ts.push(t)
            if ts.stopped:
                break
            assert len(out) == k + 1 - held_suffix(chars(text[: k + 1]), stops), (stops, text[: k + 1])
        out += ts.finish()
        full = chars(text)
        # The token (here: character) that first completes a stop string ends the stream; the text is
        # cut where the earliest-starting stop string ending in that token starts.
        ends = (e for e in range(1, len(full) + 1) if any(full[:e].endswith(s) for s in stops))
        end = next(ends, None)
        hits = [end - len(s) for s in stops if end is not None and full[:end].endswith(s)]
        assert out == (full[: min(hits)] if hits else full), (stops, full)
        assert ts.stopped == bool(hits)


def test_stop_matching_work_is_linear_in_the_text() -> None:
    """The largest accepted stop configuration: transitions per character stay bounded (no rescans)."""
    rng = random.Random(0)
    each = MAX_STOP_CHARS // MAX_STOP_STRINGS
    stops = ["".join(rng.choice("ab") for _ in range(each - 1)) + "z" for _ in range(MAX_STOP_STRINGS)]
    SamplingParams(stop=stops)  # accepted
    text = [ord(rng.choice("ab")) for _ in range(4000)]  # prefixes of the stops match all along
    ts = TextStream(chars, stops)
    out = "".join(ts.push(t) for t in text) + ts.finish()
    assert out == chars(text)
    # Aho-Corasick: one transition per character plus failure steps, never more than the characters.
    assert ts.steps <= 2 * len(text), ts.steps


@pytest.mark.parametrize(
    "stops",
    [["x"] * (MAX_STOP_STRINGS + 1), ["y" * (MAX_STOP_CHARS // 2 + 1)] * 2],
    ids=["too-many", "too-long"],
)
def test_stop_strings_beyond_the_caps_are_refused(stops: list[str]) -> None:
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(stop=stops)
    assert e.value.param == "stop"


# --- the HTTP edge, over real HTTP to a real router (scripted stages over real gRPC) --------------------
KEY = "edge-key"
EDGE = {"header_timeout_s": 1.0, "body_timeout_s": 1.0, "max_header_bytes": 8192, "max_concurrency": 4}


@pytest.fixture
def stage() -> ScriptedStage:
    return ScriptedStage(list(range(10, 40)), vocab_size=1024, max_model_len=256)


@pytest.fixture
def router(llama_dir: Path, stage: ScriptedStage) -> Iterator[RouterHarness]:
    with RouterHarness(llama_dir, {"g0": stage}, served_model_name="demo", **EDGE) as h:
        yield h


def raw(h: RouterHarness, data: bytes, wait_s: float = 10.0) -> bytes:
    """Send `data` on a fresh connection and read until the server closes it (or wait_s passes)."""
    host, port = h.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=wait_s) as s:
        s.sendall(data)
        return read_all(s)


def read_all(s: socket.socket) -> bytes:
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    return out


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1]) if response.startswith(b"HTTP/1.1 ") else 0


def one_line(caplog: pytest.LogCaptureFixture, needle: str) -> None:
    """Exactly one log line mentions `needle`, and no record anywhere carries a traceback."""
    lines = [r.getMessage() for r in caplog.records if needle in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]


def completions_counted(h: RouterHarness, status: int) -> float:
    text = httpx.get(h.url + "/metrics", timeout=10).text
    name = "pipeserve:router_requests_total"
    return metric(text, name, endpoint="/v1/completions", status=str(status)) or 0


def assert_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert param is None or err["param"] == param, err
    assert code is None or err["code"] == code, err
    return err


def test_integer_literal_beyond_pythons_digit_limit_is_a_400(
    router: RouterHarness, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    body = b'{"prompt": "hi", "max_tokens": 2, "unknown": ' + b"9" * 5000 + b"}"
    r = httpx.post(router.url + "/v1/completions", content=body, timeout=30)
    assert_error(r, 400)
    assert "not valid JSON" in r.json()["error"]["message"]
    one_line(caplog, "-> 400")


def test_non_ascii_authorization_header_is_a_401(llama_dir: Path, stage: ScriptedStage) -> None:
    with RouterHarness(llama_dir, {"g0": stage}, api_key=KEY, **EDGE) as h:
        body = {"prompt": "hi", "max_tokens": 2}
        for token in ("Bearer é-key".encode(), "Bearer \xe9".encode("latin-1"), b"Bearer \xff\xfe"):
            r = httpx.post(h.url + "/v1/completions", json=body, headers={"Authorization": token}, timeout=30)
            assert_error(r, 401, code="invalid_api_key")
        r = httpx.post(h.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200, r.text


def test_openapi_document_requires_the_api_key(llama_dir: Path, stage: ScriptedStage) -> None:
    with RouterHarness(llama_dir, {"g0": stage}, api_key=KEY, **EDGE) as h:
        assert_error(httpx.get(h.url + "/openapi.json", timeout=10), 401, code="invalid_api_key")
        r = httpx.get(h.url + "/openapi.json", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
        assert r.status_code == 200 and "/v1/completions" in r.json()["paths"]
    with RouterHarness(llama_dir, {"g0": stage}, **EDGE) as h:  # no key set: open, as /v1/*
        assert httpx.get(h.url + "/openapi.json", timeout=10).status_code == 200


def test_a_batch_takes_one_slot_per_prompt(router: RouterHarness, stage: ScriptedStage) -> None:
    # max_concurrency 4: a batch over it can never be admitted (400); one over what is free now is a 429.
    r = httpx.post(router.url + "/v1/completions", json={"prompt": ["a"] * 5, "max_tokens": 2}, timeout=30)
    assert "limit of 4 per request" in assert_error(r, 400, param="prompt")["message"]
    stage.token_delay_s = 0.2
    body = {"prompt": ["a", "b", "c"], "max_tokens": 20, "stream": True}
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=30) as held:
        assert held.status_code == 200
        lines = held.iter_lines()  # kept: a dropped iterator closes the response (a disconnect)
        next(lines)  # three prompts in flight now
        r = httpx.post(router.url + "/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 1})
        assert_error(r, 429, code="rate_limit_exceeded")
        r = httpx.post(router.url + "/v1/completions", json={"prompt": "a", "max_tokens": 1}, timeout=30)
        assert r.status_code == 200, r.text
    stage.token_delay_s = 0.0
    wait_until(lambda: router.call(lambda: router_of(router).admission.in_flight) == 0, 10, "slots released")
    r = httpx.post(router.url + "/v1/completions", json={"prompt": ["a"] * 4, "max_tokens": 1}, timeout=30)
    assert r.status_code == 200 and len(r.json()["choices"]) == 4


def router_of(h: RouterHarness):
    return h._server.config.app.state.router


def test_client_gone_mid_body_is_a_499_counted_and_logged_once(
    router: RouterHarness, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    host, port = router.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n" + b'{"prompt"')
        time.sleep(0.2)  # the app is reading the body now
    wait_until(lambda: completions_counted(router, 499) == 1, 10, "a 499 counted")
    assert completions_counted(router, 500) == 0
    one_line(caplog, "-> 499")


def test_body_shorter_than_its_content_length_is_a_408(router: RouterHarness) -> None:
    t0 = time.monotonic()
    out = raw(router, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{}")
    assert status_of(out) == 408, out[:300]
    assert 0.9 <= time.monotonic() - t0 < 8
    assert b'"code":"request_timeout"' in out


def test_headers_dribbled_slowly_get_a_408_and_the_connection_closed(router: RouterHarness) -> None:
    host, port = router.url.removeprefix("http://").split(":")
    t0 = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\n")
        for _ in range(3):  # a slowloris: a header line now and then, never the blank line
            time.sleep(0.2)
            s.sendall(b"X-a: b\r\n")
        out = read_all(s)
    assert status_of(out) == 408, out[:300]
    assert time.monotonic() - t0 < 8
    # A keep-alive connection has the same deadline for its next request's headers.
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        first = s.recv(65536)
        assert status_of(first) == 200
        s.sendall(b"GET /health HTTP/1.1\r\n")
        out = first + read_all(s)
    assert out.count(b"HTTP/1.1 ") == 2 and b"HTTP/1.1 408 " in out, out


def test_unfinished_header_beyond_the_cap_is_a_431(router: RouterHarness) -> None:
    host, port = router.url.removeprefix("http://").split(":")
    sent = 0
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nX-big: ")
        try:
            for _ in range(2000):  # up to 128 MB; the server gives up long before
                s.sendall(b"a" * 65536)
                sent += 65536
        except (BrokenPipeError, ConnectionResetError):
            pass
        out = read_all(s)
    assert sent < 16 * 2**20, sent  # closed early: no memory grows with the header
    assert status_of(out) in (431, 0), out[:300]  # a reset may eat the response; the close is the point
    # The server still serves.
    assert httpx.get(router.url + "/health", timeout=10).status_code == 200


def test_invalid_request_error_on_any_route_is_a_400(router: RouterHarness) -> None:
    def boom() -> None:
        raise InvalidRequestError("thing", "is wrong")

    router.call(lambda: router_of(router) and router._server.config.app.add_api_route("/boom", boom))
    r = httpx.get(router.url + "/boom", timeout=10)
    assert assert_error(r, 400, param="thing")["message"] == "is wrong"


def test_shutdown_ends_open_streams_with_an_error_event_and_done(
    llama_dir: Path, stage: ScriptedStage
) -> None:
    stage.token_delay_s = 0.5  # 30 tokens: 15 s, far past the 2 s drain
    h = RouterHarness(llama_dir, {"g0": stage}, **EDGE).__enter__()
    try:
        h._server.config.timeout_graceful_shutdown = 2
        body = {"prompt": "a", "max_tokens": 30, "stream": True}
        with httpx.stream("POST", h.url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["choices"][0]["text"] is not None
            h._server.should_exit = True
            t0 = time.monotonic()
            rest = [line for line in lines if line.startswith("data: ")]
        assert time.monotonic() - t0 < 5
        assert rest[-1] == "data: [DONE]", rest[-3:]
        err = json.loads(rest[-2][6:])["error"]
        assert err["code"] == "service_unavailable" and "shutting down" in err["message"]
        assert all("choices" in json.loads(x[6:]) for x in rest[:-2])  # every chunk before it whole
    finally:
        h.__exit__(None, None, None)


def test_pipeserve_up_guards_groups_and_openapi_with_the_api_key(
    llama_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`pipeserve up` (supervisor on its own thread): /groups shows pids and ports, so it needs the key."""
    up = UpProcess("--model", str(llama_dir), "--api-key", KEY, "--num-kv-blocks", "256", log_dir=tmp_path)
    try:
        up.wait_ready()
        auth = {"Authorization": f"Bearer {KEY}"}
        for path in ("/groups", "/openapi.json"):
            assert_error(httpx.get(up.url + path, timeout=10), 401, code="invalid_api_key")
            assert_error(httpx.get(up.url + path, headers={"Authorization": "Bearer nope"}), 401)
        (group,) = httpx.get(up.url + "/groups", headers=auth, timeout=10).json()
        assert group["state"] == "ready" and group["router"]["ready"] and group["pids"], group
        assert httpx.get(up.url + "/openapi.json", headers=auth, timeout=10).status_code == 200
        body = {"prompt": "Hello", "max_tokens": 3}
        r = httpx.post(up.url + "/v1/completions", json=body, headers=auth, timeout=60)
        assert r.status_code == 200, r.text
    finally:
        assert up.stop() == 0, up.log()[-3000:]


def test_supervisor_keeps_restarting_groups_while_the_routers_loop_is_stalled(
    llama_dir: Path, tmp_path: Path
) -> None:
    """The supervisor runs on its own thread and loop: a stalled router loop does not stall it."""
    config = EngineConfig(model=str(llama_dir), num_threads=1, num_kv_blocks=256, log_dir=str(tmp_path))
    slot = GroupSlot("group-s", config, StageServeConfig())
    downs: list[tuple[str, threading.Thread]] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()

        def on_down(name: str, reason: str) -> None:  # as `pipeserve up` wires it
            loop.call_soon_threadsafe(lambda: downs.append((name, threading.current_thread())))

        sup = Supervisor(
            [slot],
            CollectorRegistry(),
            on_down=on_down,
            config=SupervisorConfig(interval_s=0.2, backoff_s=0.2),
        )
        watcher = SupervisorThread(sup)
        await asyncio.to_thread(watcher.start)
        try:
            await asyncio.to_thread(wait_until, sup.all_ready.is_set, 120, "group ready")
            os.kill(slot.pids[0], signal.SIGKILL)
            # Stall this loop (the router's, in `pipeserve up`) the way a CPU-heavy request would.
            deadline = time.monotonic() + 60
            while slot.restarts == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert slot.restarts == 1, slot.snapshot()
            assert not downs  # the callback waits for this loop: it is thread-safe
            await asyncio.sleep(0.1)
            assert downs == [("group-s", threading.main_thread())]
        finally:
            await asyncio.to_thread(watcher.stop, 0.0, 60.0)

    asyncio.run(main())
