"""The Dockerfiles (docker/) and the commands the chart and the operator run, checked against the CLI.

No Docker daemon runs here, so nothing is built; what can be checked without one is:
* every FROM is pinned (a versioned tag or a digest, never `latest`; a later stage may start FROM an
  earlier stage's name), the final USER is uid 10001 (not root), no HEALTHCHECK (the probes do it),
  the ENTRYPOINT is a `pipeserve <sub>` or `pipeserve-operator` command (exec form);
* every `pipeserve <sub>` used by a Dockerfile, the chart's Deployments or the operator's StatefulSet
  answers `--help` for real (the installed console scripts), and every flag they pass parses with the
  real argparse parser (`pipeserve.cli.build_parser`, `pipeserve_operator.main.build_parser`);
* the router and operator images carry no torch, safetensors or transformers: the CLI's whole parser,
  a real `pipeserve router --upstream` process (health, OpenAI-shaped errors, SIGTERM), and the
  operator's `--help` and StatefulSet builder run under a Python whose imports of those fail, and
  load no module that runs a model (the same rule, read from the source: tests/test_import_graph.py).
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import httpx
import pytest
from chart_support import ROOT, Tools, k8s_tools
from crd_support import render

from pipeserve.cli import build_parser
from pipeserve.local.ports import free_port
from pipeserve_operator.main import build_parser as operator_parser
from serving_support import wait_http

DOCKERFILES = sorted((ROOT / "docker").glob("*.Dockerfile"))
BIN = Path(sys.executable).parent


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) per instruction: continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in path.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line.rstrip("\\").strip() + " "
        if not line.endswith("\\"):
            word, _, rest = pending.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
            pending = ""
    return out


def test_there_are_the_four_images() -> None:
    names = {p.name for p in DOCKERFILES}
    assert names == {"stage.Dockerfile", "stage-cpu.Dockerfile", "router.Dockerfile", "operator.Dockerfile"}


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_rules(path: Path) -> None:
    ins = instructions(path)
    stages: set[str] = set()
    froms = [rest for word, rest in ins if word == "FROM"]
    assert len(froms) >= 2, "multi-stage: a builder and a runtime"
    for rest in froms:
        image, *alias = rest.split()
        if image.lower() not in stages:
            tag = image.partition(":")[2]
            assert "@sha256:" in image or re.search(r"\d", tag), f"unpinned base {image}"
            assert "latest" not in tag, image
        if alias:
            assert alias[0].upper() == "AS", rest
            stages.add(alias[1].lower())
    assert not [w for w, _ in ins if w == "HEALTHCHECK"], "Kubernetes probes do health, not the image"
    users = [rest for word, rest in ins if word == "USER"]
    assert users and users[-1].split(":")[0] == "10001", users
    final = ins[max(i for i, (w, _) in enumerate(ins) if w == "FROM") :]
    assert any(w == "USER" for w, _ in final), "the runtime stage sets USER"
    (entry,) = [json.loads(rest) for word, rest in final if word == "ENTRYPOINT"]
    assert entry[0] in ("pipeserve", "pipeserve-operator"), entry
    assert not [w for w, _ in final if w == "CMD"]


def test_the_cuda_stage_image_can_build_tritons_launcher() -> None:
    """Triton compiles its launcher with the system C compiler at the first kernel launch, in the pod:
    the runtime stage of the CUDA image installs gcc, libc headers and Python.h of its own Python."""
    ins = instructions(ROOT / "docker" / "stage.Dockerfile")
    final = ins[max(i for i, (w, _) in enumerate(ins) if w == "FROM") :]
    installed = set()
    for word, rest in final:
        if word == "RUN" and "apt-get install" in rest:
            installed |= set(rest.split("apt-get install", 1)[1].split("&&")[0].split())
    pythons = {m for _, rest in ins for m in re.findall(r"python3\.\d+(?=\s|$)", rest)}
    assert len(pythons) == 1, pythons  # the one interpreter the venv is made with
    for package in ("gcc", "libc6-dev", f"{pythons.pop()}-dev"):
        assert package in installed, f"the runtime stage does not install {package}: {sorted(installed)}"


def test_the_stage_command_sets_device_and_rendezvous_deadline() -> None:
    gpu = _demo_pipeline()
    gpu["spec"]["resources"] = {"limits": {"nvidia.com/gpu": 1}}
    for body, device in ((_demo_pipeline(), "cpu"), (gpu, "cuda")):
        (c,) = render(body, 0, 1)["spec"]["template"]["spec"]["containers"]
        ns = build_parser().parse_args([*c["command"][1:], *c["args"]])
        assert (ns.device, ns.connect_timeout_s) == (device, 900)


def _demo_pipeline() -> dict:
    """A pipeline that exercises every field the operator turns into a stage argument."""
    s = {
        "model": {"path": "/models/demo", "persistentVolumeClaim": "models"},
        "stages": 2,
        "replicas": 1,
        "image": "pipeserve/stage-cpu:0.1.0",
        "layerSplit": [1, 1],
        "engine": {"max-num-seqs": 16, "dtype": "float32", "enable-prefix-caching": True},
        "hicache": {"url": "redis://r:6379/0", "hostCacheGB": 0.5},
        "wedgeTimeoutSeconds": 30,
    }
    meta = {"name": "demo", "namespace": "ml", "uid": "u1"}
    return {"apiVersion": "pipeserve.io/v1alpha1", "kind": "InferencePipeline", "metadata": meta, "spec": s}


def _commands(tools: Tools) -> list[list[str]]:
    """command + args of every container the chart and the operator run, and each image's ENTRYPOINT."""
    out = []
    chart = ("--set", "example.enabled=true", "--set", "router.policy=least_load")
    for o in tools.objects(*chart, "--set", "router.toolCallParser=hermes"):
        if o["kind"] == "Deployment":
            out += [c["command"] + c.get("args", []) for c in o["spec"]["template"]["spec"]["containers"]]
    sts = render(_demo_pipeline(), 0, 1)
    out += [c["command"] + c["args"] for c in sts["spec"]["template"]["spec"]["containers"]]
    for path in DOCKERFILES:
        out += [json.loads(rest) for word, rest in instructions(path) if word == "ENTRYPOINT"]
    return out


@pytest.fixture(scope="module")
def commands() -> list[list[str]]:
    return _commands(k8s_tools())


def test_every_pipeserve_subcommand_used_answers_help(commands: list[list[str]]) -> None:
    used = {tuple(c[:2]) if c[0] == "pipeserve" else (c[0],) for c in commands if c[0] != "redis-server"}
    assert used == {("pipeserve", "stage"), ("pipeserve", "router"), ("pipeserve-operator",)}, used
    for cmd in sorted(used):
        argv = [str(BIN / cmd[0]), *cmd[1:], "--help"]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and "usage:" in r.stdout, (cmd, r.stderr[-2000:])


def test_every_flag_passed_is_known_to_the_parser(commands: list[list[str]]) -> None:
    parsed = 0
    for cmd in commands:
        if cmd[0] == "pipeserve":
            ns = build_parser().parse_args(cmd[1:])  # SystemExit(2) on an unknown flag or a bad value
            assert ns.command == cmd[1]
        elif cmd[0] == "pipeserve-operator":
            operator_parser().parse_args(cmd[1:])
        else:
            continue
        parsed += 1
    assert parsed >= 6


def test_the_router_command_is_the_contracts(commands: list[list[str]]) -> None:
    (router,) = [c for c in commands if c[:2] == ["pipeserve", "router"] and len(c) > 2]
    ns = build_parser().parse_args(router[1:])
    got = (ns.host, ns.port, ns.discover, ns.namespace, ns.pipeline)
    assert got == ("0.0.0.0", 8000, "kubernetes", "ml", "demo")
    # No --policy: the pipeline's spec.router.policy (least_load here, from router.policy) is followed live.
    assert ns.model == "/models/demo" and ns.policy is None and ns.tool_call_parser == "hermes"
    (stage,) = [c for c in commands if c[:2] == ["pipeserve", "stage"] and len(c) > 2]
    ns = build_parser().parse_args(stage[1:])
    assert (ns.world_size, ns.host, ns.health_port, ns.grpc_port) == (2, "0.0.0.0", 8080, 50051)
    assert ns.max_num_seqs == 16 and ns.dtype == "float32" and ns.enable_prefix_caching is True


def test_the_wheel_holds_every_package() -> None:
    """The images install pipeserve as a wheel (`pip install --no-deps .`), which holds only the packages
    pyproject.toml lists; the editable install of the tests finds every folder, so only this sees one
    missing (pipeserve.care was: the operator image could not start)."""
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(conf["packages"])
    for name, folder in conf["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            assert ".".join((name, *rel)) in listed, f"{init.parent} is not in pyproject's packages"


def test_the_wheel_holds_the_operators_data_files() -> None:
    """A file the operator reads at run time (corev1_types.json: the CRD's core/v1 schemas) is in the
    wheel only when pyproject's package-data names it."""
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = conf["package-data"].get("pipeserve_operator", [])
    folder = ROOT / conf["package-dir"]["pipeserve_operator"]
    data = [f.name for f in folder.iterdir() if f.is_file() and f.suffix not in (".py", ".pyc")]
    assert data, "the operator reads corev1_types.json"
    for name in data:
        assert any(fnmatch.fnmatch(name, p) for p in patterns), f"{name} is not in package-data"


# The router and operator images carry no torch, safetensors or transformers (docker/): their processes
# run here under a Python where importing any of them fails, as it would in the image. At exit the child
# writes which pipeserve modules it loaded, so a lazy import that reaches the model at serve time shows.
NO_TORCH = """
import atexit, json, os, sys
BLOCKED = ("torch", "safetensors", "transformers")
for name in BLOCKED:
    sys.modules[name] = None  # `import torch` raises ImportError, as in an image without it

def _report():  # at exit, or earlier when called (once)
    atexit.unregister(_report)
    with open(os.environ["PIPESERVE_TEST_MODULES"], "w") as f:
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("pipeserve", "pipeserve_operator"))
        blocked = {n: sys.modules.get(n, "gone") is None for n in BLOCKED}
        json.dump({"loaded": loaded, "blocked": blocked}, f)

atexit.register(_report)
"""
# What runs a model: none of it may load in the router or the operator (tests/test_import_graph.py
# checks the same from the source).
MODEL_MODULES = (  # these packages and their modules (pipeserve.stage_flags is not one)
    "pipeserve.engine",
    "pipeserve.model.",
    "pipeserve.ring",
    "pipeserve.stage",
    "pipeserve.hicache",
)


# Model modules that import no torch and that the CLI's parser reads: the demo's spec, and the
# registry's index of architectures (`demo-model --arch` choices; each arch module loads on demand).
TORCH_FREE_MODEL_MODULES = ("pipeserve.model.demo_spec", "pipeserve.model.arch")


def _no_torch(code: str, tmp: Path) -> tuple[list[str], dict[str, str], Path]:
    """argv and env that run `code` under the no-torch Python; the file it reports its modules to."""
    report = tmp / f"modules-{len(list(tmp.glob('modules-*')))}.json"
    return (
        [sys.executable, "-c", NO_TORCH + code],
        {**os.environ, "PIPESERVE_TEST_MODULES": str(report)},
        report,
    )


def _loaded(report: Path) -> list[str]:
    got = json.loads(report.read_text())
    assert all(got["blocked"].values()), f"something undid the block: {got['blocked']}"
    heavy = [
        m
        for m in got["loaded"]
        if any(m == p or m.startswith(p.rstrip(".") + ".") for p in MODEL_MODULES)
        and m not in TORCH_FREE_MODEL_MODULES
    ]
    assert heavy == [], f"model modules loaded without torch: {heavy}"
    return got["loaded"]


def _run(code: str, tmp: Path) -> tuple[subprocess.CompletedProcess, list[str]]:
    argv, env, report = _no_torch(code, tmp)
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return r, _loaded(report)


def test_the_router_starts_without_torch(tmp_path: Path) -> None:
    """Every subcommand's --help (the whole CLI parser, `up`'s included) and `import pipeserve`."""
    code = """
import pipeserve
assert pipeserve.__all__ == ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
from pipeserve.cli import build_parser
for sub in ("router", "stage", "up", "generate", "demo-model", "convert-gguf", "bench"):
    try:
        build_parser().parse_args([sub, "--help"])
    except SystemExit as e:
        assert e.code == 0, (sub, e.code)
_report()  # what the parsers loaded; the failed import below leaves a partial pipeserve.ring behind
try:
    pipeserve.LLM  # the offline engine needs torch: resolved on use, so this fails here, cleanly
except ImportError as e:
    print("LLM:", e)
else:
    raise AssertionError("LLM resolved without torch")
"""
    r, _ = _run(code, tmp_path)
    assert "usage: pipeserve up" in r.stdout and "usage: pipeserve router" in r.stdout
    assert "LLM: import of torch halted" in r.stdout, r.stdout[-500:]


def _openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    return err


def test_the_router_serves_without_torch(llama_dir: Path, tmp_path: Path) -> None:
    """A real `pipeserve router --upstream` process (tokenizer files only, no group listening there):
    /health says 503, requests get OpenAI-shaped errors (not a crash, not a hang), SIGTERM exits 0, and
    nothing that runs a model was loaded on the way."""
    tok = tmp_path / "tokenizer-only"
    tok.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(llama_dir / name, tok / name)
    port, upstream = free_port(), free_port()  # nothing listens on `upstream`: no group is ready
    args = ["router", "--upstream", f"127.0.0.1:{upstream}", "--tokenizer", str(tok), "--host", "127.0.0.1"]
    args += ["--port", str(port), "--drain-timeout-s", "2"]
    argv, env, report = _no_torch(f"from pipeserve.cli import main\nsys.exit(main({args!r}))\n", tmp_path)
    log = tmp_path / "router.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        health = wait_http(url + "/health", 60, status=503, alive=lambda: proc.poll())
        assert health.json()["error"]["code"] == "service_unavailable"
        models = httpx.get(url + "/v1/models", timeout=10)
        assert models.status_code == 200 and models.json()["data"][0]["id"] == str(tok), models.text
        chat = {"model": str(tok), "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        err = _openai_error(httpx.post(url + "/v1/chat/completions", json=chat, timeout=30), 503)
        assert err["type"] == "server_error", err
        body = {"model": str(tok), "prompt": "hi", "max_tokens": 4, "stream": True}
        _openai_error(httpx.post(url + "/v1/completions", json=body, timeout=30), 503)
        _openai_error(httpx.post(url + "/v1/completions", json={**body, "model": "nope"}, timeout=30), 404)
        assert httpx.get(url + "/metrics", timeout=10).status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
            raise AssertionError("the router did not exit within 30 s of SIGTERM") from None
    assert proc.returncode == 0, log.read_text()[-3000:]
    loaded = _loaded(report)
    assert "pipeserve.router.http.app" in loaded and "pipeserve.tokenizer" in loaded, loaded  # it did serve


def test_the_operator_runs_without_torch(tmp_path: Path) -> None:
    """`pipeserve-operator --help` (the module the console script runs) and the group's StatefulSet,
    whose engine flags the operator checks with the stage's own parser, under the no-torch Python."""
    code = f"""
import runpy
sys.argv = ["pipeserve-operator", "--help"]
try:
    runpy.run_module("pipeserve_operator", run_name="__main__")
except SystemExit as e:
    assert e.code == 0, e.code
from pipeserve_operator import spec as spec_model
from pipeserve_operator.crd import with_defaults
from pipeserve_operator.resources import stage_statefulset
body = {_demo_pipeline()!r}
sts = stage_statefulset(body, spec_model.parse(with_defaults(body["spec"])), 0, 1)
print("STS=" + json.dumps(sts, sort_keys=True))
"""
    r, loaded = _run(code, tmp_path)
    assert "usage: pipeserve-operator" in r.stdout, r.stdout[-2000:]
    (line,) = [x for x in r.stdout.splitlines() if x.startswith("STS=")]
    assert json.loads(line[4:]) == render(_demo_pipeline(), 0, 1)  # the same as with torch
    assert "pipeserve.stage_flags" in loaded and "pipeserve.care.restarts" in loaded, loaded
    # Neither the CLI (its other subcommands) nor the local launch side (tests/test_import_graph.py).
    assert not {m for m in loaded if m == "pipeserve.cli" or m.startswith("pipeserve.local")}, loaded
    # ... nor the router's libraries, which its image (docker/operator.Dockerfile) does not install.
    assert not {m for m in loaded if m.split(".")[0] in ("fastapi", "uvicorn", "prometheus_client")}, loaded
