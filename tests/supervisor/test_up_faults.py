"""`pipeserve up` under faults, with real processes: a stage killed or frozen mid-request,
a whole group lost while another serves, and shutdown leaving no process behind.

Every in-flight request must end (a result or an error) within the wedge timeout
plus a margin, the broken group must be restarted as a whole (and counted), and
new requests must succeed afterwards; the survivors hold no KV blocks at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load_file, save_file

from pipeline_support import pid_alive, wait_dead
from serving_support import UpProcess, metric, metric_sum, wait_until

pytestmark = pytest.mark.slow

WEDGE_S = 4.0
MARGIN_S = 12.0  # process exit, SIGTERM/SIGKILL of the rest, the router's view, 2 shared cores


def _stream(
    url: str, model: str, prompt: list[int], max_tokens: int, out: list, timeout_s: float = 120
) -> None:
    """One streaming completion; appends (tokens received, "finished" | "error: ...", seconds)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    body["ignore_eos"] = True
    t0 = time.monotonic()
    tokens, end = 0, "no end"
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            if r.status_code != 200:
                end = f"error: HTTP {r.status_code}"
            else:
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        break
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        end = f"error: {chunk['error']['message'][:100]}"
                        continue
                    for c in chunk.get("choices", []):
                        tokens += bool(c.get("text"))
                        if c.get("finish_reason"):
                            end = "finished"
    except httpx.HTTPError as e:
        end = f"error: {type(e).__name__}"
    out.append((tokens, end, time.monotonic() - t0))


def _complete(url: str, model: str, prompt: list[int], max_tokens: int = 4) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def _restarts(up: UpProcess, name: str = "group-0", **cause: str) -> float:
    """The group's restarts (over every cause, or one: `cause="wedged"`)."""
    text = httpx.get(up.url + "/metrics").text
    return metric_sum(text, "pipeserve:group_restarts_total", group=name, **cause)


def _group(up: UpProcess, name: str) -> dict:
    return next(g for g in up.groups() if g["name"] == name)


def _wait_restarted(up: UpProcess, name: str, restarts: int, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        g = _group(up, name)
        if g["restarts"] >= restarts and g["state"] == "ready" and (g["router"] or {}).get("ready"):
            return g
        time.sleep(0.2)
    raise AssertionError(f"{name} not restarted and ready: {_group(up, name)}\n{up.log()[-3000:]}")


def _in_flight(up: UpProcess, model: str, n: int) -> tuple[list, list[threading.Thread]]:
    out: list = []
    threads = [
        threading.Thread(target=_stream, args=(up.url, model, [7 + i, 8, 9, 10], 1500, out)) for i in range(n)
    ]
    for t in threads:
        t.start()
    return out, threads


def _running(group: dict) -> float:
    text = httpx.get(group["health"][0] + "/metrics").text
    return metric(text, "pipeserve:num_requests_running") or 0


def _until_running(up: UpProcess, group: dict, n: int) -> None:
    wait_until(lambda: _running(group) >= n, 60, "the long requests running", interval_s=0.05)


def test_killed_then_frozen_stage_restarts_the_whole_group(llama_dir: Path, tmp_path: Path) -> None:
    args = ["--model", str(llama_dir), "--stages", "2", "--num-kv-blocks", "1024"]
    up = UpProcess(*args, "--wedge-timeout-s", str(WEDGE_S), "--wedge-grace-s", "1", log_dir=tmp_path)
    try:
        up.wait_ready()
        model = str(llama_dir)
        g = _group(up, "group-0")

        # 1. SIGKILL stage 1 during 8 long requests.
        out, threads = _in_flight(up, model, 8)
        _until_running(up, g, 8)
        old = dict(g["pids"])
        killed_at = time.monotonic()
        os.kill(int(old["1"]), signal.SIGKILL)
        for t in threads:
            t.join(WEDGE_S + MARGIN_S)
        assert len(out) == 8, f"{8 - len(out)} requests still open {WEDGE_S + MARGIN_S}s after the kill"
        assert all(end != "no end" for _, end, _ in out), out
        assert any(end.startswith("error") for _, end, _ in out), out
        assert not wait_dead([int(p) for p in old.values()], 10), "the old incarnation survived"
        g = _wait_restarted(up, "group-0", 1, 90)
        assert time.monotonic() - killed_at < 90
        assert set(g["pids"].values()).isdisjoint(old.values()), "not a whole-group restart"
        assert "stage 1 exited" in g["last_failure"] or "stage 0 exited" in g["last_failure"]
        r = _complete(up.url, model, [5, 6, 7])
        assert r.status_code == 200, r.text
        assert _restarts(up) == 1
        # Stage 0 may have stopped the group (exit 3) before the supervisor saw stage 1's SIGKILL.
        assert _restarts(up, cause="killed") + _restarts(up, cause="group_stop") == 1

        # 2. SIGSTOP stage 1 during requests: stage 0's wedge detector stops the group.
        out, threads = _in_flight(up, model, 4)
        _until_running(up, g, 4)
        frozen = int(g["pids"]["1"])
        os.kill(frozen, signal.SIGSTOP)
        for t in threads:
            t.join(WEDGE_S + MARGIN_S)
        assert len(out) == 4 and all(end != "no end" for _, end, _ in out), out
        g = _wait_restarted(up, "group-0", 2, 90)
        assert "exited with status 4" in g["last_failure"] or "wedged" in g["last_failure"], g
        assert not pid_alive(frozen), "the frozen stage was not stopped"
        assert "WEDGE: stage 0" in (tmp_path / "group-0-stage-0.log").read_text()

        # Serving resumed; after the survivors finish, no KV block is held on any stage.
        for i in range(3):
            assert _complete(up.url, model, [11 + i, 12, 13]).status_code == 200
        text = httpx.get(g["health"][0] + "/metrics").text
        assert metric(text, "pipeserve:kv_blocks_used") == 0, text
        assert metric(text, "pipeserve:group_stage_blocks_held", stage="1") == 0
        assert _restarts(up) == 2
        assert _restarts(up, cause="wedged") + _restarts(up, cause="unresponsive") == 1
    finally:
        code = up.stop()
    assert code == 0, up.log()[-3000:]


def test_two_groups_one_lost_requests_keep_succeeding_and_sigterm_leaves_no_orphans(
    llama_dir: Path, tmp_path: Path
) -> None:
    up = UpProcess("--model", str(llama_dir), "--replicas", "2", "--num-kv-blocks", "512", log_dir=tmp_path)
    model = str(llama_dir)
    try:
        up.wait_ready()
        groups = {g["name"]: g for g in up.groups()}
        pids = [int(p) for g in groups.values() for p in g["pids"].values()]
        os.kill(int(groups["group-0"]["pids"]["0"]), signal.SIGKILL)
        t0 = time.monotonic()
        ok = 0
        while time.monotonic() - t0 < 8:  # while group-0 is down and restarting
            r = _complete(up.url, model, [20 + ok % 50, 21, 22])
            assert r.status_code == 200, r.text
            ok += 1
        assert ok >= 5
        _wait_restarted(up, "group-0", 1, 90)
        assert _group(up, "group-1")["restarts"] == 0
        pids += [int(p) for p in _group(up, "group-0")["pids"].values()]
        # SIGTERM drains: a response in flight completes before anything stops.
        out: list = []
        t = threading.Thread(target=_stream, args=(up.url, model, [3, 4, 5], 300, out))
        t.start()
        wait_until(lambda: any(_running(g) for g in up.groups()), 30, "the request running", 0.05)
    finally:
        code = up.stop(signal.SIGTERM)
    t.join(30)
    assert out and out[0][1] == "finished" and out[0][0] > 0, out
    assert code == 0, up.log()[-3000:]
    assert not wait_dead(pids, 10), "stage processes outlived pipeserve up"


def test_sigkilled_up_leaves_no_orphans(llama_dir: Path, tmp_path: Path) -> None:
    up = UpProcess("--model", str(llama_dir), "--stages", "2", "--num-kv-blocks", "512", log_dir=tmp_path)
    try:
        up.wait_ready()
        pids = [int(p) for g in up.groups() for p in g["pids"].values()]
    finally:
        up.stop(signal.SIGKILL)
    assert not wait_dead(pids, 10), "stage processes outlived a SIGKILLed pipeserve up"


def test_a_group_that_cannot_start_stops_up_with_status_2(llama_dir: Path, tmp_path: Path) -> None:
    """Weights that lack a tensor pass every check made before start (model_path.py); the stage
    refuses them, and up's last line names the stage's log file."""
    broken = tmp_path / "broken-model"
    shutil.copytree(llama_dir, broken)
    weights = load_file(broken / "model.safetensors")
    del weights["model.norm.weight"]
    save_file(weights, broken / "model.safetensors")
    up = UpProcess("--model", str(broken), log_dir=tmp_path / "logs")
    try:
        assert up.proc.wait(timeout=60) == 2
    finally:
        up.stop()
    log = tmp_path / "logs" / "group-0-stage-0.log"
    line = next(x for x in up.log().splitlines() if "cannot serve:" in x)
    assert "cannot serve: group-0: stage 0 cannot start" in line and line.endswith(f"(see {log})"), line
    assert "model.norm.weight" in log.read_text()
