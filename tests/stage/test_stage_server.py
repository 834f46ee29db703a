"""Stage 0's gRPC server and every stage's side port, on live stage processes."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest

from conftest import hf_greedy
from pipeline_support import wait_dead
from pipeserve.rpc import generation_pb2 as pb
from serving_support import generate, greedy_request, live_group, metric, stub, wait_http, wait_until


def test_generate_matches_hf_and_cancel_frees_blocks_on_every_stage(llama_dir: Path, tmp_path: Path) -> None:
    with live_group(llama_dir, 2, tmp_path) as slot:
        s = stub(slot.grpc_target)
        health = s.Health(pb.HealthRequest(), timeout=5)
        assert health.ready and health.status == "ready" and health.vocab_size > 0

        prompt = [5, 17, 99, 3, 250, 41, 7]
        tokens, finish = generate(s, greedy_request("a", prompt, 12, ignore_eos=True))
        assert tokens == hf_greedy(llama_dir, prompt, 12, ignore_eos=True) and finish == "length"

        # A cancelled call (the router's client went away) aborts the request on every stage.
        call = s.Generate(greedy_request("b", prompt * 3, 500, ignore_eos=True), timeout=60)
        next(call)
        used = metric(httpx.get(slot.health_url(0) + "/metrics").text, "pipeserve:kv_blocks_used")
        assert used and used > 0
        call.cancel()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            text = httpx.get(slot.health_url(0) + "/metrics").text
            held = [metric(text, "pipeserve:group_stage_blocks_held", stage=str(r)) for r in (0, 1)]
            if metric(text, "pipeserve:kv_blocks_used") == 0 and held == [0, 0]:
                break
            time.sleep(0.1)
        assert metric(text, "pipeserve:kv_blocks_used") == 0, text
        assert held == [0, 0], f"blocks still held by stage (0, 1): {held}"
        assert metric(text, "pipeserve:request_success_total", finished_reason="abort") == 1

        # Invalid input is INVALID_ARGUMENT naming the field; the server keeps serving.
        with pytest.raises(grpc.RpcError) as err:
            generate(s, greedy_request("c", [5, 10**6], 4))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith("prompt:")
        assert generate(s, greedy_request("d", prompt, 3, ignore_eos=True))[1] == "length"
        assert s.Abort(pb.AbortRequest(request_id="nope"), timeout=5).found is False


def test_readyz_waits_for_the_whole_ring(llama_dir: Path, tmp_path: Path) -> None:
    from pipeserve.config import EngineConfig, StageServeConfig
    from pipeserve.supervisor.group import GroupSlot

    config = EngineConfig(
        model=str(llama_dir), stages=2, num_threads=1, num_kv_blocks=256, log_dir=str(tmp_path)
    )
    slot = GroupSlot("g", config, StageServeConfig())
    try:
        slot.start()
        # Freeze stage 1 before it can join: stage 0 is alive but must not be ready.
        stage1 = slot.group.procs[1]  # type: ignore[union-attr]
        stage1.send_signal(signal.SIGSTOP)
        wait_http(slot.health_url(0) + "/livez", 60, alive=slot.exited)
        time.sleep(3)
        r = httpx.get(slot.health_url(0) + "/readyz")
        assert r.status_code == 503 and r.json()["phase"] in ("loading", "joining")
        stage1.send_signal(signal.SIGCONT)
        for rank in (0, 1):
            wait_http(slot.health_url(rank) + "/readyz", 60)
    finally:
        slot.kill(grace_s=5.0)


def test_sigterm_drains_running_requests_then_the_ring_stops_cleanly(llama_dir: Path, tmp_path: Path) -> None:
    with live_group(llama_dir, 2, tmp_path) as slot:
        s = stub(slot.grpc_target)
        prompt = [9, 8, 7, 6, 5]
        result: dict = {}

        def long_request() -> None:
            result["out"] = generate(s, greedy_request("long", prompt, 60, ignore_eos=True))

        t = threading.Thread(target=long_request)
        t.start()
        metrics = slot.health_url(0) + "/metrics"
        running = "pipeserve:num_requests_running"
        wait_until(lambda: metric(httpx.get(metrics).text, running) == 1, 30, "the long request", 0.05)
        procs = slot.group.procs  # type: ignore[union-attr]
        procs[0].send_signal(signal.SIGTERM)
        readyz = slot.health_url(0) + "/readyz"
        wait_until(lambda: httpx.get(readyz).json()["phase"] == "draining", 10, "draining", 0.05)
        with pytest.raises(grpc.RpcError) as err:
            generate(s, greedy_request("late", prompt, 2))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in err.value.details()
        t.join(60)
        assert result["out"] == (hf_greedy(llama_dir, prompt, 60, ignore_eos=True), "length")
        assert {rank: p.wait(30) for rank, p in procs.items()} == {0: 0, 1: 0}
        assert not wait_dead([p.pid for p in procs.values()], 5)
