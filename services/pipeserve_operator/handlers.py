"""kopf handlers for InferencePipeline, one concern each.

* `reconcile` (create / resume / spec update): the Service and StatefulSet of every group
  0..replicas-1 exist and match the spec (created when missing, their pod template patched when it
  drifted; the template's generation label and `replicas` belong to the timer). Groups >= replicas are
  removed highest index first, but only after they left status.groups (the router's source: it stops
  routing to them) and a drain period passed (`kopf.TemporaryError(delay=…)` for both waits).
* `supervise` (a timer, every TICK_S): observes each group's pods, calls the shared restart decision
  (`pipeserve.care.restarts.decide`), acts on it (groups.act) and writes the whole status. It is the
  only writer of status, so two handlers never race on status.groups.
Deletion: every object carries an owner reference to the resource; the cluster's garbage collector
removes them with it, so there is no deletion handler (and no finalizer).
Operator-wide state is in kopf's memo: `kube` (kube.Kube), `clock` (wall time: records persist across
operator restarts), `drain_s`, `drains` (when each scale-down's drain began).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import kopf

from pipeserve.care.restarts import Phase, RestartPolicy, decide
from pipeserve_operator import groups
from pipeserve_operator.crd import GROUP, PLURAL, VERSION, with_defaults
from pipeserve_operator.kube import Kube
from pipeserve_operator.observe import HASH_ANNOTATION, group_observation, pod_group, template_hash
from pipeserve_operator.resources import (
    GROUP_LABEL,
    SpecError,
    group_name,
    group_network_policy,
    pipeline_selector,
    selector_string,
    stage_service,
    stage_statefulset,
)

TICK_S = 2.0


def spec_hash(spec: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def _entries(status: Any) -> dict[int, dict[str, Any]]:
    return {int(g["index"]): dict(g) for g in (status or {}).get("groups") or [] if "index" in g}


async def _ensure_group(
    kube: Kube, body: dict[str, Any], index: int, entry: dict[str, Any] | None, network_policies: bool
) -> None:
    ns, name = body["metadata"]["namespace"], group_name(body, index)
    if await kube.get_service(ns, name) is None:
        await kube.create_service(ns, stage_service(body, index))
    if network_policies and await kube.get_network_policy(ns, name) is None:
        await kube.create_network_policy(ns, group_network_policy(body, index))
    live = await kube.get_statefulset(ns, name)
    record = groups.load_record(entry, "")
    desired = stage_statefulset(body, index, max(1, record.generation))
    template_spec = desired["spec"]["template"]["spec"]
    digest = spec_hash(template_spec)
    # The hash goes on the pods too: a pod whose hash differs from its StatefulSet's was made from an
    # older spec, and the timer rolls its group (one group at a time).
    desired["spec"]["template"]["metadata"].setdefault("annotations", {})[HASH_ANNOTATION] = digest
    if live is None:
        if record.phase in (Phase.RESTARTING, Phase.FAILED):
            desired["spec"]["replicas"] = 0  # the timer starts it when the backoff is over
        desired["metadata"]["annotations"] = {HASH_ANNOTATION: digest}
        await kube.create_statefulset(ns, desired)
    elif template_hash(live) != digest:
        # Pods are never replaced by the StatefulSet controller (OnDelete): the timer rolls the group.
        cleared = {k: None for k in ("nodeSelector", "tolerations", "affinity") if k not in template_spec}
        patch = {
            "metadata": {"annotations": {HASH_ANNOTATION: digest}},
            "spec": {
                "template": {
                    "metadata": {"annotations": {HASH_ANNOTATION: digest}},
                    "spec": {**template_spec, **cleared},
                }
            },
        }
        await kube.patch_statefulset(ns, name, patch)


@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
async def reconcile(body: Any, status: Any, memo: Any, logger: Any, **_: Any) -> None:
    body = {"metadata": dict(body["metadata"]), "spec": dict(body["spec"])}
    replicas = with_defaults(body["spec"])["replicas"]
    entries = _entries(status)
    try:
        for index in range(replicas):
            await _ensure_group(memo.kube, body, index, entries.get(index), memo.network_policies)
    except SpecError as e:
        raise kopf.PermanentError(f"invalid spec: {e}") from e
    ns = body["metadata"]["namespace"]
    existing = await memo.kube.list_statefulsets(ns, pipeline_selector(body))
    extra = sorted({int(s["metadata"]["labels"][GROUP_LABEL]) for s in existing} - set(range(replicas)))
    if not extra:
        return
    routed = [i for i in entries if i >= replicas]
    if routed:
        raise kopf.TemporaryError(f"groups {routed} still listed in status (routed)", delay=TICK_S)
    # Drain time on the operator's clock, from when the groups were first seen out of routing (kept in
    # memory: an operator restart starts the drain over, which only makes it longer).
    key = (body["metadata"].get("uid"), tuple(extra))
    waited = memo.clock() - memo.drains.setdefault(key, memo.clock())
    if waited < memo.drain_s:
        raise kopf.TemporaryError(f"draining groups {extra}", delay=min(TICK_S, memo.drain_s - waited))
    memo.drains.pop(key, None)
    for index in reversed(extra):
        logger.info(f"scale down: removing group {index}")
        await memo.kube.delete_statefulset(ns, group_name(body, index))
        await memo.kube.delete_service(ns, group_name(body, index))
        if memo.network_policies:
            await memo.kube.delete_network_policy(ns, group_name(body, index))


def _condition(kind: str, ok: bool, reason: str, message: str, previous: dict[str, Any], now: str) -> dict:
    value = "True" if ok else "False"
    old = previous.get(kind) or {}
    since = old.get("lastTransitionTime") if old.get("status") == value else None
    return {
        "type": kind,
        "status": value,
        "reason": reason,
        "message": message,
        "lastTransitionTime": since or now,
    }


def _policy(spec: dict[str, Any]) -> RestartPolicy:
    return RestartPolicy(
        startup_deadline_s=float(spec["startupDeadlineSeconds"]),
        backoff_s=float(spec["restartBackoffSeconds"]),
        backoff_max_s=max(float(spec["restartBackoffMaxSeconds"]), float(spec["restartBackoffSeconds"])),
    )


@kopf.timer(GROUP, VERSION, PLURAL, interval=TICK_S)
async def supervise(body: Any, spec: Any, status: Any, memo: Any, patch: Any, **_: Any) -> None:
    pipeline = {"metadata": dict(body["metadata"]), "spec": dict(spec)}
    full = with_defaults(pipeline["spec"])
    ns, now = pipeline["metadata"]["namespace"], memo.clock()
    entries, digest = _entries(status), spec_hash(full)
    problem = ""
    try:
        stage_statefulset(pipeline, 0, 1)
    except SpecError as e:
        problem = str(e)
    kube: Kube = memo.kube
    pods = await kube.list_pods(ns, pipeline_selector(pipeline))
    sets = {s["metadata"]["name"]: s for s in await kube.list_statefulsets(ns, pipeline_selector(pipeline))}
    present = set(sets)
    records = [groups.load_record(entries.get(i), digest) for i in range(full["replicas"])]
    new_entries, restarts = [], 0
    for index in range(full["replicas"]):
        record = records[index]
        if not problem and group_name(pipeline, index) in present:
            mine = [p for p in pods if pod_group(p) == index]
            # Roll one group at a time, only while every other group serves: capacity drops by one group.
            may_roll = all(r.phase is Phase.READY for i, r in enumerate(records) if i != index)
            obs = group_observation(mine, full["stages"], template_hash(sets[group_name(pipeline, index)]))
            decision = decide(record, dataclasses.replace(obs, may_roll=may_roll), _policy(full), now)
            records[index] = decision.record
            await groups.act(kube, pipeline, index, full["stages"], decision, mine)
            restarts += decision.record.restarts - record.restarts
            record = decision.record
        new_entries.append(groups.group_status(pipeline, index, record, entries.get(index), now, digest))
    ready = sum(1 for e in new_entries if e["ready"])
    failed = [e for e in new_entries if e["phase"] == Phase.FAILED.value]
    previous = {c.get("type"): c for c in (status or {}).get("conditions") or []}
    stamp = groups.rfc3339(now)
    last_failure = problem or next((e["lastFailure"] for e in new_entries if e["lastFailure"]), "")
    degraded = bool(problem or failed)
    settled = ready == full["replicas"] and len(present) == full["replicas"]
    why = problem or (f"groups {[e['index'] for e in failed]} failed" if failed else "")
    patch.status.update(
        {
            "replicas": len([e for e in new_entries if group_name(pipeline, e["index"]) in present]),
            "readyReplicas": ready,
            "restarts": int((status or {}).get("restarts") or 0) + restarts,
            "lastFailure": last_failure or (status or {}).get("lastFailure") or "",
            "selector": selector_string(pipeline_selector(pipeline)),
            "groups": new_entries,
            "conditions": [
                _condition(
                    "Ready",
                    settled,
                    "AllGroupsReady" if settled else "GroupsNotReady",
                    f"{ready}/{full['replicas']} groups ready",
                    previous,
                    stamp,
                ),
                _condition("Progressing", not settled and not degraded, "Reconciling", "", previous, stamp),
                _condition(
                    "Degraded", degraded, "InvalidSpec" if problem else "GroupFailed", why, previous, stamp
                ),
            ],
        }
    )
    if body["metadata"].get("generation") is not None:
        patch.status["observedGeneration"] = body["metadata"]["generation"]
