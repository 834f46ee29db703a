"""Running the operator against kmock's KubernetesEmulator, and a simulated StatefulSet controller.

kmock stores objects and serves list/watch/create/patch/delete; it has no controllers, no garbage
collector and no kubelet. `SimulatedStatefulSetController` plays the StatefulSet controller and the
kubelet: for every live StatefulSet it (re)creates missing pods `<sts>-<rank>` from the template and
marks them Running and Ready. With `stale_template=True` it recreates from the template it saw
before the latest patch (the LWS #998/#508 race: a pod recreated before the operator's patch lands).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import time
import uuid
from typing import Any

import kmock

NS = "ml"
CR = "pipeserve.io/v1alpha1/inferencepipelines"
STS, PODS, SVC = "apps/v1/statefulsets", "v1/pods", "v1/services"
NETPOL = "networking.k8s.io/v1/networkpolicies"
PDB, PODGROUPS, NODES = (
    "policy/v1/poddisruptionbudgets",
    "scheduling.volcano.sh/v1beta1/podgroups",
    "v1/nodes",
)


UID = "0f5c3a52-7d0e-4a1e-9d55-6b1a3f3c2e10"


def pipeline(replicas: int = 1, stages: int = 2) -> dict:
    return {
        "apiVersion": "pipeserve.io/v1alpha1",
        "kind": "InferencePipeline",
        "metadata": {"name": "p", "namespace": NS, "uid": UID, "generation": 1, "resourceVersion": "1"},
        "spec": {
            "model": {"path": "/models/demo", "persistentVolumeClaim": "weights"},
            "image": "pipeserve/stage:test",
            "stages": stages,
            "replicas": replicas,
            "engine": {"max-num-seqs": 8, "dtype": "float32"},
            "hicache": {"secretRef": {"name": "redis"}},
            "nccl": {"socketIfname": "eth0"},
            "restartBackoffSeconds": 1,
            "startupDeadlineSeconds": 120,
        },
    }


def declare_resources(k: kmock.KubernetesEmulator) -> None:
    k.resources[CR] = kmock.ResourceInfo(
        kind="InferencePipeline",
        singular="inferencepipeline",
        namespaced=True,
        verbs={"list", "watch", "get", "patch", "create", "delete"},
        subresources={"status", "scale"},
    )
    kinds = (
        (STS, "StatefulSet"),
        (PODS, "Pod"),
        (SVC, "Service"),
        ("v1/events", "Event"),
        (NETPOL, "NetworkPolicy"),
        (PDB, "PodDisruptionBudget"),
        (PODGROUPS, "PodGroup"),
    )
    for res, kind in kinds:
        k.resources[res] = kmock.ResourceInfo(
            kind=kind, namespaced=True, verbs={"list", "watch", "get", "create"}
        )
    k.resources[NODES] = kmock.ResourceInfo(kind="Node", namespaced=False, verbs={"list", "get"})
    k.resources["coordination.k8s.io/v1/leases"] = kmock.ResourceInfo(kind="Lease", namespaced=True)
    # kopf's backbone waits for these two to be discoverable (it does not list them: scanning is off).
    k.resources["v1/namespaces"] = kmock.ResourceInfo(kind="Namespace", namespaced=False, verbs={"list"})
    k.resources["apiextensions.k8s.io/v1/customresourcedefinitions"] = kmock.ResourceInfo(
        kind="CustomResourceDefinition", namespaced=False, verbs={"list", "watch"}
    )


def live(k: kmock.KubernetesEmulator, resource: str) -> dict[str, dict[str, Any]]:
    """name → the current body of every not-deleted object of `resource` in NS."""
    out, wanted = {}, kmock.resource(resource)
    for (res, ns, name), obj in k.objects.items():
        if res == wanted and ns == NS and not obj.deleted:
            out[name] = obj.raw
    return out


def stored(k: kmock.KubernetesEmulator, resource: str, name: str) -> kmock.Object | None:
    """The object with its history (deleted or not); None if it never existed."""
    try:
        return k.objects[resource, NS, name]
    except KeyError:
        return None


def deletions(k: kmock.KubernetesEmulator, name: str) -> int:
    obj = stored(k, PODS, name)
    return sum(1 for v in obj.history if v is None) if obj is not None else 0


def pod_from(sts: dict[str, Any], rank: int, ready: bool = True) -> dict[str, Any]:
    template = sts["spec"]["template"]
    labels = {**template["metadata"]["labels"], "apps.kubernetes.io/pod-index": str(rank)}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{sts['metadata']['name']}-{rank}",
            "namespace": NS,
            "uid": str(uuid.uuid4()),  # as the API server gives every object (kopf keys objects by it)
            "labels": labels,
            "annotations": dict(template["metadata"].get("annotations") or {}),
        },
        "spec": copy.deepcopy(template["spec"]),
        "status": {
            "phase": "Running",
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            "containerStatuses": [{"name": "stage", "restartCount": 0, "ready": ready}],
        },
    }


class SimulatedStatefulSetController:
    def __init__(self, k: kmock.KubernetesEmulator, period_s: float = 0.5) -> None:
        self.k, self.period_s = k, period_s
        self.stale_template = False
        self.seen: dict[str, dict[str, Any]] = {}  # sts name → the template it acts on when stale
        self.created = 0

    def step(self) -> None:
        pods = live(self.k, PODS)  # once a step: this step creates only names that are missing
        for name, sts in live(self.k, STS).items():
            acting = self.seen[name] if self.stale_template and name in self.seen else sts
            if not self.stale_template:
                self.seen[name] = copy.deepcopy(sts)
            for rank in range(int(sts["spec"].get("replicas") or 0)):
                pod_name = f"{name}-{rank}"
                if pod_name in pods:
                    continue
                obj = stored(self.k, PODS, pod_name)
                if obj is not None:
                    obj.create(pod_from(acting, rank))
                else:
                    self.k.objects[PODS, NS, pod_name] = pod_from(acting, rank)
                self.created += 1

    async def run(self) -> None:
        while True:
            self.step()
            await asyncio.sleep(self.period_s)


@contextlib.asynccontextmanager
async def running(coro: Any):
    task = asyncio.create_task(coro)
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def eventually(check: Any, timeout: float = 60.0, step: float = 0.5, wall: bool = False) -> None:
    """Wait until `check()` is truthy; fail at the deadline: loop time, or wall time when `wall`
    (kopf's retry delays, `TemporaryError(delay=…)`, are kept in wall-clock time, which looptime does
    not compress)."""
    clock = time.monotonic if wall else asyncio.get_running_loop().time
    deadline = clock() + timeout
    while not check():
        if clock() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        await asyncio.sleep(step)
