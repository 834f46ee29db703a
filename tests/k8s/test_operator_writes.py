"""Owned objects written whole (writes.py) against kmock with resource versions and PUT (kmock_support.py).

Every optional field of the spec, and every placement mode, is set and then removed: gone from the
StatefulSet's template, from the pods the StatefulSet controller makes afterwards, and (gang volcano →
none) the PodGroups are deleted. A replace keeps what is not the rendering's (another tool's label,
the surge mark, finalizers, the supervisor's replicas) and is preconditioned on resourceVersion.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable
from typing import Any

import kmock
import pytest
from k8s_support import (
    CR,
    NS,
    PODGROUPS,
    PODS,
    STS,
    SimulatedStatefulSetController,
    declare_resources,
    eventually,
    live,
    pipeline,
    running,
)
from test_operator import cr, group_ready, operator

from pipeserve_operator import spec as spec_model
from pipeserve_operator.crd import with_defaults
from pipeserve_operator.kube import Kube, api_client
from pipeserve_operator.main import make_memo
from pipeserve_operator.objects import SURGE_ANNOTATION, desired_statefulset, spec_hash
from pipeserve_operator.observe import HASH_ANNOTATION
from pipeserve_operator.writes import RENDERED_ANNOTATION, Writer, rendered_hash

pytestmark = [pytest.mark.asyncio, pytest.mark.looptime]

Probe = Callable[[dict[str, Any]], bool]  # a pod template or a pod → the field is there


def _desired(body: dict[str, Any]) -> dict[str, Any]:
    """Group 0's StatefulSet as the operator wants it (the spec parsed once, as a reconcile does)."""
    return desired_statefulset(body, spec_model.parse(with_defaults(body["spec"])), 0, 1)


def _spec_key(key: str) -> Probe:
    return lambda t: key in t["spec"]


def _label(key: str, where: str = "labels") -> Probe:
    return lambda t: key in (t["metadata"].get(where) or {})


def _container_key(key: str) -> Probe:
    return lambda t: key in t["spec"]["containers"][0]


def _volume(name: str) -> Probe:
    return lambda t: name in {v["name"] for v in t["spec"].get("volumes") or []}


def _pod_affinity(t: dict[str, Any]) -> bool:
    return "podAffinity" in (t["spec"].get("affinity") or {})


# (id, what the spec sets, the same spec with it removed, how to see it in a template or a pod)
NODE_AFFINITY = {
    "requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100"]}]}]
    }
}
FIELDS: list[tuple[str, dict[str, Any], dict[str, Any], Probe]] = [
    ("priorityClassName", {"priorityClassName": "high"}, {}, _spec_key("priorityClassName")),
    ("runtimeClassName", {"runtimeClassName": "nvidia"}, {}, _spec_key("runtimeClassName")),
    ("serviceAccountName", {"serviceAccountName": "stage"}, {}, _spec_key("serviceAccountName")),
    ("imagePullSecrets", {"imagePullSecrets": [{"name": "reg"}]}, {}, _spec_key("imagePullSecrets")),
    ("schedulerName", {"schedulerName": "custom"}, {}, _spec_key("schedulerName")),
    ("nodeSelector", {"nodeSelector": {"gpu": "h100"}}, {}, _spec_key("nodeSelector")),
    (
        "tolerations",
        {"tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]},
        {},
        _spec_key("tolerations"),
    ),
    (
        "affinity",
        {"affinity": {"nodeAffinity": NODE_AFFINITY}, "placement": {"colocate": "none"}},
        {"placement": {"colocate": "none"}},
        _spec_key("affinity"),
    ),
    (
        "topologySpreadConstraints",
        {
            "topologySpreadConstraints": [
                {"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "ScheduleAnyway"}
            ]
        },
        {},
        _spec_key("topologySpreadConstraints"),
    ),
    ("podLabels", {"podLabels": {"team": "a"}}, {}, _label("team")),
    ("podAnnotations", {"podAnnotations": {"note": "x"}}, {}, _label("note", "annotations")),
    (
        "envFrom",
        {"envFrom": [{"configMapRef": {"name": "cfg"}}]},
        {},
        _container_key("envFrom"),
    ),
    (
        "volumes",
        {
            "volumes": [{"name": "scratch", "emptyDir": {}}],
            "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}],
        },
        {},
        _volume("scratch"),
    ),
    ("colocate preferred -> none", {}, {"placement": {"colocate": "none"}}, _pod_affinity),
    (
        "gang volcano -> none",
        {"placement": {"gang": "volcano"}},
        {"placement": {"gang": "none"}},
        lambda t: "schedulerName" in t["spec"] or _label("scheduling.k8s.io/group-name", "annotations")(t),
    ),
    (
        "gang kueue -> none",
        {"placement": {"gang": "kueue", "queueName": "q"}},
        {"placement": {"gang": "none"}},
        lambda t: _label("kueue.x-k8s.io/queue-name")(t) or _label("kueue.x-k8s.io/pod-group-name")(t),
    ),
]


def _body(extra: dict[str, Any]) -> dict[str, Any]:
    body = pipeline(replicas=1, stages=2)
    body["spec"].update(copy.deepcopy(extra))
    body["spec"]["rollout"] = {"maxSurge": 0}  # one group, rolled in place
    return body


def _replace_spec(k: kmock.KubernetesEmulator, spec: dict[str, Any]) -> None:
    """What the API server stores after `kubectl apply` of a manifest without the field."""
    obj = k.objects[CR, NS, "p"]
    body = copy.deepcopy(obj.raw)
    body["spec"] = copy.deepcopy(spec)
    body["metadata"]["generation"] += 1
    obj.create(body)


@pytest.mark.parametrize("name, extra, without, probe", FIELDS, ids=[f[0] for f in FIELDS])
async def test_a_removed_field_is_gone_from_the_statefulset_and_the_next_pods(
    kmock: kmock.KubernetesEmulator, name: str, extra: dict, without: dict, probe: Probe
) -> None:
    controller = SimulatedStatefulSetController(kmock, period_s=0.2)
    body = _body(extra)
    volcano = "volcano" in name

    def template() -> dict[str, Any]:
        return live(kmock, STS)["p-g0"]["spec"]["template"]

    async with operator(kmock, body), running(controller.run()):
        await eventually(lambda: group_ready(kmock))
        pods = live(kmock, PODS)
        assert probe(template()) and pods and all(probe(p) for p in pods.values()), name
        if volcano:
            assert set(live(kmock, PODGROUPS)) == {"p-g0"}
        spec = _body(without)["spec"]
        _replace_spec(kmock, spec)
        digest = spec_hash(spec)

        def rolled() -> bool:
            pods = live(kmock, PODS).values()
            return len(pods) == 2 and all(
                p["metadata"]["annotations"][HASH_ANNOTATION] == digest for p in pods
            )

        await eventually(rolled, timeout=120)
        await eventually(lambda: group_ready(kmock), timeout=60)
        assert not probe(template()), f"{name} is still in the StatefulSet's template"
        assert not [p["metadata"]["name"] for p in live(kmock, PODS).values() if probe(p)], name
        if volcano:
            await eventually(lambda: not live(kmock, PODGROUPS), timeout=10)
        status = cr(kmock)["status"]
        assert status["observedGeneration"] == 2 and status["conditions"][0]["status"] == "True"


def _memo(k: kmock.KubernetesEmulator) -> Any:
    memo = make_memo(Kube(api_client(str(k.url))), drain_s=5.0)
    return memo


async def test_a_replace_keeps_what_is_not_the_renderings(kmock: kmock.KubernetesEmulator) -> None:
    """Another tool's label and annotation, the surge mark, finalizers and the supervisor's replicas
    stay; the rendering's own fields are written whole; the hash annotation marks the rendering."""
    declare_resources(kmock)
    body = pipeline()
    body["spec"]["priorityClassName"] = "high"
    stale = _desired(body)
    stale["metadata"]["labels"]["argocd.argoproj.io/instance"] = "apps"
    stale["metadata"]["annotations"] = {SURGE_ANNOTATION: "true", "note": "kept"}
    stale["metadata"]["finalizers"] = ["example.com/hold"]
    stale["metadata"]["resourceVersion"] = "7"
    stale["spec"]["replicas"] = 0
    kmock.objects[STS, NS, "p-g0"] = stale
    del body["spec"]["priorityClassName"]
    writer = Writer(_memo(kmock), body, now=0.0)
    assert await writer.ensure(_desired(body), copy.deepcopy(stale))
    sts = live(kmock, STS)["p-g0"]
    assert "priorityClassName" not in sts["spec"]["template"]["spec"]
    assert sts["spec"]["replicas"] == 0 and sts["metadata"]["finalizers"] == ["example.com/hold"]
    assert sts["metadata"]["labels"]["argocd.argoproj.io/instance"] == "apps"
    annotations = sts["metadata"]["annotations"]
    assert annotations[SURGE_ANNOTATION] == "true" and annotations["note"] == "kept"
    assert annotations[RENDERED_ANNOTATION] and sts["metadata"]["resourceVersion"] != "7"
    # In step with the rendering: the next tick writes nothing.
    requests = len(list(kmock))
    assert await Writer(_memo(kmock), body, now=1.0).ensure(_desired(body), sts)
    assert len(list(kmock)) == requests


async def test_a_key_only_an_older_rendering_wrote_is_removed(kmock: kmock.KubernetesEmulator) -> None:
    """An operator upgrade that stops rendering a key (no spec change, nothing else differs): the
    rendering's hash on the object tells, and the replace removes the key."""
    declare_resources(kmock)
    body = pipeline()
    old = _desired(body)
    old["spec"]["minReadySeconds"] = 10  # what the older version rendered on top
    old["metadata"]["annotations"] = {RENDERED_ANNOTATION: rendered_hash(old)}
    kmock.objects[STS, NS, "p-g0"] = old
    assert await Writer(_memo(kmock), body, now=0.0).ensure(_desired(body), old)
    assert "minReadySeconds" not in live(kmock, STS)["p-g0"]["spec"]


async def test_a_replace_is_preconditioned_on_the_resource_version(kmock: kmock.KubernetesEmulator) -> None:
    declare_resources(kmock)
    body = pipeline()
    seen = _desired(body)
    seen["metadata"]["resourceVersion"] = "7"
    kmock.objects[STS, NS, "p-g0"] = seen
    kmock.objects[STS, NS, "p-g0"].patch({"metadata": {"resourceVersion": "8", "labels": {"x": "y"}}})
    body["spec"]["image"] = "pipeserve/stage:v2"
    writer = Writer(_memo(kmock), body, now=0.0)
    assert await writer.ensure(_desired(body), seen)  # it exists, not written
    assert writer.conflicts == 1 and not writer.refused
    sts = live(kmock, STS)["p-g0"]
    assert sts["metadata"]["labels"]["x"] == "y"  # the other writer's change was not lost
    assert sts["spec"]["template"]["spec"]["containers"][0]["image"] == "pipeserve/stage:test"
    await asyncio.sleep(0)
