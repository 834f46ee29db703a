"""Several pipelines behind one router (`pipeserve router --models FILE`), and spec.router.policy.

A real `pipeserve router --discover kubernetes --models FILE` process watches two InferencePipelines
served by kmock's KubernetesEmulator (real HTTP, the real `kubernetes` client); each pipeline has two
groups, scripted stage 0s over real gRPC whose replies say which pipeline answered:
* /v1/models lists both served names; a request's `model` picks its pipeline; an unknown model is a
  404 `model_not_found` in OpenAI's shape, the router unharmed; /metrics labels samples by model_name;
* spec.router.policy (prefix_affinity) is applied to a pipeline whose entry names no policy (the same
  prompt always lands on one group) and followed live when the CR changes; an entry's own policy
  (round_robin) wins over its pipeline's;
* single-model mode (`--pipeline`) applies the pipeline's policy too, unless --policy names one;
* a bad --models file exits 2 naming the entry and field;
* (slow) live: a llama and a qwen2 demo group, each its own InferencePipeline, behind one router:
  each model's greedy ids equal transformers' for its own checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from conftest import hf_greedy
from pipeserve.local.ports import free_port
from router_support import ScriptedStage
from serving_support import live_group, metric, wait_http, wait_until

NS = "serving"
BASE = f"/apis/pipeserve.io/v1alpha1/namespaces/{NS}/inferencepipelines"
MERGE = {"content-type": "application/merge-patch+json"}
PROMPT = [5, 17, 300, 42, 7, 99, 123, 8]
REPLY = {"alpha": [11, 12, 13], "beta": [21, 22, 23]}


class Api:
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

    def __enter__(self) -> Api:
        self._thread.start()
        wait_until(lambda: self.url, 30, "kmock serving")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    def pipeline(self, name: str, endpoints: list[str], policy: str | None) -> None:
        spec: dict = {"stages": 1, **({"router": {"policy": policy}} if policy else {})}
        body = {"apiVersion": "pipeserve.io/v1alpha1", "kind": "InferencePipeline"}
        body |= {"metadata": {"name": name, "namespace": NS}, "spec": spec}
        r = httpx.post(self.url + BASE, json=body, timeout=10)
        assert r.status_code == 200, r.text
        groups = [{"index": i, "phase": "Ready", "endpoint": e} for i, e in enumerate(endpoints)]
        r = httpx.patch(f"{self.url}{BASE}/{name}/status", json={"status": {"groups": groups}}, headers=MERGE)
        assert r.status_code == 200, r.text

    def set_policy(self, name: str, policy: str) -> None:
        patch = {"spec": {"router": {"policy": policy}}}
        r = httpx.patch(f"{self.url}{BASE}/{name}", json=patch, headers=MERGE, timeout=10)
        assert r.status_code == 200, r.text


class Stages:
    """Scripted stage 0s (two groups per pipeline) served from one background loop."""

    def __init__(self) -> None:
        self.by_pipeline = {p: [ScriptedStage(r), ScriptedStage(r)] for p, r in REPLY.items()}
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> Stages:
        self._thread.start()
        for s in self.all():
            asyncio.run_coroutine_threadsafe(s.start(), self.loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        for s in self.all():
            asyncio.run_coroutine_threadsafe(s.stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    def all(self) -> list[ScriptedStage]:
        return [s for stages in self.by_pipeline.values() for s in stages]

    def counts(self, pipeline: str) -> list[int]:
        return [len(s.requests) for s in self.by_pipeline[pipeline]]


def _router_argv(api: Api, port: int, *args: str) -> list[str]:
    argv = [sys.executable, "-m", "pipeserve.cli", "router", "--port", str(port), "--discover", "kubernetes"]
    return [*argv, "--kube-api", api.url, "--namespace", NS, "--health-interval-s", "0.2", *args]


@contextlib.contextmanager
def router(argv: list[str], log: Path, env: dict[str, str] | None = None) -> Iterator[str]:
    port = int(argv[argv.index("--port") + 1])
    env = {**os.environ, **(env or {})}
    proc = subprocess.Popen(argv, stdout=open(log, "ab"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/health", 60, alive=lambda: proc.poll())
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        wait_until(lambda: proc.poll() is not None, 30, "the router exiting")
    assert proc.returncode == 0, log.read_text()[-3000:]


def complete(url: str, model: str, prompt: list[int] = PROMPT) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": 3, "temperature": 0, "return_token_ids": True}
    return httpx.post(url + "/v1/completions", json=body, timeout=30)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Api, Stages]]:
    with Api() as api, Stages() as stages:
        for name in REPLY:
            api.pipeline(name, [s.target for s in stages.by_pipeline[name]], "prefix_affinity")
        yield api, stages


def _spread(url: str, stages: Stages, pipeline: str, model: str, n: int = 6) -> list[int]:
    """The requests each of the pipeline's groups got out of `n` with the same prompt."""
    before = stages.counts(pipeline)
    for _ in range(n):
        r = complete(url, model)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == REPLY[pipeline], r.text
    return [a - b for a, b in zip(stages.counts(pipeline), before, strict=True)]


def test_models_file_routes_by_model(cluster: tuple[Api, Stages], llama_dir: Path, tmp_path: Path) -> None:
    api, stages = cluster
    models = [
        {"name": "alpha", "model": "model-a", "tokenizer": str(llama_dir), "policy": "round_robin"},
        {"name": "beta", "model": "model-b", "tokenizer": str(llama_dir)},
    ]
    path = tmp_path / "models.yaml"
    path.write_text(yaml.safe_dump(models))
    with router(_router_argv(api, free_port(), "--models", str(path)), tmp_path / "router.log") as url:
        wait_until(lambda: httpx.get(url + "/health").json()["ready_groups"] == {"model-a": 2, "model-b": 2})
        listing = httpx.get(url + "/v1/models", timeout=10).json()
        assert [m["id"] for m in listing["data"]] == ["model-a", "model-b"]
        assert complete(url, "model-a").json()["choices"][0]["token_ids"] == REPLY["alpha"]
        assert complete(url, "model-b").json()["choices"][0]["token_ids"] == REPLY["beta"]
        chat = {"model": "model-b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        r = httpx.post(url + "/v1/chat/completions", json=chat, timeout=30)
        assert r.status_code == 200 and r.json()["model"] == "model-b", r.text
        stream = {"model": "model-a", "prompt": PROMPT, "max_tokens": 3, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=stream, timeout=30) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert r.status_code == 200 and events[-1] == "data: [DONE]", events
        assert all('"model":"model-a"' in e.replace(" ", "") for e in events[:-1]), events
        # Unknown model: OpenAI's 404, nothing routed, the router still serves.
        n = sum(len(s.requests) for s in stages.all())
        r = complete(url, "model-c")
        assert r.status_code == 404, r.text
        assert r.json()["error"]["code"] == "model_not_found" and r.json()["error"]["param"] == "model"
        assert "model-c" in r.json()["error"]["message"]
        assert sum(len(s.requests) for s in stages.all()) == n
        assert complete(url, "model-a").status_code == 200
        # Policies: the entry's own (round_robin) wins over alpha's CR; beta follows its CR's
        # prefix_affinity (one group for one prompt), then the CR's change, live.
        assert 0 not in _spread(url, stages, "alpha", "model-a")
        assert sorted(_spread(url, stages, "beta", "model-b")) == [0, 6]
        api.set_policy("beta", "round_robin")
        wait_until(lambda: 0 not in _spread(url, stages, "beta", "model-b", 2), 10, "beta's new policy")
        text = httpx.get(url + "/metrics", timeout=10).text
        for model in ("model-a", "model-b"):
            assert metric(text, "pipeserve:router_group_ready", group="group-0", model_name=model) == 1.0
        api.set_policy("beta", "prefix_affinity")


def test_single_model_applies_the_pipelines_policy(
    cluster: tuple[Api, Stages], llama_dir: Path, tmp_path: Path
) -> None:
    api, stages = cluster
    argv = _router_argv(
        api, free_port(), "--pipeline", "beta", "--tokenizer", str(llama_dir), "--served-model-name", "x"
    )
    with router(argv, tmp_path / "r1.log") as url:
        wait_until(lambda: httpx.get(url + "/health").json()["ready_groups"] == 2, 30, "both groups")
        assert sorted(_spread(url, stages, "beta", "x")) == [0, 6]
    argv = _router_argv(
        api, free_port(), "--pipeline", "beta", "--tokenizer", str(llama_dir), "--served-model-name", "x"
    )
    with router([*argv, "--policy", "round_robin"], tmp_path / "r2.log") as url:
        wait_until(lambda: httpx.get(url + "/health").json()["ready_groups"] == 2, 30, "both groups")
        assert 0 not in _spread(url, stages, "beta", "x")


def test_static_models_file(cluster: tuple[Api, Stages], llama_dir: Path, tmp_path: Path) -> None:
    """--discover static: each entry names its stage 0 addresses (`upstream`) instead of a pipeline."""
    _, stages = cluster
    models = [
        {"model": f"s-{p}", "tokenizer": str(llama_dir), "upstream": ",".join(s.target for s in group)}
        for p, group in stages.by_pipeline.items()
    ]
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(models))
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "pipeserve.cli",
        "router",
        "--port",
        str(port),
        "--models",
        str(tmp_path / "m.yaml"),
    ]
    key = {"PIPESERVE_API_KEY": "sekret"}
    auth = {"Authorization": "Bearer sekret"}
    with router([*argv, "--health-interval-s", "0.2"], tmp_path / "router.log", key) as url:
        wait_until(
            lambda: httpx.get(url + "/health").json()["ready_groups"] == {"s-alpha": 2, "s-beta": 2}, 30
        )
        body = {"model": "s-alpha", "prompt": PROMPT, "max_tokens": 3, "return_token_ids": True}
        for p in REPLY:
            r = httpx.post(url + "/v1/completions", json={**body, "model": f"s-{p}"}, headers=auth)
            assert r.json()["choices"][0]["token_ids"] == REPLY[p], r.text
        # The API key first: without it every model, known or not, and the listing are 401.
        for model in ("s-alpha", "nope"):
            r = httpx.post(url + "/v1/completions", json={**body, "model": model})
            assert r.status_code == 401, r.text
        assert httpx.get(url + "/v1/models").status_code == 401
        assert (
            httpx.post(url + "/v1/completions", json={**body, "model": "nope"}, headers=auth).status_code
            == 404
        )
        assert len(httpx.get(url + "/v1/models", headers=auth).json()["data"]) == 2
    (tmp_path / "m.yaml").write_text(yaml.safe_dump([{**models[0], "name": "alpha"}]))
    r = subprocess.run([*argv, "--discover", "static"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "models[0].name: is for --discover kubernetes only" in r.stderr, r.stderr


BAD_FILES = {
    "not a list": ({"model": "m"}, "models: must be a non-empty list"),
    "unknown key": ([{"name": "a", "model": "m", "tokenizer": "T", "colour": "x"}], "models[0].colour"),
    "no tokenizer": ([{"name": "a", "model": "m"}], "models[0].tokenizer: required"),
    "bad tokenizer": ([{"name": "a", "model": "m", "tokenizer": "/nope"}], "models[0].tokenizer"),
    "bad policy": ([{"name": "a", "model": "m", "tokenizer": "T", "policy": "random"}], "models[0].policy"),
    "no pipeline": ([{"model": "m", "tokenizer": "T"}], "models[0].name: required"),
    "bad pipeline": ([{"name": "A_b", "model": "m", "tokenizer": "T"}], "models[0].name"),
    "twice": (
        [{"name": "a", "model": "m", "tokenizer": "T"}, {"name": "b", "model": "m", "tokenizer": "T"}],
        "models[1].model",
    ),
}


@pytest.mark.parametrize("case", BAD_FILES)
def test_a_bad_models_file_is_refused(case: str, llama_dir: Path, tmp_path: Path) -> None:
    data, want = BAD_FILES[case]
    text = yaml.safe_dump(data).replace(": T\n", f": {llama_dir}\n")
    (tmp_path / "m.yaml").write_text(text)
    argv = [sys.executable, "-m", "pipeserve.cli", "router", "--discover", "kubernetes", "--namespace", NS]
    r = subprocess.run(
        [*argv, "--models", str(tmp_path / "m.yaml")], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2 and want in r.stderr, r.stderr


def test_models_replaces_the_single_model_flags(llama_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "m.yaml").write_text(
        yaml.safe_dump([{"name": "a", "model": "m", "tokenizer": str(llama_dir)}])
    )
    argv = [sys.executable, "-m", "pipeserve.cli", "router", "--discover", "kubernetes", "--namespace", NS]
    argv += ["--models", str(tmp_path / "m.yaml"), "--pipeline", "a"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--models replaces --pipeline" in r.stderr, r.stderr


@pytest.mark.slow
def test_two_live_pipelines_behind_one_router(llama_dir: Path, qwen2_dir: Path, tmp_path: Path) -> None:
    dirs = {"alpha": llama_dir, "beta": qwen2_dir}
    want = {name: hf_greedy(d, PROMPT, 6) for name, d in dirs.items()}
    assert want["alpha"] != want["beta"]  # else routing by model would prove nothing
    models = [{"name": n, "model": f"m-{n}", "tokenizer": str(d)} for n, d in dirs.items()]
    (tmp_path / "models.json").write_text(json.dumps(models))  # JSON is YAML too
    with contextlib.ExitStack() as stack:
        api = stack.enter_context(Api())
        for name, d in dirs.items():
            slot = stack.enter_context(live_group(d, 1, tmp_path / name))
            api.pipeline(name, [slot.grpc_target], None)
        argv = _router_argv(api, free_port(), "--models", str(tmp_path / "models.json"))
        url = stack.enter_context(router(argv, tmp_path / "router.log"))
        wait_until(
            lambda: httpx.get(url + "/health").json()["ready_groups"] == {"m-alpha": 1, "m-beta": 1}, 60
        )
        for name in dirs:
            body = {"model": f"m-{name}", "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
            r = httpx.post(url + "/v1/completions", json={**body, "return_token_ids": True}, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == want[name], name
