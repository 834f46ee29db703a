"""The operator's writes of the objects it owns, and its few reads (kopf's watches feed the rest).

The `kubernetes` client (synchronous) runs in `asyncio.to_thread`; every call carries a timeout
(`REQUEST_TIMEOUT_S`, connect and read). Objects come back as plain dicts (`_preload_content=False`):
the operator works on JSON like kopf's handlers do, and a missing field never fails a deserializer.
Patches are JSON merge patches (`application/merge-patch+json`): a list in a patch replaces the list.
Owned objects are written whole (`replace_*`: a PUT preconditioned on the `metadata.resourceVersion`
the body names, so a field the operator no longer renders is gone and a concurrent write is a
Conflict, not lost; see writes.py). A refusal other than 404 / 409 (a 4xx: invalid, forbidden, an
admission webhook) raises `Rejected` with the server's own reason and message.
No list or get of an owned kind: the pipelines, their StatefulSets, pods, Services, NetworkPolicies,
PDBs and PodGroups are read from kopf's watch-fed indexes (indexes.py); a write's answer is kept in
`recent` until the watch delivers it (read your own writes). Reads left: a node (stuck pods), a lease.

RBAC: `NEEDS` maps every method to the (apiGroup, resource, verb) it uses; the chart's operator rules
are exactly their union plus what kopf itself does (`KOPF_NEEDS`) — tests/k8s/test_operator_rbac.py
renders the chart and compares (see docs/kubernetes.md).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import kubernetes

from pipeserve_operator.indexes import KINDS, Recent

REQUEST_TIMEOUT_S = (5.0, 15.0)
MERGE = "application/merge-patch+json"


# method → the rights it needs: (apiGroup, resource, verb).
NEEDS: dict[str, tuple[str, str, str]] = {
    "delete_pod": ("", "pods", "delete"),
    "create_statefulset": ("apps", "statefulsets", "create"),
    "patch_statefulset": ("apps", "statefulsets", "patch"),
    "replace_statefulset": ("apps", "statefulsets", "update"),
    "delete_statefulset": ("apps", "statefulsets", "delete"),
    "create_service": ("", "services", "create"),
    "replace_service": ("", "services", "update"),
    "delete_service": ("", "services", "delete"),
    "create_network_policy": ("networking.k8s.io", "networkpolicies", "create"),
    "replace_network_policy": ("networking.k8s.io", "networkpolicies", "update"),
    "delete_network_policy": ("networking.k8s.io", "networkpolicies", "delete"),
    "create_pdb": ("policy", "poddisruptionbudgets", "create"),
    "replace_pdb": ("policy", "poddisruptionbudgets", "update"),
    "create_pod_group": ("scheduling.volcano.sh", "podgroups", "create"),
    "replace_pod_group": ("scheduling.volcano.sh", "podgroups", "update"),
    "delete_pod_group": ("scheduling.volcano.sh", "podgroups", "delete"),
    "get_node": ("", "nodes", "get"),
    "create_event": ("", "events", "create"),
    "patch_pipeline": ("pipeserve.io", "inferencepipelines", "patch"),
    "patch_pipeline_status": ("pipeserve.io", "inferencepipelines/status", "patch"),
    "get_lease": ("coordination.k8s.io", "leases", "get"),
    "create_lease": ("coordination.k8s.io", "leases", "create"),
    "patch_lease": ("coordination.k8s.io", "leases", "patch"),
}
# kopf's own calls: the watches that feed the indexes (the resource, and every kind a pipeline owns:
# indexes.py) and the Events it posts for handler errors.
KOPF_NEEDS = {
    (group, resource, verb)
    for group, resource in (
        ("pipeserve.io", "inferencepipelines"),
        *((group, plural) for group, _, plural in KINDS.values()),
    )
    for verb in ("list", "watch")
} | {("", "events", "create")}
# Cluster-scoped: a ClusterRole even when the operator watches one namespace.
CLUSTER_SCOPED = {"nodes"}
VOLCANO = ("scheduling.volcano.sh", "v1beta1", "podgroups")
PIPELINES = ("pipeserve.io", "v1alpha1", "inferencepipelines")


class NotFound(Exception):
    pass


class Conflict(Exception):
    pass


class Rejected(Exception):
    """The API server refused a request (4xx other than 404 / 409): `status`, `reason` and `message`
    are the server's own (its `Status` body), e.g. 422 Invalid with the field at fault."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status, self.reason, self.message = status, reason, message


def _rejected(e: kubernetes.client.ApiException) -> Rejected:
    reason, message = str(e.reason or ""), ""
    try:
        body = json.loads(e.body or b"{}")
    except (TypeError, ValueError):
        body = {}
    if isinstance(body, dict):
        reason = str(body.get("reason") or reason)
        message = str(body.get("message") or "")
    return Rejected(int(e.status), reason, message or str(e.body or "")[:1024])


def api_client(host: str | None = None) -> kubernetes.client.ApiClient:
    """A client for `host` (tests), else the in-cluster service account, else ~/.kube/config."""
    if host is not None:
        cfg = kubernetes.client.Configuration()
        cfg.host = host
        return kubernetes.client.ApiClient(cfg)
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()
    return kubernetes.client.ApiClient()


class Kube:
    def __init__(self, client: kubernetes.client.ApiClient) -> None:
        self.core = kubernetes.client.CoreV1Api(client)
        self.apps = kubernetes.client.AppsV1Api(client)
        self.coordination = kubernetes.client.CoordinationV1Api(client)
        self.networking = kubernetes.client.NetworkingV1Api(client)
        self.policy = kubernetes.client.PolicyV1Api(client)
        self.custom = kubernetes.client.CustomObjectsApi(client)
        self.recent = Recent()  # this client's latest writes of owned kinds (indexes.py)

    async def _call(self, fn: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        def call() -> dict[str, Any]:
            try:
                resp = fn(*args, _preload_content=False, _request_timeout=REQUEST_TIMEOUT_S, **kwargs)
            except kubernetes.client.ApiException as e:
                if e.status == 404:
                    raise NotFound(str(e.reason)) from e
                if e.status == 409:
                    raise Conflict(str(e.reason)) from e
                if e.status is not None and 400 <= int(e.status) < 500:
                    raise _rejected(e) from e
                raise
            return json.loads(resp.data or b"{}")

        return await asyncio.to_thread(call)

    async def _read(self, fn: Any, name: str, ns: str) -> dict[str, Any] | None:
        """The object, or None when there is none."""
        try:
            return await self._call(fn, name, ns)
        except NotFound:
            return None

    async def _delete(self, fn: Any, name: str, ns: str) -> bool:
        """False when it was already gone (deleting is idempotent for the operator)."""
        try:
            await self._call(fn, name, ns)
        except NotFound:
            return False
        return True

    async def delete_pod(self, ns: str, name: str, force_uid: str | None = None) -> bool:
        """False when it was already gone. `force_uid`: delete at once (grace 0), only if the pod is still
        that one (a precondition on its uid: a pod recreated under the same name is left alone)."""
        if force_uid is None:
            return await self._delete(self.core.delete_namespaced_pod, name, ns)
        body = {"gracePeriodSeconds": 0, "preconditions": {"uid": force_uid}}
        try:
            await self._call(self.core.delete_namespaced_pod, name, ns, body=body, grace_period_seconds=0)
        except (NotFound, Conflict):
            return False
        return True

    async def get_node(self, name: str) -> dict[str, Any] | None:
        try:
            return await self._call(self.core.read_node, name)
        except NotFound:
            return None

    async def create_event(self, ns: str, body: dict[str, Any]) -> None:
        await self._call(self.core.create_namespaced_event, ns, body)

    async def _write(self, kind: str, fn: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """A create / replace / patch of an owned kind; its answer stands in for the index's copy
        until the watch delivers it (indexes.Recent)."""
        out = await self._call(fn, *args, **kwargs)
        self.recent.wrote(kind, out)
        return out

    async def _remove(self, kind: str, ns: str, name: str, fn: Any, *args: Any) -> None:
        """Delete an owned object (already gone: fine); a tombstone stands in until the watch agrees."""
        try:
            await self._call(fn, *args)
        except NotFound:
            pass
        self.recent.gone(kind, ns, name)

    async def create_statefulset(self, ns: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self._write("StatefulSet", self.apps.create_namespaced_stateful_set, ns, body)

    async def patch_statefulset(self, ns: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        fn = self.apps.patch_namespaced_stateful_set
        return await self._write("StatefulSet", fn, name, ns, patch, _content_type=MERGE)

    async def replace_statefulset(self, ns: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self._write("StatefulSet", self.apps.replace_namespaced_stateful_set, name, ns, body)

    async def delete_statefulset(self, ns: str, name: str) -> None:
        await self._remove("StatefulSet", ns, name, self.apps.delete_namespaced_stateful_set, name, ns)

    async def create_service(self, ns: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self._write("Service", self.core.create_namespaced_service, ns, body)

    async def replace_service(self, ns: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self._write("Service", self.core.replace_namespaced_service, name, ns, body)

    async def delete_service(self, ns: str, name: str) -> None:
        await self._remove("Service", ns, name, self.core.delete_namespaced_service, name, ns)

    async def create_network_policy(self, ns: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self._write("NetworkPolicy", self.networking.create_namespaced_network_policy, ns, body)

    async def replace_network_policy(self, ns: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        fn = self.networking.replace_namespaced_network_policy
        return await self._write("NetworkPolicy", fn, name, ns, body)

    async def delete_network_policy(self, ns: str, name: str) -> None:
        fn = self.networking.delete_namespaced_network_policy
        await self._remove("NetworkPolicy", ns, name, fn, name, ns)

    async def create_pdb(self, ns: str, body: dict[str, Any]) -> dict[str, Any]:
        fn = self.policy.create_namespaced_pod_disruption_budget
        return await self._write("PodDisruptionBudget", fn, ns, body)

    async def replace_pdb(self, ns: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        fn = self.policy.replace_namespaced_pod_disruption_budget
        return await self._write("PodDisruptionBudget", fn, name, ns, body)

    async def create_pod_group(self, ns: str, body: dict[str, Any]) -> dict[str, Any]:
        fn = self.custom.create_namespaced_custom_object
        return await self._write("PodGroup", fn, *VOLCANO[:2], ns, VOLCANO[2], body)

    async def replace_pod_group(self, ns: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        fn = self.custom.replace_namespaced_custom_object
        return await self._write("PodGroup", fn, *VOLCANO[:2], ns, VOLCANO[2], name, body)

    async def delete_pod_group(self, ns: str, name: str) -> None:
        fn = self.custom.delete_namespaced_custom_object
        await self._remove("PodGroup", ns, name, fn, *VOLCANO[:2], ns, VOLCANO[2], name)

    async def patch_pipeline(self, ns: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        fn = self.custom.patch_namespaced_custom_object
        return await self._call(fn, *PIPELINES[:2], ns, PIPELINES[2], name, patch, _content_type=MERGE)

    async def patch_pipeline_status(self, ns: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        """Through the status subresource (a write to the main resource would not change status)."""
        fn = self.custom.patch_namespaced_custom_object_status
        return await self._call(fn, *PIPELINES[:2], ns, PIPELINES[2], name, patch, _content_type=MERGE)

    async def get_lease(self, ns: str, name: str) -> dict[str, Any] | None:
        return await self._read(self.coordination.read_namespaced_lease, name, ns)

    async def create_lease(self, ns: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self._call(self.coordination.create_namespaced_lease, ns, body)

    async def patch_lease(self, ns: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        """A patch that names metadata.resourceVersion fails with Conflict if the lease moved on."""
        return await self._call(
            self.coordination.patch_namespaced_lease, name, ns, patch, _content_type=MERGE
        )
