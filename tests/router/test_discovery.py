"""The router's group discovery: an InferencePipeline's status followed live, and dynamic membership.

A real `pipeserve router --discover kubernetes` process watches an InferencePipeline served by kmock's
KubernetesEmulator (real HTTP, the real `kubernetes` client), in front of two live single-stage groups:
* no CR, or a CR whose groups are not Ready (their stage 0 answering Health ready all the same): 503,
  OpenAI-shaped, at once;
* a group enters routing when its status says Ready, leaves at once (well inside the router's 30 s
  Health interval) when it says Restarting, and scale 1 -> 2 -> 1 is followed without a restart;
* a group Ready in status whose process was killed never hangs a request: before its first token it is
  retried on the other group and succeeds, within a bounded time;
* the CR deleted: 503.
ReplicaSet.set_targets (in-process, a scripted stage): a group removed while a stream runs on it lets
that stream finish, then closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from conftest import hf_greedy
from pipeserve.local.ports import free_port
from pipeserve.router.upstream.discovery_k8s import ready_targets
from router_support import RouterHarness, ScriptedStage
from serving_support import live_group, metric, wait_http, wait_until

NS, NAME = "serving", "demo"
BASE = f"/apis/pipeserve.io/v1alpha1/namespaces/{NS}/inferencepipelines"
PROMPT = [5, 17, 300, 42, 7, 99, 123, 8]
MERGE = {"content-type": "application/merge-patch+json"}


class FakeApi:
    """kmock's KubernetesEmulator on a free port, served from its own thread and loop."""

    def __init__(self) -> None:
        self.url = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve()), daemon=True)

    async def _serve(self) -> None:
        from kmock import KubernetesEmulator, ResourceInfo, Server

        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        async with KubernetesEmulator() as k, Server(k) as server:
            k.resources["pipeserve.io/v1alpha1/inferencepipelines"] = ResourceInfo(
                kind="InferencePipeline", namespaced=True
            )
            self.url = str(server.url).rstrip("/")
            await self._stop.wait()

    def __enter__(self) -> FakeApi:
        self._thread.start()
        wait_until(lambda: self.url, 30, "kmock serving")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    def set_groups(self, groups: list[tuple[int, str, str]]) -> None:
        """Create the CR if absent, then set status.groups to (index, phase, endpoint)."""
        status = {"groups": [{"index": i, "phase": p, "endpoint": e} for i, p, e in groups]}
        if httpx.get(f"{self.url}{BASE}/{NAME}", timeout=10).status_code == 404:
            body = {"apiVersion": "pipeserve.io/v1alpha1", "kind": "InferencePipeline"}
            body["metadata"] = {"name": NAME, "namespace": NS}
            r = httpx.post(self.url + BASE, json={**body, "spec": {"stages": 1}}, timeout=10)
            assert r.status_code == 200, r.text
        r = httpx.patch(f"{self.url}{BASE}/{NAME}/status", json={"status": status}, headers=MERGE, timeout=10)
        assert r.status_code == 200, r.text

    def delete(self) -> None:
        r = httpx.delete(f"{self.url}{BASE}/{NAME}", timeout=10)
        assert r.status_code == 200, r.text


class Cluster:
    def __init__(self, api: FakeApi, slots: list, url: str, proc: subprocess.Popen, want: list[int]) -> None:
        self.api, self.slots, self.url, self.proc, self.want = api, slots, url, proc, want

    def endpoint(self, i: int) -> str:
        return self.slots[i].grpc_target

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=10).text

    def ready(self, group: str) -> float | None:
        return metric(self.metrics(), "pipeserve:router_group_ready", group=group)

    def complete(self, timeout_s: float = 60) -> httpx.Response:
        body = {"model": "m", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
        return httpx.post(self.url + "/v1/completions", json=body, timeout=timeout_s)

    def serves(self) -> None:
        r = self.complete()
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == self.want


@pytest.fixture(scope="module")
def cluster(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("discovery")
    want = hf_greedy(llama_dir, PROMPT, 8)
    with contextlib.ExitStack() as stack:
        api = stack.enter_context(FakeApi())
        slots = [stack.enter_context(live_group(llama_dir, 1, tmp / f"g{i}")) for i in range(2)]
        port = free_port()
        argv = [sys.executable, "-m", "pipeserve.cli", "router", "--tokenizer", str(llama_dir)]
        argv += ["--port", str(port), "--served-model-name", "m", "--discover", "kubernetes"]
        argv += ["--kube-api", api.url, "--namespace", NS, "--pipeline", NAME]
        # A long Health interval: whatever changes routing within seconds is discovery, not a poll.
        argv += ["--health-interval-s", "30", "--first-token-timeout-s", "20"]
        proc = subprocess.Popen(argv, stdout=open(tmp / "router.log", "ab"), stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_http(url + "/health", 60, status=503, alive=lambda: proc.poll())
            yield Cluster(api, slots, url, proc, want)
        finally:
            proc.send_signal(signal.SIGTERM)
            wait_until(lambda: proc.poll() is not None, 30, "the router exiting")
        assert proc.returncode == 0, (tmp / "router.log").read_text()[-3000:]


def _unavailable(c: Cluster) -> None:
    t0 = time.monotonic()
    r = c.complete(timeout_s=10)
    assert r.status_code == 503, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
    assert time.monotonic() - t0 < 3.0


def test_groups_follow_the_pipeline_status(cluster: Cluster) -> None:
    c = cluster
    _unavailable(c)  # no InferencePipeline at all
    # Both stage 0s answer Health ready, but the status says Starting: nothing is routed.
    c.api.set_groups([(0, "Starting", c.endpoint(0)), (1, "Pending", c.endpoint(1))])
    time.sleep(1.5)
    _unavailable(c)
    c.api.set_groups([(0, "Ready", c.endpoint(0))])
    wait_http(c.url + "/health", 15)
    c.serves()
    assert c.ready("group-0") == 1 and c.ready("group-1") is None
    # Scale 1 -> 2: the second group is routed once its status says Ready.
    c.api.set_groups([(0, "Ready", c.endpoint(0)), (1, "Starting", c.endpoint(1))])
    time.sleep(1.5)
    assert c.ready("group-1") is None
    c.api.set_groups([(0, "Ready", c.endpoint(0)), (1, "Ready", c.endpoint(1))])
    wait_until(lambda: c.ready("group-1") == 1, 10, "group-1 routed")
    # Restarting: out of routing at once, far inside the 30 s Health interval.
    c.api.set_groups([(0, "Ready", c.endpoint(0)), (1, "Restarting", c.endpoint(1))])
    wait_until(lambda: c.ready("group-1") is None, 3, "group-1 out of routing")
    for _ in range(3):
        c.serves()
    # Ready again (same endpoint): routed again, without restarting the router.
    c.api.set_groups([(0, "Ready", c.endpoint(0)), (1, "Ready", c.endpoint(1))])
    wait_until(lambda: c.ready("group-1") == 1, 10, "group-1 back")
    c.api.set_groups([(1, "Ready", c.endpoint(1))])  # group-0 goes: group-1 alone serves
    wait_until(lambda: c.ready("group-0") is None, 3, "group-0 out of routing")
    for _ in range(2):
        c.serves()
    # Scale 2 -> 1.
    c.api.set_groups([(0, "Ready", c.endpoint(0))])
    wait_until(lambda: c.ready("group-0") == 1 and c.ready("group-1") is None, 10, "scaled to 1")
    c.serves()
    assert c.proc.poll() is None


def test_a_dead_group_is_retried_on_another(cluster: Cluster) -> None:
    c = cluster
    c.api.set_groups([(0, "Ready", c.endpoint(0)), (1, "Ready", c.endpoint(1))])
    wait_until(lambda: c.ready("group-0") == 1 and c.ready("group-1") == 1, 15, "both groups routed")
    retries = metric(c.metrics(), "pipeserve:router_retries_total") or 0.0
    c.slots[1].kill(grace_s=5.0)  # still Ready in status, and in the router until its next poll
    for _ in range(4):  # round-robin: some of these are sent to the dead group first
        t0 = time.monotonic()
        c.serves()
        assert time.monotonic() - t0 < 15.0
    assert (metric(c.metrics(), "pipeserve:router_retries_total") or 0.0) > retries


def test_deleting_the_pipeline_stops_routing(cluster: Cluster) -> None:
    c = cluster
    c.api.set_groups([(0, "Ready", c.endpoint(0))])
    wait_http(c.url + "/health", 15)
    c.api.delete()
    wait_http(c.url + "/health", 3, status=503)
    _unavailable(c)
    assert c.ready("group-0") is None


def test_ready_targets_reads_only_ready_groups_with_an_endpoint() -> None:
    status = {
        "groups": [
            {"index": 0, "phase": "Ready", "endpoint": "p-g0-0.p-g0.ns.svc:50051"},
            {"index": 1, "phase": "Restarting", "endpoint": "p-g1-0.p-g1.ns.svc:50051"},
            {"index": 2, "phase": "Ready"},
            {"index": 3, "phase": "Ready", "endpoint": "no-port"},
            {"index": 4, "phase": "Ready", "endpoint": "h:50051"},
        ]
    }
    assert ready_targets({"status": status}) == {"group-0": "p-g0-0.p-g0.ns.svc:50051", "group-4": "h:50051"}
    assert ready_targets(None) == {} and ready_targets({"metadata": {"name": NAME}}) == {}


def test_bad_discovery_settings_are_refused(llama_dir: Path) -> None:
    base = [sys.executable, "-m", "pipeserve.cli", "router", "--model", str(llama_dir)]
    for extra, field in (
        (["--discover", "kubernetes", "--namespace", NS], "pipeline"),
        (["--discover", "kubernetes", "--pipeline", NAME, "--namespace", "Bad_NS"], "namespace"),
    ):
        r = subprocess.run(base + extra, capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and field in r.stderr, (extra, r.stderr)


def test_a_removed_group_finishes_its_streams(llama_dir: Path) -> None:
    from tokenizers import Tokenizer

    words = Tokenizer.from_file(str(llama_dir / "tokenizer.json")).encode(" one two three four" * 5).ids
    stage = ScriptedStage(words[:20])
    stage.token_delay_s = 0.1
    with RouterHarness(llama_dir, {"g0": stage}) as h:
        body = {"model": str(llama_dir), "prompt": [1, 2, 3], "max_tokens": 20, "stream": True}
        seen: list[str] = []
        with httpx.stream("POST", h.url + "/v1/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line:
                    continue
                seen.append(line)
                if len(seen) == 3:  # mid-stream: the group is scaled away
                    h.call(lambda: h.replicas.set_targets({}))
                    assert httpx.get(h.url + "/health", timeout=5).status_code == 503
        assert seen[-1] == "data: [DONE]" and stage.cancelled == 0, seen[-3:]
        finishes = [ln for ln in seen if '"finish_reason":"length"' in ln]
        assert len(finishes) == 1, seen[-3:]
        # Its last stream ended: the poller stops and the channel closes (no more Health calls).
        wait_until(lambda: not h.replicas._retiring, 5, "the removed group closed")
        r = httpx.post(h.url + "/v1/completions", json={**body, "stream": False}, timeout=10)
        assert r.status_code == 503, r.text
