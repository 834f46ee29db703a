"""The manifests are runnable: the operator's StatefulSet for a 2-stage, 1-replica pipeline of the demo
model and the chart's router Deployment, their containers' command + args + env run as local processes.
The two stages form their group through the TCP-store rendezvous pods use (MASTER_ADDR/MASTER_PORT;
torch's store listens on every interface: acceptable here, on a random port for the test's duration),
both become ready on /readyz, and the router serves an OpenAI completion over them.

Exactly what is substituted (everything else is run as rendered):
* command[0] `pipeserve` -> this venv's console script (the same entry point the image's PATH finds);
* the model path (`--model` and the router's `--tokenizer`, `/models/demo` in the manifests) -> the
  local demo checkpoint (its tokenizer files are the router's "tokenizer directory");
* `--host 0.0.0.0` -> 127.0.0.1; ports (`--health-port 8080`, `--grpc-port 50051`, the router's
  `--port 8000`, env MASTER_PORT 29500) -> free ports, one set per process (pods each have their own);
* env fieldRef `metadata.labels['apps.kubernetes.io/pod-index']` (PIPESERVE_RANK) -> the rank by hand;
  env MASTER_ADDR (pod 0's DNS name through the headless Service) -> 127.0.0.1;
* the router's `--discover kubernetes` -> `--upstream <stage 0's gRPC address>` (the only argument
  swapped; --namespace/--pipeline stay, unused by static discovery).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from chart_support import k8s_tools
from crd_support import render

from pipeserve.local.ports import free_port
from serving_support import wait_http, wait_until

BIN = Path(sys.executable).parent
MODEL_IN_POD = "/models/demo"
POD_INDEX = "metadata.labels['apps.kubernetes.io/pod-index']"


def _pipeline() -> dict:
    spec = {
        "model": {"path": MODEL_IN_POD},
        "stages": 2,
        "replicas": 1,
        "image": "pipeserve/stage-cpu:0.1.0",
        "engine": {"dtype": "float32", "num-threads": 1, "num-kv-blocks": 256},
    }
    return {"apiVersion": "pipeserve.io/v1alpha1", "kind": "InferencePipeline",
            "metadata": {"name": "demo", "namespace": "ml", "uid": "u1"}, "spec": spec}  # fmt: skip


def _swap(args: list[str], flag: str, value: str) -> list[str]:
    i = args.index(flag)
    return [*args[: i + 1], value, *args[i + 2 :]]


def _stage_argv_env(container: dict, rank: int, model: Path, ports: dict[str, int]) -> tuple[list, dict]:
    assert container["command"] == ["pipeserve", "stage"]
    args = list(container["args"])
    assert args[args.index("--model") + 1] == MODEL_IN_POD and args[args.index("--host") + 1] == "0.0.0.0"
    args = _swap(args, "--model", str(model))
    args = _swap(args, "--host", "127.0.0.1")
    args = _swap(args, "--health-port", str(ports["health"]))
    args = _swap(args, "--grpc-port", str(ports["grpc"]))
    env = {}
    for e in container["env"]:
        if e["name"] == "PIPESERVE_RANK":
            assert e["valueFrom"]["fieldRef"]["fieldPath"] == POD_INDEX
            env[e["name"]] = str(rank)
        elif e["name"] == "MASTER_ADDR":
            assert e["value"] == "demo-g0-0.demo-g0.ml.svc"
            env[e["name"]] = "127.0.0.1"
        elif e["name"] == "MASTER_PORT":
            assert e["value"] == "29500"
            env[e["name"]] = str(ports["master"])
        else:
            assert "value" in e, e  # no other fieldRef/secret in this pipeline
            env[e["name"]] = e["value"]
    return [str(BIN / "pipeserve"), "stage", *args], env


def _router_argv(tokenizer: Path, port: int, upstream: str) -> list[str]:
    objects = k8s_tools().objects(
        "--set", f"router.tokenizer.path={MODEL_IN_POD}", "--set", "router.pipeline=demo"
    )
    (dep,) = [o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-router")]
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["pipeserve", "router"]
    args = list(c["args"])
    i = args.index("--discover")
    assert args[i + 1] == "kubernetes"
    args[i : i + 2] = ["--upstream", upstream]
    args = _swap(args, "--tokenizer", str(tokenizer))
    args = _swap(args, "--host", "127.0.0.1")
    args = _swap(args, "--port", str(port))
    return [str(BIN / "pipeserve"), "router", *args]


def _spawn(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with open(log, "wb") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)


@pytest.mark.slow
def test_rendered_stage_and_router_commands_serve(llama_dir: Path, tmp_path: Path) -> None:
    sts = render(_pipeline(), 0, 1)
    assert sts["spec"]["replicas"] == 2
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    master = free_port()
    ports = [{"health": free_port(), "grpc": free_port(), "master": master} for _ in range(2)]
    procs: list[subprocess.Popen] = []
    logs = [tmp_path / f"stage{r}.log" for r in range(2)] + [tmp_path / "router.log"]
    base_env = {k: v for k, v in os.environ.items() if not k.startswith(("PIPESERVE_", "MASTER_"))}

    def alive() -> object:
        dead = [(p.args[1], p.returncode) for p in procs if p.poll() is not None]
        return dead and (dead, [log.read_text()[-1500:] for log in logs if log.exists()])

    try:
        for rank in range(2):
            argv, env = _stage_argv_env(container, rank, llama_dir, ports[rank])
            procs.append(_spawn(argv, {**base_env, **env}, logs[rank]))
        for rank in range(2):
            wait_http(f"http://127.0.0.1:{ports[rank]['health']}/readyz", 180, alive=alive)
        port = free_port()
        argv = _router_argv(llama_dir, port, f"127.0.0.1:{ports[0]['grpc']}")
        procs.append(_spawn(argv, base_env, logs[2]))
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health", 60, alive=alive)
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        body = {
            "model": model,
            "prompt": [5, 17, 300, 42],
            "max_tokens": 4,
            "temperature": 0,
            "return_token_ids": True,
        }
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert len(choice["token_ids"]) == 4 and r.json()["usage"]["completion_tokens"] == 4
    finally:
        _stop(procs)
    wait_until(lambda: all(p.poll() is not None for p in procs), 5, "every process stopped")
