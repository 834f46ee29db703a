"""One reconcile of one pipeline: ensure its objects, supervise its groups, scale down, free stuck
pods, write its status. `handlers.py` calls `tick` when a watch event concerns the pipeline, every
TICK_S while it has something in flight, and at every resync. Everything is read from kopf's
watch-fed indexes (indexes.py): a reconcile that finds nothing to do makes no API request at all.

Order within a tick (each step needs the previous one done):
1. The finalizer an older operator version left (kopf's timer marker) is removed: nothing of this
   operator blocks a deletion. A pipeline being deleted is left to the garbage collector.
2. Every wanted group's objects (groups 0..replicas-1, plus the surge group `replicas` while a rollout
   wants one: `care.restarts.want_surge`), the PodDisruptionBudget and the PodGroups are ensured,
   written whole (writes.py). A write the API server refuses (4xx) holds back only that object: the
   status says Degraded (WriteRejected, the server's message), an Event is posted, the write is
   retried with backoff; the other objects and groups go on.
3. Each group: observe its pods, `decide`, act (groups.act). A group may roll (its pods carry an older
   `pipeserve.io/spec-hash`) only when `care.restarts.may_roll` allows it.
4. Groups no longer wanted leave status.groups (the router stops routing to them) first; their
   objects are deleted, highest index first, `drain_s` after that.
5. A group pod Terminating 30 s past its grace period on a node that is NotReady, Unknown or gone is
   deleted with grace 0 (preconditioned on its uid), with an Event and `status.forcedDeletions` (stuck.py).
6. Status, through the status subresource (this loop is its only writer), only when it changed.
   `observedGeneration` is the
   generation whose objects were all ensured in step 2 (none refused, none raced: a Conflict is
   retried on the next tick; an exception before skips the write);
   `Ready` is True only when that generation is observed and every group 0..replicas-1 is Ready on the
   current spec, and no other group remains: `kubectl wait --for=condition=Ready` after an apply
   never returns mid-rollout (the conditions carry `observedGeneration` too, which kubectl compares).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import msgspec

from pipeserve.care.restarts import (
    FleetGroup,
    GroupObservation,
    GroupPhase,
    GroupRecord,
    RestartPolicy,
    decide,
    max_surge,
    may_roll,
    want_surge,
)
from pipeserve_operator import canary, groups
from pipeserve_operator import spec as spec_model
from pipeserve_operator.canary import Revisions
from pipeserve_operator.crd import with_defaults
from pipeserve_operator.kube import Conflict, Kube, NotFound
from pipeserve_operator.objects import (
    ensure_group,
    ensure_pdb,
    ensure_pod_groups,
    is_surge,
)
from pipeserve_operator.observe import group_observation, pod_group
from pipeserve_operator.resources import (
    GROUP_LABEL,
    SpecError,
    group_name,
    pipeline_selector,
    selector_string,
    stage_statefulset,
)
from pipeserve_operator.spec import PipelineSpec
from pipeserve_operator.stuck import free_stuck_pods
from pipeserve_operator.writes import Refusal, Writer

LEGACY_FINALIZER = "kopf.zalando.org/KopfFinalizerMarker"


def _entries(status: Any) -> dict[int, dict[str, Any]]:
    return {int(g["index"]): dict(g) for g in (status or {}).get("groups") or [] if "index" in g}


def _policy(spec: PipelineSpec) -> RestartPolicy:
    return RestartPolicy(
        startup_deadline_s=float(spec.startupDeadlineSeconds),
        backoff_s=spec.restartBackoffSeconds,
        backoff_max_s=max(spec.restartBackoffMaxSeconds, spec.restartBackoffSeconds),
    )


def _condition(kind: str, ok: bool, reason: str, message: str, previous: dict, now: str, gen: Any) -> dict:
    value = "True" if ok else "False"
    old = previous.get(kind) or {}
    since = old.get("lastTransitionTime") if old.get("status") == value else None
    out = {"type": kind, "status": value, "reason": reason, "message": message}
    out["lastTransitionTime"] = since or now
    if gen is not None:
        out["observedGeneration"] = gen
    return out


@dataclasses.dataclass
class Tick:
    """What one tick saw and decided, for the status."""

    revs: Revisions  # the two specs (canary.py)
    entries: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    restarts: int = 0
    updated: int = 0
    present: set[int] = dataclasses.field(default_factory=set)
    on_target: int = 0  # regular groups running the revision the partition gives them
    unensured: str = ""  # why an object of this generation could not be ensured (not observed)
    refused: list[Refusal] = dataclasses.field(default_factory=list)  # writes the API server refused
    conflicts: int = 0  # writes that raced another writer (retried next tick; not observed)


@dataclasses.dataclass
class Fleet:
    """The pipeline's groups as the indexes show them this tick, and which are wanted."""

    sets: dict[int, dict[str, Any]]  # group index -> its StatefulSet
    records: dict[int, GroupRecord]  # group index -> its supervision record (status.groups)
    by_group: dict[int, list[dict[str, Any]]]  # group index -> its pods
    observed: dict[int, GroupObservation]
    replicas: int  # spec.replicas: groups at or above it are surge groups
    wanted: list[int]  # 0..replicas-1, plus the surge group while a rollout wants one
    extra: list[int]  # groups that exist and are not wanted (scaled away)


async def tick(memo: Any, pipeline: dict[str, Any], status: dict[str, Any]) -> dict[str, Any] | None:
    """Reconcile `pipeline` once; returns the status written (None: none written). The steps are the
    module docstring's, one function each."""
    if not await _live(memo.kube, pipeline):
        return None
    full = with_defaults(pipeline["spec"])
    revs, now, entries = Revisions.of(pipeline, full, status), memo.clock(), _entries(status)
    replicas = spec_model.shape(full).replicas
    typed, surge, problem = _check(pipeline, revs, replicas)
    view = memo.owned.of(pipeline)  # kopf's watch-fed indexes (indexes.py): no API reads
    pods = view.list("Pod")
    fleet = _fleet(view, pods, revs, entries, replicas, surge if not problem else None)
    seen = Tick(revs, present=set(fleet.sets))
    if not problem:
        await _ensure(memo, pipeline, revs, fleet, seen, now)
    await _supervise(memo, pipeline, typed, replicas, fleet, entries, seen, problem)
    await _scale_down(memo, pipeline, fleet.extra, entries, fleet.wanted)
    forced = await free_stuck_pods(memo.kube, pipeline, pods, now, memo.setdefault("held_pods", set()))
    new = json.loads(json.dumps(_status(pipeline, replicas, status, seen, problem, forced, now)))
    if new == status and new == (pipeline.get("status") or {}):
        return None  # nothing changed: no write (its watch event would only wake this pipeline again)
    await memo.kube.patch_pipeline_status(
        pipeline["metadata"]["namespace"], pipeline["metadata"]["name"], {"status": new}
    )
    return new


async def _live(kube: Kube, pipeline: dict[str, Any]) -> bool:
    """Step 1: the legacy finalizer removed; False when this tick stops here (a pipeline being deleted
    is the garbage collector's, a raced finalizer patch is retried next tick)."""
    meta = pipeline["metadata"]
    finalizers = list(meta.get("finalizers") or [])
    if LEGACY_FINALIZER in finalizers:
        # A merge patch replaces the list: the resourceVersion makes it fail (Conflict: next tick) rather
        # than drop a finalizer someone else added meanwhile.
        rest = [f for f in finalizers if f != LEGACY_FINALIZER]
        patch = {"metadata": {"finalizers": rest or None, "resourceVersion": meta.get("resourceVersion")}}
        try:
            await kube.patch_pipeline(meta["namespace"], meta["name"], patch)
        except Conflict:
            return False
    return not meta.get("deletionTimestamp")


def _check(pipeline: dict, revs: Revisions, replicas: int) -> tuple[PipelineSpec | None, int, str]:
    """(the update spec typed, the surge allowed, the problem that stops rendering: "" when none). Both
    revisions must render: the previous one is what groups below rollout.partition keep running."""
    try:
        typed = revs.typed(replicas)  # >= the partition: the update spec (spec.parse, once a tick)
        stage_statefulset(pipeline, typed, 0, 1)
        surge = max_surge(replicas, typed.rollout.maxSurge if typed.rollout else None)
    except msgspec.ValidationError as e:  # a CR stored before a bound existed, or a schema skipped
        return None, 0, f"spec: {e}"
    except (SpecError, ValueError) as e:
        return None, 0, str(e)
    if revs.held_back():
        try:
            stage_statefulset(pipeline, revs.typed(0), 0, 1)
        except (SpecError, msgspec.ValidationError) as e:
            return typed, surge, f"the previous spec, kept below rollout.partition: {e}"
    return typed, surge, ""


def _fleet(view: Any, pods: list, revs: Revisions, entries: dict, replicas: int, surge: int | None) -> Fleet:
    """The groups seen and wanted. `surge`: how many surge groups the rollout may add (None: the spec
    does not render, no surge)."""
    sets = {int(s["metadata"]["labels"][GROUP_LABEL]): s for s in view.list("StatefulSet")}
    records = {
        i: groups.load_record(entries.get(i), revs.digest(i)) for i in set(sets) | set(range(replicas))
    }
    by_group = {i: [p for p in pods if pod_group(p) == i] for i in records}
    observed = {i: group_observation(by_group[i], revs.stages(i), revs.digest(i)) for i in records}

    def outdated(i: int) -> bool:
        return any(s.outdated for s in observed[i].stages if s.generation == records[i].generation)

    fleet = [FleetGroup(i, records[i].phase, outdated(i), is_surge(s)) for i, s in sorted(sets.items())]
    wanted = list(range(replicas))
    if surge is not None and want_surge(replicas, surge, fleet):
        wanted.append(replicas)
        records.setdefault(replicas, groups.load_record(entries.get(replicas), revs.digest(replicas)))
        group = by_group.get(replicas, [])
        observed.setdefault(replicas, group_observation(group, revs.stages(replicas), revs.digest(replicas)))
    extra = sorted(set(sets) - set(wanted))
    return Fleet(sets, records, by_group, observed, replicas, wanted, extra)


async def _ensure(memo: Any, pipeline: dict, revs: Revisions, fleet: Fleet, seen: Tick, now: float) -> None:
    """Step 2: every wanted group's objects, the PDB and the PodGroups, written whole when they drift."""
    writer = Writer(memo, pipeline, now)
    for i in fleet.wanted:
        stopped = fleet.records[i].phase in (GroupPhase.RESTARTING, GroupPhase.FAILED)
        live, surge_group = fleet.sets.get(i), i >= fleet.replicas
        generation = fleet.records[i].generation
        net = memo.network_policies
        typed = revs.typed(i)  # the revision group i renders (canary.py)
        if await ensure_group(writer, revs.view(i), typed, i, generation, live, net, stopped, surge_group):
            seen.present.add(i)
    await ensure_pdb(writer, pipeline)
    try:
        await ensure_pod_groups(writer, pipeline, fleet.wanted + fleet.extra, revs.typed)
    except NotFound:  # the groups still run (unscheduled gangs are the scheduler's business)
        seen.unensured = (
            "placement.gang volcano: the PodGroup API (scheduling.volcano.sh/v1beta1) is not served"
        )
    writer.finish()
    seen.refused, seen.conflicts = writer.refused, writer.conflicts


async def _supervise(
    memo: Any,
    pipeline: dict,
    typed: PipelineSpec | None,
    replicas: int,
    fleet: Fleet,
    entries: dict,
    seen: Tick,
    problem: str,
) -> None:
    """Step 3: each wanted group observed, decided on and acted on; its status entry."""
    now, revs, records, observed = memo.clock(), seen.revs, fleet.records, fleet.observed
    for index in fleet.wanted:
        digest, stages = revs.digest(index), revs.stages(index)
        record = records[index]
        if typed is not None and not problem and index in seen.present:
            group_fleet = [FleetGroup(i, records[i].phase) for i in sorted(seen.present) if i in records]
            obs = dataclasses.replace(observed[index], may_roll=may_roll(index, group_fleet))
            decision = decide(record, obs, _policy(typed), now)
            records[index] = decision.record
            await groups.act(memo.kube, pipeline, index, stages, decision, fleet.by_group.get(index, []))
            seen.restarts += decision.record.restarts - record.restarts
            record = decision.record
        current = [s for s in observed[index].stages if s.generation == record.generation]
        if index < replicas and len(current) == stages and not any(s.outdated for s in current):
            seen.on_target += 1  # on its revision (canary.py): the update spec, or below the partition
            seen.updated += digest == revs.update_revision
        seen.entries.append(groups.group_status(pipeline, index, record, entries.get(index), now, digest))


async def _scale_down(memo: Any, pipeline: dict, extra: list[int], entries: dict, wanted: list[int]) -> None:
    """Groups not wanted go once they left routing (the previous status) and `drain_s` passed since."""
    if not extra or any(i not in wanted for i in entries):
        return
    ns, kube = pipeline["metadata"]["namespace"], memo.kube
    key = (pipeline["metadata"].get("uid"), tuple(extra))
    if memo.clock() - memo.drains.setdefault(key, memo.clock()) < memo.drain_s:
        return
    memo.drains.pop(key, None)
    for index in reversed(extra):
        await kube.delete_statefulset(ns, group_name(pipeline, index))
        await kube.delete_service(ns, group_name(pipeline, index))
        if memo.network_policies:
            await kube.delete_network_policy(ns, group_name(pipeline, index))
    # Their PodGroups go on the next tick (ensure_pod_groups: no StatefulSet, no PodGroup).


def _degraded_reason(problem: str, rejected: str, unensured: str) -> str:
    if problem:
        return "InvalidSpec"
    if rejected:
        return "WriteRejected"
    return "PodGroupsUnavailable" if unensured else "GroupFailed"


def _status(
    pipeline: dict, replicas: int, status: dict, seen: Tick, problem: str, forced: int, now: float
) -> dict[str, Any]:
    """Step 6: the status this tick saw (written only when it changed)."""
    generation, entries, revs = pipeline["metadata"].get("generation"), seen.entries, seen.revs
    rejected = "; ".join(r.describe(now) for r in seen.refused)
    blocked = problem or rejected or seen.unensured
    observed = status.get("observedGeneration") if blocked or seen.conflicts else generation
    # The update spec becomes the current one once every group runs it (canary.py), never a spec that
    # failed to render.
    promoted = seen.updated == replicas and not problem
    last_failure = problem or next((e["lastFailure"] for e in entries if e["lastFailure"]), "")
    out: dict[str, Any] = {
        "replicas": len([e for e in entries if e["index"] in seen.present]),
        "updatedReplicas": seen.updated,
        "readyReplicas": sum(1 for e in entries if e["ready"]),
        "restarts": int(status.get("restarts") or 0) + seen.restarts,
        "forcedDeletions": int(status.get("forcedDeletions") or 0) + forced,
        "lastFailure": last_failure or status.get("lastFailure") or "",
        "selector": selector_string(pipeline_selector(pipeline)),
        "groups": entries,
        "updateRevision": revs.update_revision,
        "currentRevision": revs.update_revision if promoted else revs.current_revision,
        canary.STATUS_FIELD: revs.stored(all_updated=promoted),
        "conditions": _conditions(
            replicas, status, seen, (problem, rejected, blocked), observed == generation, generation, now
        ),
    }
    if observed is not None:
        out["observedGeneration"] = observed
    return out


def _conditions(
    replicas: int,
    status: dict,
    seen: Tick,
    why: tuple[str, str, str],
    current: bool,
    generation: Any,
    now: float,
) -> list[dict[str, Any]]:
    """Ready, Progressing, Degraded. `why`: (the spec's problem, the refused writes, either or the
    unensured PodGroups: what blocks); `current`: this generation's objects were all ensured."""
    problem, rejected, blocked = why
    entries = seen.entries
    regular_ready = sum(1 for e in entries if e["ready"] and e["index"] < replicas)
    failed = [e["index"] for e in entries if e["phase"] == GroupPhase.FAILED.value]
    previous = {c.get("type"): c for c in status.get("conditions") or []}
    stamp = groups.rfc3339(now)
    settled = (
        current
        and not blocked
        and regular_ready == replicas
        and seen.on_target == replicas
        and {e["index"] for e in entries} == set(range(replicas))
        and seen.present == set(range(replicas))
    )
    degraded = bool(blocked or failed)
    revs = seen.revs
    held = (
        f"; groups below rollout.partition {revs.partition} keep the previous spec"
        if revs.held_back()
        else ""
    )
    ready_message = f"{regular_ready}/{replicas} groups ready, {seen.updated}/{replicas} on the current spec"
    reason = _degraded_reason(problem, rejected, seen.unensured)
    return [
        _condition(
            "Ready",
            settled,
            "AllGroupsReady" if settled else "GroupsNotReady",
            ready_message + held,
            previous,
            stamp,
            generation,
        ),
        _condition(
            "Progressing", not settled and not degraded, "Reconciling", "", previous, stamp, generation
        ),
        _condition(
            "Degraded",
            degraded,
            reason,
            blocked or (f"groups {failed} failed" if failed else ""),
            previous,
            stamp,
            generation,
        ),
    ]
