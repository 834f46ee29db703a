"""Retry rule, deadlines, admission, disconnects, set_down and /health_generate, over real gRPC.

The stages are scripted (router_support.ScriptedStage) so each fault happens exactly when wanted.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import openai
import pytest

from pipeserve.tokenizer import TokenizerAssets
from router_support import RouterHarness, ScriptedStage
from serving_support import metric, wait_until

TEXT = "one two three four five six seven eight nine ten"


@pytest.fixture(scope="module")
def reply(llama_dir: Path) -> list[int]:
    return TokenizerAssets.load(llama_dir).encode(TEXT)


def two(reply: list[int]) -> dict[str, ScriptedStage]:
    return {"g0": ScriptedStage(reply), "g1": ScriptedStage(reply)}


def complete(h: RouterHarness, timeout: float = 30, **body) -> httpx.Response:
    return httpx.post(
        h.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3, **body}, timeout=timeout
    )


def metrics(h: RouterHarness) -> str:
    return httpx.get(h.url + "/metrics").text


@pytest.mark.parametrize("mode", ["unavailable", "exhausted", "stall_first"])
def test_failure_before_first_token_is_retried_once_on_another_group(
    llama_dir: Path, reply: list[int], mode: str
) -> None:
    stages = two(reply)
    stages["g0"].mode = mode
    with RouterHarness(llama_dir, stages, policy="round_robin", first_token_timeout_s=0.5) as h:
        for _ in range(4):
            r = complete(h)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "one two"
        assert len(stages["g1"].requests) == 4  # every request ended on g1
        assert 1 <= len(stages["g0"].requests) <= 4
        assert metric(metrics(h), "pipeserve:router_retries_total") == len(stages["g0"].requests)
        wait_until(lambda: stages["g0"].active == 0, 5, "failed calls ended on g0")
        if mode == "stall_first":
            assert stages["g0"].cancelled == len(stages["g0"].requests)  # our deadline cancelled them


def test_retry_avoids_the_failed_group_even_when_the_policy_prefers_it(
    llama_dir: Path, reply: list[int]
) -> None:
    stages = two(reply)
    with RouterHarness(llama_dir, stages, policy="prefix_affinity") as h:
        assert complete(h).status_code == 200
        affine = next(name for name, s in stages.items() if s.requests)
        other = next(name for name in stages if name != affine)
        stages[affine].mode = "exhausted"  # still ready: only the retry rule keeps it out
        for _ in range(3):
            r = complete(h)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "one two"
        assert len(stages[other].requests) == 3
        assert metric(metrics(h), "pipeserve:router_retries_total") == 3


def test_no_retry_when_no_other_group_and_codes_map_to_503_429(llama_dir: Path, reply: list[int]) -> None:
    stage = ScriptedStage(reply)
    with RouterHarness(llama_dir, {"g0": stage}, first_token_timeout_s=0.5) as h:
        for mode, status in (("exhausted", 429), ("stall_first", 503), ("unavailable", 503)):
            stage.mode = mode
            before = len(stage.requests)
            r = complete(h)
            assert r.status_code == status, r.text
            assert r.json()["error"]["type"] in ("rate_limit_error", "server_error")
            assert len(stage.requests) == before + 1
        stage.mode = "ok"
        wait_until(lambda: complete(h).status_code == 200, 5, "service after errors")


def test_both_groups_exhausted_is_429(llama_dir: Path, reply: list[int]) -> None:
    stages = two(reply)
    for s in stages.values():
        s.mode = "exhausted"
    with RouterHarness(llama_dir, stages) as h:
        r = complete(h)
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
        assert r.headers["retry-after"] == "1"  # a refusal of load says when to try again
        assert len(stages["g0"].requests) + len(stages["g1"].requests) == 2


def test_a_stopped_group_is_routed_around(llama_dir: Path, reply: list[int]) -> None:
    stages = two(reply)
    with RouterHarness(llama_dir, stages, policy="round_robin") as h:
        h.run(stages["g0"].stop())
        assert all(complete(h).status_code == 200 for _ in range(4))
        wait_until(lambda: not h.replicas.snapshot()[0]["ready"], 5, "g0 unready")
        assert h.replicas.snapshot()[0]["status"].startswith(("unreachable", "Generate failed"))
        h.run(stages["g1"].stop())
        wait_until(lambda: complete(h).status_code == 503, 5, "503 with no group")
        assert complete(h).headers["retry-after"] == "1"
        assert httpx.get(h.url + "/health").status_code == 503
        assert httpx.get(h.url + "/health_generate").status_code == 503
        h.run(stages["g1"].start())  # restarted on the same port: the poller brings it back
        wait_until(lambda: complete(h).status_code == 200, 10, "g1 back")


def test_failure_after_first_token_ends_stream_with_error_event(llama_dir: Path, reply: list[int]) -> None:
    stages = two(reply)
    stages["g0"].mode = "fail_after_first"
    stages["g1"].ready = False
    with RouterHarness(llama_dir, stages, wait_ready=1) as h:
        r = complete(h, max_tokens=5, stream=True)
        assert r.status_code == 200
        events = [e[len("data: ") :] for e in r.text.split("\n\n") if e.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "service_unavailable" and "scripted" in error["message"]
        assert json.loads(events[0])["choices"][0]["text"] == "one"
        # UNAVAILABLE marked g0 unready (the group stopped); the next poll finds it ready again.
        ready = lambda: h.call(h.replicas.ready_groups)  # noqa: E731
        wait_until(ready, 5, "g0 ready again")
        with openai.OpenAI(base_url=h.url + "/v1", api_key="x", max_retries=0) as client:
            with pytest.raises(openai.APIError, match="scripted"):
                for _ in client.completions.create(model=h.config.model_name, prompt="x", stream=True):
                    pass
        wait_until(ready, 5, "g0 ready again")
        r = complete(h, max_tokens=5)
        assert r.status_code == 503 and "scripted" in r.json()["error"]["message"]  # blocking: a 503
        assert stages["g1"].requests == []  # nothing is retried after the first token


def test_idle_stream_deadline_cancels_the_call(llama_dir: Path, reply: list[int]) -> None:
    stage = ScriptedStage(reply)
    stage.mode = "stall_after_first"
    with RouterHarness(llama_dir, {"g0": stage}, stream_idle_timeout_s=0.5) as h:
        t0 = time.monotonic()
        r = complete(h, max_tokens=5, stream=True)
        assert time.monotonic() - t0 < 5
        assert '"error"' in r.text and r.text.endswith("data: [DONE]\n\n")
        wait_until(lambda: stage.cancelled == 1 and stage.active == 0, 5, "stalled call cancelled")


def test_max_concurrency_gives_429_then_service_resumes(llama_dir: Path, reply: list[int]) -> None:
    stage = ScriptedStage(reply)
    stage.token_delay_s = 0.3
    with RouterHarness(llama_dir, {"g0": stage}, max_concurrency=1) as h:
        body = {"prompt": "x", "max_tokens": 4, "stream": True}
        with httpx.stream("POST", h.url + "/v1/completions", json=body) as s:
            lines = s.iter_lines()  # kept: dropping the iterator closes the response
            next(lines)
            r = complete(h)
            assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
            assert "data: [DONE]" in list(lines)
        stage.token_delay_s = 0
        wait_until(lambda: complete(h).status_code == 200, 5, "slot released")
        assert metric(metrics(h), "pipeserve:router_requests_in_flight") == 0


def test_client_disconnect_cancels_upstream(llama_dir: Path, reply: list[int]) -> None:
    stage = ScriptedStage(reply)
    stage.token_delay_s = 0.5
    with RouterHarness(llama_dir, {"g0": stage}) as h:
        body = {"prompt": "x", "max_tokens": 10, "stream": True}
        with httpx.stream("POST", h.url + "/v1/completions", json=body) as s:
            next(s.iter_lines())  # the stream has started: then the client goes away
        wait_until(lambda: stage.cancelled == 1 and stage.active == 0, 5, "streamed call cancelled")
        stage.mode = "stall_after_first"  # blocking: the client gives up waiting for the body
        with pytest.raises(httpx.ReadTimeout):
            complete(h, timeout=1.0)
        wait_until(lambda: stage.cancelled == 2 and stage.active == 0, 5, "blocking call cancelled")
        stage.mode, stage.token_delay_s = "ok", 0
        wait_until(lambda: complete(h).status_code == 200, 5, "service after disconnects")
        assert metric(metrics(h), "pipeserve:router_requests_in_flight") == 0


def test_set_down_stops_routing_until_polls_see_the_group_restart(llama_dir: Path, reply: list[int]) -> None:
    stages = two(reply)
    with RouterHarness(llama_dir, stages, policy="round_robin") as h:
        h.call(lambda: h.replicas.set_down("g0", "supervisor saw it exit"))
        snap = h.call(h.replicas.snapshot)
        assert not snap[0]["ready"] and snap[0]["status"] == "down: supervisor saw it exit"
        for _ in range(3):
            assert complete(h).status_code == 200
        time.sleep(0.3)  # several polls: g0 still says ready (not yet noticed it is dying) and stays out
        assert not h.call(h.replicas.snapshot)[0]["ready"] and complete(h).status_code == 200
        assert stages["g0"].requests == []
        stages["g0"].ready = False  # the restart: unready while it loads, then ready
        wait_until(
            lambda: h.call(h.replicas.snapshot)[0]["status"] == "down: supervisor saw it exit", 5, "polled"
        )
        time.sleep(0.2)
        stages["g0"].ready = True
        wait_until(lambda: h.call(h.replicas.snapshot)[0]["ready"], 5, "g0 back after the restart")
        assert all(complete(h).status_code == 200 for _ in range(4)) and len(stages["g0"].requests) == 2


def test_least_load_prefers_the_idle_group(llama_dir: Path, reply: list[int]) -> None:
    stages = two(reply)
    stages["g0"].extra_running = 5
    with RouterHarness(llama_dir, stages, policy="least_load") as h:
        wait_until(lambda: h.call(h.replicas.snapshot)[0]["running"] == 5, 5, "load polled")
        for _ in range(3):
            assert complete(h).status_code == 200
        assert stages["g0"].requests == [] and len(stages["g1"].requests) == 3


def test_health_generate_probes_only_idle_groups(llama_dir: Path, reply: list[int]) -> None:
    stage = ScriptedStage(reply)
    with RouterHarness(llama_dir, {"g0": stage}) as h:
        stage.seconds_since_token = 1.0  # tokens within health_generate_recent_s: no probe
        wait_until(lambda: h.call(h.replicas.snapshot)[0]["seconds_since_token"] >= 1.0, 5, "polled")
        r = httpx.get(h.url + "/health_generate")
        assert r.status_code == 200 and r.json()["probe"] is False and stage.requests == []
        stage.seconds_since_token = 600.0  # idle for long: one 1-token greedy probe
        wait_until(lambda: h.call(h.replicas.snapshot)[0]["seconds_since_token"] > 100, 5, "polled")
        r = httpx.get(h.url + "/health_generate")
        assert r.status_code == 200 and r.json()["probe"] is True
        (probe,) = stage.requests
        assert probe.sampling.max_tokens == 1 and probe.sampling.temperature == 0
        stage.extra_running = 3  # busy and silent: answered from the polled figures, never probed
        wait_until(lambda: h.call(h.replicas.snapshot)[0]["running"] == 3, 5, "polled")
        assert httpx.get(h.url + "/health_generate").status_code == 503
        assert len(stage.requests) == 1
        stage.extra_running, stage.mode = 0, "unavailable"
        wait_until(lambda: h.call(h.replicas.snapshot)[0]["running"] == 0, 5, "polled")
        r = httpx.get(h.url + "/health_generate")
        assert r.status_code == 503 and "probe" in r.json()["error"]["message"]
