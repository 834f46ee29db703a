"""The Helm chart, rendered by the real helm v4 and checked by the cluster's own schemas.

* `helm lint --strict` passes with the default values and every override below; `helm template`
  renders objects that each validate against Kubernetes 1.35 (kubernetes-validate, strict: unknown
  fields are errors); our InferencePipeline validates against the CRD's own openAPIV3Schema
  (jsonschema, Draft 4: the schema uses OpenAPI 3.0's boolean exclusiveMinimum); the ServiceMonitor
  (a Prometheus Operator CRD we do not ship) is checked for its shape only.
* kubectl 1.35 parses and maps every rendered object (`create --dry-run=client --validate=false`:
  validation would download the server's OpenAPI; the conftest serves discovery only).
* The CRD file in the chart is the operator's generator output (one source of truth).
* values.schema.json rejects bad values (helm fails before rendering).
* Every pod template is non-root, read-only, capabilities dropped, seccomp RuntimeDefault, /tmp an
  emptyDir; RBAC grants exactly the verbs listed here (the operator's, the router's read-only ones).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from chart_support import CHART, Tools, discovery_server, k8s_tools

from pipeserve_operator.crd import crd_manifest

EXAMPLE = ["--set", "example.enabled=true"]
CASES = {
    "default": [],
    "example": EXAMPLE,
    "external-redis-url": [
        *EXAMPLE,
        "--set",
        "redis.mode=external",
        "--set",
        "redis.external.url=redis://:pw@r:6379/0",
    ],
    "external-redis-secret": [
        *EXAMPLE,
        "--set",
        "redis.mode=external",
        "--set",
        "redis.external.existingSecret=mine",
    ],
    "no-redis": [*EXAMPLE, "--set", "redis.mode=none"],
    "gpus": [
        *EXAMPLE,
        "--set",
        "example.resources.limits.nvidia\\.com/gpu=1",
        "--set",
        "example.image.repository=p/stage",
    ],
    "ingress": ["--set", "router.ingress.enabled=true", "--set", "router.ingress.className=nginx"],
    "dashboards-off": ["--set", "dashboards.enabled=false"],
    "service-monitor": ["--set", "metrics.serviceMonitor.enabled=true"],
    "watch-namespace": [*EXAMPLE, "--set", "operator.watchNamespace=team-a"],
    "volumes": [
        *EXAMPLE,
        *(
            "--set",
            "router.tokenizer.persistentVolumeClaim=models",
            "--set",
            "example.model.hostPath=/srv/models",
        ),
        *("--set", "router.policy=prefix_affinity", "--set", "router.apiKey.existingSecret=keys"),
        *("--set", "imagePullSecrets[0].name=regcred", "--set", "networkPolicy.enabled=false"),
    ],
    # tests/k8s/test_chart_values.py checks what each of these renders.
    "operator-off": [*EXAMPLE, "--set", "operator.enabled=false"],
    "operator-args": ["--set", "operator.drainSeconds=45", "--set", "operator.extraArgs={--log-format,json}"],
    "pipelines": [
        *("--set", "router.pipelines[0].name=a", "--set", "router.pipelines[0].model=m-a"),
        *("--set", "router.pipelines[0].tokenizer=/models/a", "--set", "router.pipelines[1].name=b"),
        *("--set", "router.pipelines[1].model=m-b", "--set", "router.pipelines[1].tokenizer=/models/b"),
        *("--set", "router.pipelines[1].chatTemplate=x", "--set", "router.preStopSleepSeconds=0"),
    ],
    "metrics-from": [
        "--set-json",
        'networkPolicy.metricsFrom=[{"namespaceSelector": {"matchLabels": {"name": "monitoring"}},'
        ' "podSelector": {"matchLabels": {"app": "prometheus"}}}]',
    ],
    "redis-existing-secret": [*EXAMPLE, "--set", "redis.internal.auth.existingSecret=redis-auth"],
    "keda": ["--set", "autoscaling.keda.enabled=true"],
    "hpa": [
        *("--set", "autoscaling.hpa.enabled=true", "--set", "autoscaling.metric=kvUsage"),
        *("--set", "autoscaling.target=0.8", "--set", "autoscaling.hpa.selector.pipeline=demo"),
    ],
}
OUR_CRS = {"InferencePipeline"}


@pytest.fixture(scope="module")
def tools() -> Tools:
    return k8s_tools()


def _crd_schema() -> dict:
    return crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def cr_errors(cr: dict) -> list[str]:
    """The CRD schema's complaints about a custom resource (CEL rules are the API server's: not here)."""
    validator = jsonschema.Draft4Validator(_crd_schema())
    return [f"{'/'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(cr)]


def test_crd_file_is_the_generators_output() -> None:
    shipped = (CHART / "crds" / "inferencepipeline.yaml").read_text()
    assert yaml.safe_load(shipped) == crd_manifest()
    assert shipped == yaml.safe_dump(crd_manifest(), sort_keys=False), (
        "regenerate: python -m pipeserve_operator.crd"
    )


@pytest.mark.parametrize("case", CASES)
def test_lint_strict(tools: Tools, case: str) -> None:
    r = tools.run(tools.helm, "lint", "--strict", CHART, *CASES[case])
    assert "0 chart(s) failed" in r.stdout


@pytest.mark.parametrize("case", CASES)
def test_rendered_objects_validate(tools: Tools, case: str) -> None:
    objects = tools.objects(*CASES[case])
    kinds = {o["kind"] for o in objects}
    assert {"CustomResourceDefinition", "Deployment", "ClusterRole", "Role", "Service"} & kinds
    for obj in objects:
        where = f"{obj['kind']}/{obj['metadata']['name']}"
        if obj["kind"] in OUR_CRS:
            assert cr_errors(obj) == [], where
        elif obj["kind"] == "ServiceMonitor":
            assert obj["apiVersion"] == "monitoring.coreos.com/v1", where
            assert obj["spec"]["selector"]["matchLabels"] and obj["spec"]["endpoints"], where
        elif obj["kind"] == "ScaledObject":  # KEDA's CRD, not shipped: its shape (test_chart_values.py)
            assert obj["apiVersion"] == "keda.sh/v1alpha1", where
            assert obj["spec"]["scaleTargetRef"]["kind"] == "InferencePipeline", where
        else:
            kubernetes_validate.validate(obj, "1.35", strict=True)
    assert ("InferencePipeline" in kinds) == ("example.enabled=true" in CASES[case])
    assert ("ServiceMonitor" in kinds) == (case == "service-monitor")
    assert ("Ingress" in kinds) == (case == "ingress")
    assert ("ScaledObject" in kinds) == (case == "keda")
    assert ("HorizontalPodAutoscaler" in kinds) == (case == "hpa")


@pytest.mark.parametrize(
    "case",
    [
        "default",
        "example",
        "gpus",
        "service-monitor",
        "watch-namespace",
        "volumes",
        "pipelines",
        "keda",
        "hpa",
    ],
)
def test_kubectl_parses_and_maps_every_object(tools: Tools, case: str, tmp_path: Path) -> None:
    objects = tools.objects(*CASES[case])
    with discovery_server(objects, tmp_path) as kubeconfig:
        r = tools.run(
            tools.kubectl, "--kubeconfig", kubeconfig, "create", "--dry-run=client", "--validate=false",
            "-o", "name", "-f", "-", stdin=yaml.safe_dump_all(objects),
        )  # fmt: skip
    want = [
        f"{o['kind'].lower()}{'.' + o['apiVersion'].split('/')[0] if '/' in o['apiVersion'] else ''}/"
        f"{o['metadata']['name']}"
        for o in objects
    ]
    assert sorted(r.stdout.split()) == sorted(want), r.stderr


def _example(tools: Tools, *args: str) -> dict:
    return next(o for o in tools.objects(*EXAMPLE, *args) if o["kind"] == "InferencePipeline")


def test_example_pipeline_points_at_the_releases_redis(tools: Tools) -> None:
    cr = _example(tools)
    assert cr["spec"]["stages"] == 2 and cr["spec"]["model"] == {
        "path": "/models/demo",
        "mountPath": "/models",
    }
    assert cr["spec"]["hicache"] == {"secretRef": {"name": "rel-pipeserve-redis", "key": "url"}}
    secret = next(o for o in tools.objects(*EXAMPLE) if o["kind"] == "Secret")
    assert secret["metadata"]["name"] == "rel-pipeserve-redis" and set(secret["data"]) == {"password", "url"}
    assert "hicache" not in _example(tools, "--set", "redis.mode=none")["spec"]
    ext = _example(tools, "--set", "redis.mode=external", "--set", "redis.external.existingSecret=mine")
    assert ext["spec"]["hicache"] == {"secretRef": {"name": "mine", "key": "url"}}


INVALID = {
    "stages 0": lambda s: s.update(stages=0),
    "stages 65": lambda s: s.update(stages=65),
    "missing model": lambda s: s.pop("model"),
    "model without path": lambda s: s["model"].pop("path"),
    "missing image": lambda s: s.pop("image"),
    "bad policy": lambda s: s.update(router={"policy": "random"}),
    "negative replicas": lambda s: s.update(replicas=-1),
    "bad pull policy": lambda s: s.update(imagePullPolicy="Sometimes"),
    "layerSplit of 0": lambda s: s.update(layerSplit=[0, 2]),
    "zero backoff": lambda s: s.update(restartBackoffSeconds=0),
    "wedge timeout 0": lambda s: s.update(wedgeTimeoutSeconds=0),
    "string stages": lambda s: s.update(stages="2"),
    "env without name": lambda s: s.update(env=[{"value": "x"}]),
}


@pytest.mark.parametrize("name", INVALID)
def test_invalid_pipelines_are_rejected_by_the_crd_schema(tools: Tools, name: str) -> None:
    cr = _example(tools)
    assert cr_errors(cr) == []
    INVALID[name](cr["spec"])
    assert cr_errors(cr), f"{name}: accepted"


def test_exclusive_fields_are_cel_rules() -> None:
    """pvc + hostPath (and url + secretRef) cannot be said in the structural schema a CRD allows
    (no oneOf over required fields without a default-free schema): they are CEL rules, which only the
    API server evaluates. What is checked here: the rules are there, on the right objects."""
    spec = _crd_schema()["properties"]["spec"]
    model_rules = [r["rule"] for r in spec["properties"]["model"]["x-kubernetes-validations"]]
    assert any("persistentVolumeClaim" in r and "hostPath" in r for r in model_rules)
    hicache_rules = [r["rule"] for r in spec["properties"]["hicache"]["x-kubernetes-validations"]]
    assert any("url" in r and "secretRef" in r for r in hicache_rules)


BAD_VALUES = [
    ["--set", "redis.mode=bogus"],
    ["--set", "redis.mode=external"],  # neither a URL nor a Secret
    ["--set", "redis.external.url=http://x"],
    ["--set", "operator.replicas=3"],
    ["--set", "operator.watchNamespace=Bad_NS"],
    ["--set", "operator.unknown=1"],
    ["--set", "router.policy=random"],
    ["--set", "router.toolCallParser=mistral"],
    ["--set", "router.tokenizer.path=relative"],
    ["--set", "router.tokenizer.hostPath=/a", "--set", "router.tokenizer.persistentVolumeClaim=b"],
    ["--set", "router.service.port=0"],
    ["--set", "example.stages=0"],
    ["--set", "example.image.pullPolicy=Sometimes"],
    ["--set", "example.resources.limits.cpu=lots"],
    ["--set", "networkPolicy.enabled=maybe"],
    ["--set", "metrics.serviceMonitor.interval=often"],
]


@pytest.mark.parametrize("values", BAD_VALUES, ids=lambda v: " ".join(v[1::2]))
def test_values_schema_rejects_bad_values(tools: Tools, values: list[str]) -> None:
    r = tools.template(*values, check=False)
    assert r.returncode != 0 and "values don't meet the specifications of the schema" in r.stderr, r.stderr


def _pod_templates(objects: list[dict]) -> list[tuple[str, dict]]:
    return [
        (f"{o['kind']}/{o['metadata']['name']}", o["spec"]["template"]["spec"])
        for o in objects
        if o["kind"] == "Deployment"
    ]


@pytest.mark.parametrize("case", ["default", "volumes"])
def test_every_pod_is_locked_down(tools: Tools, case: str) -> None:
    pods = _pod_templates(tools.objects(*CASES[case]))
    want = {f"Deployment/rel-pipeserve-{c}" for c in ("operator", "router", "redis")}
    assert {name for name, _ in pods} == want
    for name, pod in pods:
        sc = pod["securityContext"]
        assert sc["runAsNonRoot"] is True and sc["runAsUser"] == 10001, name
        assert sc["seccompProfile"] == {"type": "RuntimeDefault"}, name
        tmp = [v for v in pod["volumes"] if v["name"] == "tmp"]
        assert tmp == [{"name": "tmp", "emptyDir": {}}], name
        for c in pod["containers"]:
            csc = c["securityContext"]
            assert csc["readOnlyRootFilesystem"] is True and csc["allowPrivilegeEscalation"] is False, name
            assert csc["capabilities"] == {"drop": ["ALL"]}, name
            assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"], name
            assert c["resources"]["requests"] and c["resources"]["limits"], name
            assert all(
                m.get("readOnly") for m in c["volumeMounts"] if m["name"] != "tmp" and m["name"] != "data"
            )


# What the operator calls (operator/pipeserve_operator/kube.py, kopf's watches of the pipelines and of
# every kind they own, finalizer and status patches, its Events) and what the router's discovery calls
# (list + watch of one InferencePipeline).
OPERATOR_RULES = {
    ("pipeserve.io", "inferencepipelines"): ["list", "watch", "patch"],
    ("pipeserve.io", "inferencepipelines/status"): ["patch"],
    ("apps", "statefulsets"): ["list", "watch", "create", "update", "patch", "delete"],
    ("", "services"): ["list", "watch", "create", "update", "delete"],
    ("", "pods"): ["list", "watch", "delete"],
    ("policy", "poddisruptionbudgets"): ["list", "watch", "create", "update"],
    ("scheduling.volcano.sh", "podgroups"): ["list", "watch", "create", "update", "delete"],
    ("", "events"): ["create"],
    # watched always; written with networkPolicy.enabled
    ("networking.k8s.io", "networkpolicies"): ["list", "watch", "create", "update", "delete"],
    ("coordination.k8s.io", "leases"): ["get", "create", "patch"],
}
ROUTER_RULES = {
    ("pipeserve.io", "inferencepipelines"): ["list", "watch"],
}


def _rules(role: dict) -> dict[tuple[str, str], list[str]]:
    out: dict[tuple[str, str], list[str]] = {}
    for rule in role["rules"]:
        assert set(rule) == {"apiGroups", "resources", "verbs"}, rule  # no resourceNames, no nonResourceURLs
        for g in rule["apiGroups"]:
            for r in rule["resources"]:
                assert (g, r) not in out, (g, r)
                out[(g, r)] = rule["verbs"]
    return out


@pytest.mark.parametrize("watch", ["", "team-a"])
def test_rbac_is_exactly_what_is_used(tools: Tools, watch: str) -> None:
    objects = tools.objects("--set", f"operator.watchNamespace={watch}")
    roles = {o["metadata"]["name"]: o for o in objects if o["kind"] in ("Role", "ClusterRole")}
    assert set(roles) == {"rel-pipeserve-operator", "rel-pipeserve-operator-nodes", "rel-pipeserve-router"}
    assert roles["rel-pipeserve-operator-nodes"]["kind"] == "ClusterRole"  # nodes are cluster-scoped
    assert _rules(roles["rel-pipeserve-operator-nodes"]) == {("", "nodes"): ["get"]}
    op = roles["rel-pipeserve-operator"]
    assert op["kind"] == ("Role" if watch else "ClusterRole")
    assert op["metadata"].get("namespace") == (watch or None)
    assert _rules(op) == OPERATOR_RULES
    assert _rules(roles["rel-pipeserve-router"]) == ROUTER_RULES
    bindings = [o for o in objects if o["kind"].endswith("Binding")]
    assert sorted((b["kind"], b["roleRef"]["kind"], b["subjects"][0]["name"]) for b in bindings) == [
        *sorted(
            [
                (op["kind"] + "Binding", op["kind"], "rel-pipeserve-operator"),
                ("ClusterRoleBinding", "ClusterRole", "rel-pipeserve-operator"),
            ]
        ),
        ("RoleBinding", "Role", "rel-pipeserve-router"),
    ]
    deployment = next(
        o for o in objects if o["metadata"]["name"] == "rel-pipeserve-operator" and o["kind"] == "Deployment"
    )
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    where = ["--namespace", watch, "--lease-namespace", watch] if watch else ["--all-namespaces"]
    assert args == [*where, "--liveness-port", "8080", "--network-policies", "--drain-seconds", "30"]


def test_network_policies(tools: Tools) -> None:
    objects = tools.objects()
    policies = {o["metadata"]["name"]: o["spec"] for o in objects if o["kind"] == "NetworkPolicy"}
    stage_labels = {"app.kubernetes.io/name": "pipeserve", "app.kubernetes.io/component": "stage"}
    # Stage pods get theirs from the operator, one per group (tests/k8s/test_operator.py).
    assert set(policies) == {"rel-pipeserve-redis"}
    operator = next(
        o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("operator")
    )
    assert "--network-policies" in operator["spec"]["template"]["spec"]["containers"][0]["args"]
    redis = policies["rel-pipeserve-redis"]
    assert redis["ingress"] == [
        {
            "from": [{"podSelector": {"matchLabels": stage_labels}}],
            "ports": [{"port": 6379, "protocol": "TCP"}],
        }
    ]
    off = tools.objects("--set", "networkPolicy.enabled=false")
    assert not [o for o in off if o["kind"] == "NetworkPolicy"]
    operator = next(
        o for o in off if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("operator")
    )
    assert "--network-policies" not in operator["spec"]["template"]["spec"]["containers"][0]["args"]
    role = next(
        o for o in off if o["kind"] == "ClusterRole" and o["metadata"]["name"] == "rel-pipeserve-operator"
    )
    # Still watched (the operator's index of the kind), never written.
    assert _rules(role)[("networking.k8s.io", "networkpolicies")] == ["list", "watch"]


def test_internal_redis_requires_the_secrets_password(tools: Tools) -> None:
    objects = tools.objects()
    redis = next(o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-redis"))
    c = redis["spec"]["template"]["spec"]["containers"][0]
    assert c["args"][:2] == ["--requirepass", "$(REDIS_PASSWORD)"]
    assert c["env"][0]["valueFrom"]["secretKeyRef"] == {"name": "rel-pipeserve-redis", "key": "password"}


def test_dashboards_render_one_configmap_per_json(tools: Tools, tmp_path: Path) -> None:
    chart = tmp_path / "pipeserve"
    shutil.copytree(CHART, chart)
    (chart / "dashboards").mkdir(exist_ok=True)
    (chart / "dashboards" / "probe.json").write_text('{"title": "probe", "panels": []}')
    maps = [o for o in tools.objects(chart=chart) if o["kind"] == "ConfigMap"]
    names = sorted(p.name for p in (chart / "dashboards").glob("*.json"))
    assert sorted(next(iter(m["data"])) for m in maps) == names
    assert all(m["metadata"]["labels"]["grafana_dashboard"] == "1" for m in maps)
    # The dashboard the chart ships (docs/observability.md) arrives whole, as Grafana reads it.
    shipped = next(m["data"]["pipeserve.json"] for m in maps if "pipeserve.json" in m["data"])
    assert json.loads(shipped) == json.loads((CHART / "dashboards" / "pipeserve.json").read_text())
    for m in maps:
        kubernetes_validate.validate(m, "1.35", strict=True)
    off = tools.objects("--set", "dashboards.enabled=false", chart=chart)
    assert not [o for o in off if o["kind"] == "ConfigMap"]
