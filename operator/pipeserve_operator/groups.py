"""Acting on one group's `Decision` (pipeserve.care.restarts), and the group's entry in status.

* START: the StatefulSet's template gets the record's generation and `replicas = stages` (the
  StatefulSet controller then creates every pod of the new incarnation at once: Parallel).
* RESTART / ROLL / FAIL: first the StatefulSet is patched (template generation = the record's next
  generation, `replicas: 0`, so nothing is recreated during the backoff and anything the controller
  recreates from a template it read before the patch is an old generation), then every pod of the
  group is deleted in one step: one DELETE per pod, all issued together (`asyncio.gather`), not a
  deletecollection (per-pod deletes work with any API server and let a missing pod count as done).
  A Kubernetes Event is posted on the resource (reason GroupRestart / GroupRollout / GroupFailed;
  `post_event`: a uniquely named core/v1 Event, as `kubectl describe` shows them).
* NONE / START: pods the decision calls stale (an older generation) are deleted without counting
  a restart; a pod already being deleted is not deleted again.
The record (backoff state) is written into status.groups[i].record so an operator restart keeps it.
"""

from __future__ import annotations

import asyncio
import datetime
import time
import uuid
from typing import Any

from pipeserve.care.restarts import Action, Decision, GroupPhase, GroupRecord
from pipeserve_operator.kube import Kube
from pipeserve_operator.observe import pod_generation, pod_rank
from pipeserve_operator.resources import GENERATION_LABEL, group_endpoint, group_name

EVENT_SOURCE = {"component": "pipeserve-operator"}


def rfc3339(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


async def post_event(kube: Kube, body: Any, type_: str, reason: str, message: str) -> None:
    """An Event on the pipeline (best effort: a failed post never stops the tick)."""
    meta = body["metadata"]
    stamp = rfc3339(time.time())
    event = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{meta['name']}.{uuid.uuid4().hex[:16]}", "namespace": meta["namespace"]},
        "involvedObject": {
            "apiVersion": "pipeserve.io/v1alpha1",
            "kind": "InferencePipeline",
            "name": meta["name"],
            "namespace": meta["namespace"],
            "uid": meta.get("uid"),
        },
        "type": type_,
        "reason": reason,
        "message": message[:1024],
        "source": EVENT_SOURCE,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }
    try:
        await kube.create_event(meta["namespace"], event)
    except Exception:  # noqa: BLE001  (Events are informational)
        pass


def doomed(pods: list[dict[str, Any]], decision: Decision) -> list[dict[str, Any]]:
    """The pods to delete now: every stale rank's pod (all of them on RESTART/FAIL), unless already going."""
    stopping = decision.record.phase in (GroupPhase.RESTARTING, GroupPhase.FAILED)
    return [
        p
        for p in pods
        if pod_rank(p) in decision.stale
        and (stopping or pod_generation(p) != decision.record.generation)
        and not (p.get("metadata") or {}).get("deletionTimestamp")
    ]


async def _set_template(kube: Kube, ns: str, name: str, generation: int, replicas: int) -> None:
    labels = {GENERATION_LABEL: str(generation)}
    patch = {"spec": {"replicas": replicas, "template": {"metadata": {"labels": labels}}}}
    await kube.patch_statefulset(ns, name, patch)


async def act(
    kube: Kube, body: Any, index: int, stages: int, decision: Decision, pods: list[dict[str, Any]]
) -> int:
    """Carry out `decision` for group `index`; returns how many pods were deleted."""
    ns, name = body["metadata"]["namespace"], group_name(body, index)
    record = decision.record
    if decision.action is Action.START:
        await _set_template(kube, ns, name, record.generation, stages)
    elif decision.action in (Action.RESTART, Action.ROLL, Action.FAIL):
        await _set_template(kube, ns, name, record.generation, 0)
    victims = doomed(pods, decision)
    await asyncio.gather(*(kube.delete_pod(ns, p["metadata"]["name"]) for p in victims))
    if decision.action is Action.RESTART:
        message = f"group {index}: {decision.reason}; restart {record.restarts} in {decision.delay_s:.1f}s"
        await post_event(kube, body, "Warning", "GroupRestart", message)
    elif decision.action is Action.ROLL:
        await post_event(kube, body, "Normal", "GroupRollout", f"group {index}: {decision.reason}")
    elif decision.action is Action.FAIL:
        await post_event(kube, body, "Warning", "GroupFailed", f"group {index} failed: {decision.reason}")
    return len(victims)


def group_status(
    body: Any, index: int, record: GroupRecord, previous: dict[str, Any] | None, now: float, spec_hash: str
) -> dict[str, Any]:
    """status.groups[index]: the public fields (contract) plus the decision's record."""
    phase = record.phase.value
    since = (previous or {}).get("since") if (previous or {}).get("phase") == phase else None
    return {
        "index": index,
        "phase": phase,
        "generation": record.generation,
        "restarts": record.restarts,
        "ready": record.phase is GroupPhase.READY,
        "endpoint": group_endpoint(body, index),
        "lastFailure": record.last_failure,
        "since": since or rfc3339(now),
        "record": {**record.to_json(), "specHash": spec_hash},
    }


def load_record(entry: dict[str, Any] | None, spec_hash: str) -> GroupRecord:
    """The persisted record; a Failed group is given a fresh start when the spec changed since."""
    data = dict((entry or {}).get("record") or {})
    if not data:
        return GroupRecord()
    record = GroupRecord.from_json(data)
    if record.phase is GroupPhase.FAILED and data.get("specHash") != spec_hash:
        return GroupRecord(generation=record.generation, restarts=record.restarts)
    return record
