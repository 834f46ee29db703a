"""Group pods stuck Terminating on a lost node (step 5 of a reconcile, supervise.py).

    await free_stuck_pods(kube, pipeline, pods, now, held) -> how many were force-deleted

A pod whose node is NotReady, Unknown or gone never finishes terminating: the kubelet that would
confirm it is not there, so its StatefulSet cannot recreate the rank (same name) and the group stays
down. 30 s past its grace period such a pod is deleted with grace 0, preconditioned on its uid (a pod
recreated meanwhile under the same name is not touched), with an Event.
"""

from __future__ import annotations

import datetime
from typing import Any

from pipeserve_operator import groups
from pipeserve_operator.kube import Kube

STUCK_AFTER_S = 30.0


def _epoch(stamp: str) -> float:
    return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


async def _node_ready(kube: Kube, name: str | None) -> bool:
    node = await kube.get_node(name) if name else None
    if node is None:
        return False
    conditions = (node.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


async def free_stuck_pods(
    kube: Kube, pipeline: dict, pods: list[dict[str, Any]], now: float, held: set[str] | None = None
) -> int:
    """Force-delete the group pods stuck Terminating on a lost node; returns how many.

    A pod that still holds a finalizer is not forced: a grace-0 delete cannot remove it before its
    finalizers are gone. Kueue's pod integration (placement.gang kueue, or a namespace Kueue manages)
    adds `kueue.x-k8s.io/managed` and removes it only once the pod has terminated, which a lost node never
    reports; stripping it would hide the pod from Kueue's quota accounting. So forced deletion is off
    for such a pod: a Warning Event `StuckPod` (once per pod uid: `held`) names the finalizer and the
    remedy (the node tainted out-of-service: the pod GC marks the pod Failed, Kueue then releases it)."""
    forced = 0
    held = set() if held is None else held
    for pod in pods:
        meta = pod.get("metadata") or {}
        stamp = meta.get("deletionTimestamp")
        # deletionTimestamp = when the delete was asked + the grace period: 30 s past the grace period.
        if not stamp or now < _epoch(stamp) + STUCK_AFTER_S:
            continue
        node = (pod.get("spec") or {}).get("nodeName")
        if await _node_ready(kube, node):
            continue  # the kubelet is alive and will finish the termination
        if meta.get("finalizers"):
            if meta.get("uid") not in held:
                held.add(str(meta.get("uid")))
                why = (
                    f"pod {meta['name']} stuck Terminating on node {node or '(none)'} (NotReady or gone), "
                    f"held by finalizers {meta['finalizers']}: not forced (a forced delete waits for them "
                    "too); taint the node node.kubernetes.io/out-of-service=nodeshutdown:NoExecute so that "
                    "the pod is marked Failed and its finalizers' owner (Kueue) releases it"
                )
                await groups.post_event(kube, pipeline, "Warning", "StuckPod", why)
            continue
        if await kube.delete_pod(meta["namespace"], meta["name"], force_uid=meta.get("uid")):
            forced += 1
            why = (
                f"pod {meta['name']} stuck Terminating on node {node or '(none)'} (NotReady or gone): forced"
            )
            await groups.post_event(kube, pipeline, "Warning", "ForcedDeletion", why)
    return forced
