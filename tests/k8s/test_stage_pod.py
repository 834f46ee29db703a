"""The stage pod the operator renders: device, /dev/shm, the rendezvous deadline, pod customization,
owned names, co-location and gang-scheduler metadata. Every CR goes through what the API server does
first (structural pruning, then defaults: crd_support.admitted), every StatefulSet is validated against
the Kubernetes 1.35 schemas (strict), and every stage command is parsed by the real `pipeserve stage`
parser."""

from __future__ import annotations

import argparse
import copy
from typing import Any

import kubernetes_validate
import pytest
from crd_support import admitted, prune
from crd_support import render as render_sts

from pipeserve.cli import build_parser
from pipeserve_operator.crd import spec_schema
from pipeserve_operator.resources import SpecError, pod_group_name

K8S = "1.35"
GROUP_LABELS = {
    "app.kubernetes.io/name": "pipeserve",
    "app.kubernetes.io/component": "stage",
    "pipeserve.io/pipeline": "p",
    "pipeserve.io/group": "1",
}


def cr(**spec: Any) -> dict[str, Any]:
    base = {"model": {"path": "/models/m", "persistentVolumeClaim": "weights"}, "image": "img:1", "stages": 3}
    return {
        "apiVersion": "pipeserve.io/v1alpha1",
        "kind": "InferencePipeline",
        "metadata": {"name": "p", "namespace": "ml", "uid": "u-1"},
        "spec": {**base, **spec},
    }


def render(body: dict[str, Any], index: int = 1) -> dict[str, Any]:
    sts = render_sts(admitted(body), index, 2)
    kubernetes_validate.validate(sts, K8S, strict=True)
    return sts


def pod_of(sts: dict[str, Any]) -> dict[str, Any]:
    return sts["spec"]["template"]["spec"]


def stage_ns(sts: dict[str, Any]) -> argparse.Namespace:
    (c,) = pod_of(sts)["containers"]
    return build_parser().parse_args([*c["command"][1:], *c["args"]])


@pytest.mark.parametrize(
    "device, resources, expected",
    [
        (None, None, "cpu"),
        (None, {"limits": {"nvidia.com/gpu": 1}}, "cuda"),
        (None, {"requests": {"nvidia.com/gpu": "2"}}, "cuda"),
        (None, {"limits": {"nvidia.com/gpu": 0}, "requests": {"cpu": "4"}}, "cpu"),
        (None, {"limits": {"cpu": "4", "memory": "8Gi"}}, "cpu"),
        ("auto", {"limits": {"nvidia.com/gpu": "1"}}, "cuda"),
        ("cpu", {"limits": {"nvidia.com/gpu": 1}}, "cpu"),
        ("cuda", None, "cuda"),
    ],
)
def test_device_is_rendered_and_cuda_pods_get_a_memory_backed_dev_shm(
    device: str | None, resources: dict | None, expected: str
) -> None:
    spec: dict[str, Any] = {}
    if device:
        spec["device"] = device
    if resources:
        spec["resources"] = resources
    sts = render(cr(**spec))
    assert stage_ns(sts).device == expected
    pod = pod_of(sts)
    shm = [v for v in pod["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"]
    mounts = [m for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    if expected == "cuda":
        assert shm == [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}}]
        assert mounts == [{"name": "dshm", "mountPath": "/dev/shm"}]
    else:
        assert shm == [] and mounts == []


def test_shm_size_limit_is_the_specs() -> None:
    pod = pod_of(render(cr(device="cuda", shmSizeLimit="16Gi")))
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}} in pod["volumes"]


def test_connect_timeout_is_the_startup_deadline() -> None:
    assert stage_ns(render(cr())).connect_timeout_s == 900  # the schema's default deadline
    assert stage_ns(render(cr(startupDeadlineSeconds=1800))).connect_timeout_s == 1800


@pytest.mark.parametrize("flag", ["device", "connect-timeout-s"])
def test_flags_derived_from_the_spec_are_refused_in_engine(flag: str) -> None:
    with pytest.raises(SpecError, match=f"engine.{flag}: set by the operator"):
        render_sts(admitted(cr(engine={flag: "cuda" if flag == "device" else 10})), 0, 1)


ENV = [
    {"name": "PLAIN", "value": "v"},
    {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token", "optional": False}}},
    {"name": "MODE", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "mode"}}},
    {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
    {"name": "MEM", "valueFrom": {"resourceFieldRef": {"resource": "limits.memory", "divisor": "1Mi"}}},
]
CUSTOM = {
    "env": ENV,
    "envFrom": [
        {"configMapRef": {"name": "common"}},
        {"prefix": "S_", "secretRef": {"name": "s", "optional": True}},
    ],
    "volumes": [
        {"name": "cache", "persistentVolumeClaim": {"claimName": "hf-cache"}},
        {"name": "cfg", "configMap": {"name": "c"}},
    ],
    "volumeMounts": [
        {"name": "cache", "mountPath": "/cache"},
        {"name": "cfg", "mountPath": "/etc/cfg", "readOnly": True},
    ],
    "podLabels": {"team": "ml", "example.com/tier": "gold"},
    "podAnnotations": {"prometheus.io/scrape": "true"},
    "imagePullSecrets": [{"name": "regcred"}],
    "serviceAccountName": "stage-sa",
    "priorityClassName": "inference",
    "runtimeClassName": "nvidia",
    "schedulerName": "custom-scheduler",
    "topologySpreadConstraints": [
        {
            "maxSkew": 1,
            "topologyKey": "topology.kubernetes.io/zone",
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": {"pipeserve.io/pipeline": "p"}},
        }
    ],
}


def test_value_from_survives_the_api_servers_pruning() -> None:
    assert prune(cr(env=ENV)["spec"], spec_schema())["env"] == ENV
    env = pod_of(render(cr(env=ENV)))["containers"][0]["env"]
    for item in ENV:
        assert item in env, item
    # The pruner does prune: an undeclared field is dropped, as the API server drops it.
    undeclared = prune({"env": [{**ENV[1], "bogus": 1}]}, spec_schema())
    assert undeclared["env"] == [ENV[1]]


def test_every_customization_field_reaches_the_pod() -> None:
    assert prune(CUSTOM, spec_schema()) == CUSTOM, "the schema declares every field, nothing is pruned"
    sts = render(cr(**CUSTOM))
    template = sts["spec"]["template"]
    pod, (container,) = template["spec"], template["spec"]["containers"]
    assert container["envFrom"] == CUSTOM["envFrom"]
    assert container["env"][-len(ENV) :] == ENV
    for vol in CUSTOM["volumes"]:
        assert vol in pod["volumes"]
    for mount in CUSTOM["volumeMounts"]:
        assert mount in container["volumeMounts"]
    assert template["metadata"]["labels"].items() >= CUSTOM["podLabels"].items()
    assert template["metadata"]["labels"].items() >= GROUP_LABELS.items()
    assert template["metadata"]["annotations"] == CUSTOM["podAnnotations"]
    for key in ("imagePullSecrets", "serviceAccountName", "priorityClassName", "runtimeClassName"):
        assert pod[key] == CUSTOM[key], key
    assert pod["schedulerName"] == "custom-scheduler"
    assert pod["topologySpreadConstraints"] == CUSTOM["topologySpreadConstraints"]
    # The operator's own volumes stay, and the selector never takes a user label.
    assert {v["name"] for v in pod["volumes"]} >= {"tmp", "model"}
    assert sts["spec"]["selector"]["matchLabels"] == GROUP_LABELS


@pytest.mark.parametrize(
    "spec, field",
    [
        ({"env": [{"name": "MASTER_ADDR", "value": "evil"}]}, "env[0].name: MASTER_ADDR"),
        ({"env": [{"name": "A", "value": "1"}, {"name": "HOME", "value": "/"}]}, "env[1].name: HOME"),
        ({"env": [{"name": "PIPESERVE_RANK", "value": "0"}]}, "env[0].name: PIPESERVE_RANK"),
        ({"volumes": [{"name": "tmp", "emptyDir": {}}]}, "volumes[0].name: tmp"),
        ({"volumes": [{"name": "dshm", "emptyDir": {}}]}, "volumes[0].name: dshm"),
        ({"volumeMounts": [{"name": "x", "mountPath": "/dev/shm"}]}, "volumeMounts[0].mountPath"),
        ({"volumeMounts": [{"name": "x", "mountPath": "/models"}]}, "volumeMounts[0].mountPath: /models"),
        ({"volumeMounts": [{"name": "model", "mountPath": "/w"}]}, "volumeMounts[0].name: model"),
        ({"podLabels": {"pipeserve.io/group": "9"}}, "podLabels.pipeserve.io/group"),
        ({"podLabels": {"app.kubernetes.io/name": "x"}}, "podLabels.app.kubernetes.io/name"),
        ({"podAnnotations": {"pipeserve.io/template-hash": "x"}}, "podAnnotations.pipeserve.io/"),
        ({"placement": {"gang": "volcano"}, "schedulerName": "default-scheduler"}, "schedulerName"),
        ({"placement": {"gang": "kueue"}}, "placement.queueName"),
    ],
)
def test_names_the_operator_owns_are_refused_naming_the_field(spec: dict, field: str) -> None:
    with pytest.raises(SpecError, match=field.replace(".", r"\.").replace("[", r"\[").replace("]", r"\]")):
        render_sts(admitted(cr(**spec)), 0, 1)


def test_a_model_mount_path_is_free_when_the_operator_mounts_no_model() -> None:
    body = cr(volumes=[{"name": "w", "nfs": {"server": "nfs", "path": "/w"}}])
    body["spec"]["model"] = {"path": "/models/m"}
    body["spec"]["volumeMounts"] = [{"name": "w", "mountPath": "/models"}]
    assert {"name": "w", "mountPath": "/models"} in pod_of(render(body))["containers"][0]["volumeMounts"]


def _term(topology: str = "kubernetes.io/hostname") -> dict[str, Any]:
    return {"labelSelector": {"matchLabels": GROUP_LABELS}, "topologyKey": topology}


def test_colocation_is_preferred_by_default() -> None:
    affinity = pod_of(render(cr()))["affinity"]
    assert affinity == {
        "podAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 100, "podAffinityTerm": _term()}]
        }
    }


def test_colocation_required_none_and_topology_key() -> None:
    pod = pod_of(render(cr(placement={"colocate": "required", "topologyKey": "example.com/rack"})))
    assert pod["affinity"] == {
        "podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [_term("example.com/rack")]}
    }
    assert "affinity" not in pod_of(render(cr(placement={"colocate": "none"})))


def test_colocation_merges_with_the_users_affinity() -> None:
    user_term = {
        "weight": 5,
        "podAffinityTerm": {"labelSelector": {"matchLabels": {"a": "b"}}, "topologyKey": "zone"},
    }
    node = {
        "requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}]
        }
    }
    anti = {
        "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 1, "podAffinityTerm": _term("zone")}]
    }
    affinity = {
        "nodeAffinity": node,
        "podAntiAffinity": anti,
        "podAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [user_term]},
    }
    body = cr(affinity=affinity)
    before = copy.deepcopy(body)
    got = pod_of(render(body))["affinity"]
    assert got["nodeAffinity"] == node and got["podAntiAffinity"] == anti
    assert got["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"] == [
        user_term,
        {"weight": 100, "podAffinityTerm": _term()},
    ]
    assert body == before, "the spec is not modified"


def test_volcano_gang() -> None:
    body = cr(placement={"gang": "volcano"})
    template = render(body)["spec"]["template"]
    assert template["spec"]["schedulerName"] == "volcano"
    assert template["metadata"]["annotations"] == {"scheduling.k8s.io/group-name": pod_group_name(body, 1)}
    assert pod_group_name(body, 1) == "p-g1" and pod_group_name(body, 0) != pod_group_name(body, 1)


def test_kueue_gang() -> None:
    body = cr(placement={"gang": "kueue", "queueName": "gpu-queue"}, podAnnotations={"a": "b"})
    template = render(body)["spec"]["template"]
    labels, annotations = template["metadata"]["labels"], template["metadata"]["annotations"]
    assert labels["kueue.x-k8s.io/pod-group-name"] == pod_group_name(body, 1)
    assert labels["kueue.x-k8s.io/queue-name"] == "gpu-queue"
    assert annotations == {"kueue.x-k8s.io/pod-group-total-count": "3", "a": "b"}
    assert "schedulerName" not in template["spec"]


def test_no_gang_metadata_by_default() -> None:
    template = render(cr())["spec"]["template"]
    assert "annotations" not in template["metadata"] and "schedulerName" not in template["spec"]
    assert not [k for k in template["metadata"]["labels"] if k.startswith("kueue.x-k8s.io/")]


def test_a_full_gpu_pipeline_validates() -> None:
    body = cr(
        resources={"limits": {"nvidia.com/gpu": 1}}, placement={"gang": "kueue", "queueName": "q"}, **CUSTOM
    )
    sts = render(body, 0)
    assert stage_ns(sts).device == "cuda" and stage_ns(sts).connect_timeout_s == 900
