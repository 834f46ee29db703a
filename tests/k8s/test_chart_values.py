"""The chart's shaping values, rendered by the real helm (test_chart.py lints and validates every case
against Kubernetes 1.35; here: what each value does to the objects).

* operator.enabled=false: no operator Deployment (one operator per cluster, several releases), the
  router and the example pipeline still rendered; operator.drainSeconds / extraArgs reach its args.
* router.pipelines: a --models file in a ConfigMap that the router's own parser accepts, mounted, the
  pod rolled when it changes; a served name twice is refused.
* The router's shutdown: preStop sleep, then the drain, inside terminationGracePeriodSeconds;
  readiness needs three misses in a row.
* networkPolicy.metricsFrom opens the stages' metrics port to those peers, nothing else.
* redis.internal.auth.existingSecret: no Secret made, nothing generated: two renders are identical.
* autoscaling: a KEDA ScaledObject or an autoscaling/v2 HPA on the InferencePipeline's scale
  subresource, on stage 0's metric.
* values.schema.json refuses bad values of all of these.
"""

from __future__ import annotations

import json
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from chart_support import CHART, Tools, k8s_tools

from pipeserve.router.upstream.models_file import parse_models

EXAMPLE = ["--set", "example.enabled=true"]


@pytest.fixture(scope="module")
def tools() -> Tools:
    return k8s_tools()


def _find(objects: list[dict], kind: str, suffix: str) -> dict:
    return next(o for o in objects if o["kind"] == kind and o["metadata"]["name"].endswith(suffix))


def _router(objects: list[dict]) -> dict:
    return _find(objects, "Deployment", "-router")["spec"]["template"]["spec"]


def test_operator_disabled_renders_no_operator(tools: Tools) -> None:
    objects = tools.objects(*EXAMPLE, "--set", "operator.enabled=false")
    deployments = {o["metadata"]["name"] for o in objects if o["kind"] == "Deployment"}
    assert deployments == {"rel-pipeserve-router", "rel-pipeserve-redis"}
    assert {o["kind"] for o in objects} >= {"InferencePipeline", "Service"}
    operator_rbac = [o for o in objects if "-operator" in o["metadata"]["name"]]
    assert operator_rbac == [], [f"{o['kind']}/{o['metadata']['name']}" for o in operator_rbac]
    on = tools.objects(*EXAMPLE)
    assert "rel-pipeserve-operator" in {o["metadata"]["name"] for o in on if o["kind"] == "Deployment"}


def test_operator_drain_and_extra_args(tools: Tools) -> None:
    objects = tools.objects("--set", "operator.drainSeconds=45", "--set", "operator.extraArgs={--a,b}")
    args = _find(objects, "Deployment", "-operator")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[-4:] == ["--drain-seconds", "45", "--a", "b"]
    default = _find(tools.objects(), "Deployment", "-operator")["spec"]["template"]["spec"]
    assert default["containers"][0]["args"][-2:] == ["--drain-seconds", "30"]


def _pipelines(tmp_path: Path) -> list[dict]:
    for d in ("a", "b"):
        (tmp_path / d).mkdir(exist_ok=True)
    return [
        {"name": "alpha", "model": "model-a", "tokenizer": str(tmp_path / "a")},
        {
            "name": "beta",
            "model": "model-b",
            "tokenizer": str(tmp_path / "b"),
            "chatTemplate": "{{ messages }}",
        },
    ]


def test_router_pipelines_become_its_models_file(tools: Tools, tmp_path: Path) -> None:
    pipelines = _pipelines(tmp_path)
    objects = tools.objects("--set-json", f"router.pipelines={json.dumps(pipelines)}")
    text = _find(objects, "ConfigMap", "-router-models")["data"]["models.yaml"]
    assert yaml.safe_load(text) == pipelines
    entries = parse_models(yaml.safe_load(text), "kubernetes")  # the router's own reader accepts it
    assert [(e.pipeline, e.model, e.policy) for e in entries] == [
        ("alpha", "model-a", None),
        ("beta", "model-b", None),
    ]
    pod = _router(objects)
    args = pod["containers"][0]["args"]
    i = args.index("--models")
    assert args[i + 1] == "/etc/pipeserve/models.yaml"
    assert "--pipeline" not in args and "--tokenizer" not in args and "--served-model-name" not in args
    assert {"name": "models", "mountPath": "/etc/pipeserve", "readOnly": True} in pod["containers"][0][
        "volumeMounts"
    ]
    assert {"name": "models", "configMap": {"name": "rel-pipeserve-router-models"}} in pod["volumes"]
    # The pod rolls when the file changes.
    pipelines[1]["chatTemplate"] = "{{ messages[-1] }}"
    other = tools.objects("--set-json", f"router.pipelines={json.dumps(pipelines)}")
    sums = [
        _find(o, "Deployment", "-router")["spec"]["template"]["metadata"]["annotations"]["checksum/models"]
        for o in (objects, other)
    ]
    assert sums[0] != sums[1]
    # Without pipelines: the single pipeline, as before.
    single = _router(tools.objects())["containers"][0]["args"]
    assert single[single.index("--pipeline") + 1] == "demo" and "--models" not in single


def test_a_model_served_twice_is_refused(tools: Tools, tmp_path: Path) -> None:
    pipelines = _pipelines(tmp_path)
    pipelines[1]["model"] = "model-a"
    r = tools.template("--set-json", f"router.pipelines={json.dumps(pipelines)}", check=False)
    assert r.returncode != 0 and 'the model "model-a" is served twice' in r.stderr, r.stderr


@pytest.mark.parametrize("pre_stop", [5, 0])
def test_router_shutdown_and_readiness(tools: Tools, pre_stop: int) -> None:
    pod = _router(tools.objects("--set", f"router.preStopSleepSeconds={pre_stop}"))
    c = pod["containers"][0]
    drain = float(c["args"][c["args"].index("--drain-timeout-s") + 1])
    assert drain == 30
    if pre_stop:
        assert c["lifecycle"] == {"preStop": {"sleep": {"seconds": pre_stop}}}
    else:
        assert "lifecycle" not in c
    assert pod["terminationGracePeriodSeconds"] > pre_stop + drain
    assert c["readinessProbe"]["failureThreshold"] == 3
    assert c["readinessProbe"]["periodSeconds"] * 3 >= 15


def test_metrics_from_opens_the_stages_metrics_port(tools: Tools) -> None:
    peers = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    objects = tools.objects("--set-json", f"networkPolicy.metricsFrom={json.dumps(peers)}")
    policy = _find(objects, "NetworkPolicy", "-stage-metrics")["spec"]
    assert policy["podSelector"] == {
        "matchLabels": {"app.kubernetes.io/name": "pipeserve", "app.kubernetes.io/component": "stage"}
    }
    assert policy["ingress"] == [{"from": peers, "ports": [{"port": 8080, "protocol": "TCP"}]}]
    # Nothing selects the router: its port (the API and /metrics) stays open to monitoring too.
    for o in objects:
        if o["kind"] == "NetworkPolicy":
            assert o["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] != "router"
    assert not [o for o in tools.objects() if o["metadata"]["name"].endswith("-stage-metrics")]
    off = tools.objects(
        "--set", "networkPolicy.enabled=false", "--set-json", f"networkPolicy.metricsFrom={json.dumps(peers)}"
    )
    assert not [o for o in off if o["kind"] == "NetworkPolicy"]


def test_redis_existing_secret_renders_identically(tools: Tools) -> None:
    args = [*EXAMPLE, "--set", "redis.internal.auth.existingSecret=redis-auth"]
    first, second = (tools.template(*args).stdout for _ in range(2))
    assert first == second  # no generated password: Argo CD sees no drift
    objects = [o for o in yaml.safe_load_all(first) if o]
    assert not [o for o in objects if o["kind"] == "Secret"]
    redis = _find(objects, "Deployment", "-redis")["spec"]["template"]["spec"]["containers"][0]
    assert redis["env"][0]["valueFrom"]["secretKeyRef"] == {"name": "redis-auth", "key": "password"}
    cr = next(o for o in objects if o["kind"] == "InferencePipeline")
    assert cr["spec"]["hicache"] == {"secretRef": {"name": "redis-auth", "key": "url"}}
    keys = ["--set", "redis.internal.auth.passwordKey=pw", "--set", "redis.internal.auth.urlKey=u"]
    objects = tools.objects(*args, *keys)
    redis = _find(objects, "Deployment", "-redis")["spec"]["template"]["spec"]["containers"][0]
    assert redis["env"][0]["valueFrom"]["secretKeyRef"] == {"name": "redis-auth", "key": "pw"}
    assert (
        next(o for o in objects if o["kind"] == "InferencePipeline")["spec"]["hicache"]["secretRef"]["key"]
        == "u"
    )
    # Without it, a password is generated per render (read back with lookup on a live upgrade).
    assert tools.template(*EXAMPLE).stdout != tools.template(*EXAMPLE).stdout


def test_keda_scaled_object(tools: Tools) -> None:
    objects = tools.objects("--set", "autoscaling.keda.enabled=true", "--set", "autoscaling.maxReplicas=6")
    so = _find(objects, "ScaledObject", "-demo")
    assert so["apiVersion"] == "keda.sh/v1alpha1"
    spec = so["spec"]
    assert spec["scaleTargetRef"] == {
        "apiVersion": "pipeserve.io/v1alpha1",
        "kind": "InferencePipeline",
        "name": "demo",
    }
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (1, 6)
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "prometheus"
    assert set(trigger["metadata"]) == {"serverAddress", "query", "threshold"}
    assert (
        trigger["metadata"]["query"]
        == 'sum(pipeserve:num_requests_waiting{namespace="ml",pod=~"demo-g[0-9]+-[0-9]+"})'
    )
    assert trigger["metadata"]["threshold"] == "4"
    kv = _find(
        tools.objects("--set", "autoscaling.keda.enabled=true", "--set", "autoscaling.metric=kvUsage",
                      "--set", "autoscaling.pipeline=big"),
        "ScaledObject",
        "-big",
    )  # fmt: skip
    assert kv["spec"]["triggers"][0]["metadata"]["query"].startswith("sum(pipeserve:kv_cache_usage_perc{")
    assert kv["spec"]["scaleTargetRef"]["name"] == "big"
    assert not [o for o in tools.objects() if o["kind"] in ("ScaledObject", "HorizontalPodAutoscaler")]


def test_hpa_on_the_scale_subresource(tools: Tools) -> None:
    objects = tools.objects("--set", "autoscaling.hpa.enabled=true", "--set", "autoscaling.target=2")
    hpa = _find(objects, "HorizontalPodAutoscaler", "-demo")
    kubernetes_validate.validate(hpa, "1.35", strict=True)
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "pipeserve.io/v1alpha1",
        "kind": "InferencePipeline",
        "name": "demo",
    }
    (metric,) = hpa["spec"]["metrics"]
    assert metric == {
        "type": "External",
        "external": {
            "metric": {"name": "pipeserve:num_requests_waiting"},
            "target": {"type": "AverageValue", "averageValue": "2"},
        },
    }
    r = tools.template(
        "--set", "autoscaling.hpa.enabled=true", "--set", "autoscaling.minReplicas=5", check=False
    )
    assert r.returncode != 0 and "minReplicas must be <= maxReplicas" in r.stderr


BAD_VALUES = [
    ["--set", "operator.enabled=yes"],
    ["--set", "operator.drainSeconds=-1"],
    ["--set", "operator.extraArgs=--x"],
    ["--set", "router.preStopSleepSeconds=-5"],
    ["--set", "router.drainSeconds=lots"],
    ["--set", "router.pipelines[0].name=a"],  # no model, no tokenizer
    ["--set-json", 'router.pipelines=[{"name": "Bad_Name", "model": "m", "tokenizer": "/t"}]'],
    ["--set-json", 'router.pipelines=[{"name": "a", "model": "m", "tokenizer": "relative"}]'],
    # The policy is the pipeline's spec.router.policy, followed live: no pinned copy in the models file.
    [
        "--set-json",
        'router.pipelines=[{"name": "a", "model": "m", "tokenizer": "/t", "policy": "least_load"}]',
    ],
    ["--set", "example.placement.gang=kueue"],  # no queueName
    ["--set", "example.placement.colocate=always"],
    ["--set", "example.placement.spread=1"],
    ["--set", "example.rollout.partition=-1"],
    ["--set-json", 'router.pipelines=[{"name": "a", "model": "m", "tokenizer": "/t", "colour": "x"}]'],
    ["--set-json", 'networkPolicy.metricsFrom=[{"ipBlock": {"cidr": "10.0.0.0/8"}}]'],
    ["--set-json", "networkPolicy.metricsFrom=[{}]"],
    ["--set", "redis.internal.auth.existingSecret=Bad_Secret"],
    ["--set", "autoscaling.keda.enabled=true", "--set", "autoscaling.hpa.enabled=true"],
    ["--set", "autoscaling.metric=latency"],
    ["--set", "autoscaling.target=many"],
    ["--set", "autoscaling.target=0"],
    ["--set", "autoscaling.maxReplicas=0"],
    ["--set", "autoscaling.keda.serverAddress=prometheus:9090"],
]


@pytest.mark.parametrize("values", BAD_VALUES, ids=lambda v: " ".join(v[1::2])[:60])
def test_values_schema_rejects_bad_new_values(tools: Tools, values: list[str]) -> None:
    r = tools.template(*values, check=False)
    assert r.returncode != 0 and "values don't meet the specifications of the schema" in r.stderr, r.stderr
    lint = tools.run(tools.helm, "lint", "--strict", CHART, *values, check=False)
    assert lint.returncode != 0
